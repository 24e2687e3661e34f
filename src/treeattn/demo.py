"""``treeattn demo``: Tree vs Ring decoding over a sharded KV on local ranks."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from . import comm
from .comm.strategies import choose_strategy
from .comm.topology import Topology
from .ops.attention import _attention
from .parallel import ring_decode, tree_decode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STRATS = ("allreduce3", "allreduce2", "allgather", "hierarchical", "auto")


def shard_sizes(seq: int, p: int) -> list[int]:
    return [seq // p + (r < seq % p) for r in range(p)]


def make_shard(r: int, size: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + r)
    k = torch.randn(1, heads, size, dim, generator=g).to(dtype)
    v = torch.randn(1, heads, size, dim, generator=g).to(dtype)
    return k, v


def _timed(fn, reps: int, warmup: int) -> torch.Tensor:
    for _ in range(warmup):
        fn()
    ts = torch.empty(reps, dtype=torch.float64)
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
    dist.all_reduce(ts, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return ts


def worker(seq: int, heads: int, kv_heads: int, dim: int, dtype_name: str, reps: int, warmup: int) -> None:
    dtype = DTYPES[dtype_name]
    r, p = dist.get_rank(), dist.get_world_size()
    sizes = shard_sizes(seq, p)
    q = torch.randn(1, heads, 1, dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    k, v = make_shard(r, sizes[r], kv_heads, dim, dtype)
    ref_o = tol = None
    if r == 0:
        full = [make_shard(i, s, kv_heads, dim, dtype) for i, s in enumerate(sizes)]
        fk, fv = torch.cat([x[0] for x in full], 2), torch.cat([x[1] for x in full], 2)
        del full
        ref_o, _ = _attention(q.double(), fk.double(), fv.double(), backend="torch")
        one_pass, _ = _attention(q, fk, fv)
        tol = 2 * (one_pass.double() - ref_o).abs().max().item() + 1e-6
        del fk, fv
    methods: dict[str, object] = {"local attention (own shard, no comm)": lambda: _attention(q, k, v)}
    for s in STRATS:
        methods[f"tree {s}"] = lambda s=s: tree_decode(q, k, v, strategy=s, check=False)
    methods["ring"] = lambda: ring_decode(q, k, v, check=False)
    rows = []
    for name, fn in methods.items():
        with comm.metering() as m:
            out = fn()
        out = out[0] if isinstance(out, tuple) else out
        err = (out.double() - ref_o).abs().max().item() if r == 0 and name != next(iter(methods)) else None
        ts = _timed(fn, reps, warmup)
        rows.append((name, ts, err, m.bytes_sent, m.collectives, m.calls.get("send", 0)))
    t_check = _timed(lambda: tree_decode(q, k, v), reps, warmup)
    t_nocheck = _timed(lambda: tree_decode(q, k, v, check=False), reps, warmup)
    if r != 0:
        return
    nb = heads * dim * 4
    auto = choose_strategy(nb, heads * 4, p, Topology.from_env())
    print(
        f"treeattn demo: p={p} ranks (gloo, 1 thread each), {seq:,} tokens ({sizes[0]:,} per rank), "
        f"q {heads} heads, kv {kv_heads} heads x {dim}, {dtype_name}, B=1, Tq=1, {reps} steps after {warmup} warm-up"
    )
    print("\n| method | median ms | p10-p90 ms | max err vs float64 | bytes sent/rank/step | collectives + p2p |")
    print("|---|---|---|---|---|---|")
    med = {}
    for name, ts, err, sent, ncoll, nsend in rows:
        ms = sorted(ts.tolist())
        med[name] = statistics.median(ms)
        lo, hi = ms[int(0.1 * (len(ms) - 1))], ms[int(0.9 * (len(ms) - 1))]
        e = "-" if err is None else f"{err:.2e}"
        print(
            f"| {name} | {med[name] * 1e3:.2f} | {lo * 1e3:.2f}-{hi * 1e3:.2f} | {e} | {sent:,} | {ncoll}"
            + (f" + {nsend} sends" if nsend else "")
            + " |"
        )
    local = med["local attention (own shard, no comm)"]
    best = min((s for s in STRATS), key=lambda s: med[f"tree {s}"])
    print(f"\nauto picked: {auto} (cost model, {nb + heads * 4:,}-byte state)")
    print(
        f"Ring / Tree(auto) = {med['ring'] / med['tree auto']:.2f}x;  Ring / Tree(best: {best}) = "
        f"{med['ring'] / med[f'tree {best}']:.2f}x;  Tree(auto) / local attention = {med['tree auto'] / local:.2f}x"
    )
    print(
        f"validation (check=True) adds {(statistics.median(t_check.tolist()) - statistics.median(t_nocheck.tolist())) * 1e3:.2f} ms per call"
        f" (median {statistics.median(t_check.tolist()) * 1e3:.2f} vs {statistics.median(t_nocheck.tolist()) * 1e3:.2f} ms)"
    )
    bad = [name for name, _, err, *_ in rows if err is not None and err > tol]
    print(f"tolerance (2x one-pass {dtype_name} error): {tol:.2e} -> " + ("all exact" if not bad else f"FAILED: {bad}"))
    if bad:
        raise SystemExit(f"results outside tolerance: {bad}")
