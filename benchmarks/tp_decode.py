"""The weights split over the ranks or not: treeattn at p ranks over a long document, with and without
``tensor_parallel`` (the CLI's ``--tp``), against plain transformers in one process.

The real SmolLM2-135M-Instruct model (float32, packed linears: the CLI's default), the GPL-3 text
and a question (~7.7k tokens), greedy, ``--max-new-tokens`` tokens. Each round runs transformers
(``--threads`` threads, packed linears too), then treeattn whole, then treeattn split, each in a
fresh launch (so each rank's peak memory is its own; split: each rank reads only its shards of
the checkpoint, ``load_split``), ``--runs`` rounds alternating. ms/token:
the time after the first token over the tokens after it (treeattn: the slowest rank); TTFT: the
prefill and the first token; peak memory: each rank's resident peak (VmHWM). Not a test: it
prints what it measured, the medians and every run.

    python benchmarks/tp_decode.py --runs 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
from pathlib import Path

from _fixture import document, smollm2_gguf, transformers_timed  # benchmarks/_fixture.py, beside this script
from speculative import QUESTIONS


def transformers_run(model_dir, ids, new, threads, q):
    from treeattn._host import peak_memory_bytes

    q.put((*transformers_timed(model_dir, ids, new, threads, packed=True), peak_memory_bytes()))


def treeattn_run(model_dir, ids, new, split, outdir):
    import torch
    import torch.distributed as dist

    from treeattn.decoding import generate
    from treeattn.hf import load_split
    from treeattn.hf.linear import pack_linears
    from treeattn.hf.models import load_model

    model = (load_split if split else load_model)(model_dir)[0]  # split: each rank reads its shards only
    pack_linears(model)
    info = {}
    out = generate(model, ids, max_new_tokens=new, info=info)
    t = torch.tensor([sum(info["decode"]), info["ttft"]])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    peaks = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([info["peak_bytes"]]))
    if dist.get_rank() == 0:
        row = dict(toks=out[0].tolist(), ms=1e3 * float(t[0]) / max(len(info["decode"]), 1), ttft=float(t[1]),
                   peaks=[int(x) for x in peaks])  # fmt: skip
        Path(outdir, "row.json").write_text(json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--question", choices=list(QUESTIONS), default="explain")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="transformers' threads")
    ap.add_argument("--max-new-tokens", type=int, default=33)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import resolve_model
    from treeattn.launch import launch

    d = str(resolve_model(str(smollm2_gguf())))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    ids = chat_ids(tok, document(a.doc) + QUESTIONS[a.question])
    new = a.max_new_tokens
    print(f"{a.doc}: {ids.shape[1]:,} prompt tokens, greedy, {new} new tokens, packed linears; treeattn p={a.nproc} "
          f"(1 thread per rank), transformers {a.threads} threads", flush=True)  # fmt: skip
    rows: dict[str, list[tuple]] = {}
    ctx = mp.get_context("spawn")
    for run in range(a.runs):
        q = ctx.Queue()
        p = ctx.Process(target=transformers_run, args=(d, ids, new, a.threads, q))
        p.start()
        ref, ttft, spt, peak = q.get()
        p.join()
        rows.setdefault("transformers", []).append((1e3 * spt, ttft, [peak]))
        for name, split in (("treeattn, weights whole", False), ("treeattn, weights split (--tp)", True)):
            with tempfile.TemporaryDirectory() as tmp:
                launch(treeattn_run, a.nproc, (d, ids, new, split, tmp), timeout=7200)
                r = json.loads(Path(tmp, "row.json").read_text())
            if r["toks"] != ref:
                print(f"run {run}: {name} gave other tokens than transformers", flush=True)
            rows.setdefault(name, []).append((r["ms"], r["ttft"], r["peaks"]))
        print(f"run {run}: " + "; ".join(f"{k} {v[-1][0]:.1f} ms/token, TTFT {v[-1][1]:.1f} s" for k, v in rows.items()),
              flush=True)  # fmt: skip
    base = statistics.median(x[0] for x in rows["transformers"])
    base_ttft = statistics.median(x[1] for x in rows["transformers"])
    whole_peak = statistics.median(max(x[2]) for x in rows["treeattn, weights whole"])
    print("\n| | ms/token (runs) | median | vs transformers | TTFT s (median) | vs transformers | peak MiB per rank "
          "(median of the largest) | vs weights whole |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, xs in rows.items():
        ms, tt = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        pk = statistics.median(max(x[2]) for x in xs)
        rel = f"{pk / whole_peak:.2f}x" if name != "transformers" else ""
        print(f"| {name} | {', '.join(f'{x[0]:.1f}' for x in xs)} | {ms:.1f} | {ms / base:.2f}x | {tt:.1f} | "
              f"{tt / base_ttft:.2f}x | {pk / 2**20:.0f} | {rel} |")


if __name__ == "__main__":
    main()
