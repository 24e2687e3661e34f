"""Communication volume per rank per decode step from the comm meter, against eq. 10-14.

Paper (elements; b batch, d hidden, n_h heads, t = S/p)::

    V_ring = 2 b t d  per hop, (p - 1) hops per step and rank
    V_tree = 2 (p-1)/p (b d + 2 b n_h)   (eq. 14: all-reduces of out, max and sum)
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..parallel import ring_decode, tree_decode
from .common import finish_figure, make_shard, shard_sizes

STRATS = ("allreduce3", "allreduce2", "allgather", "hierarchical")


def predicted(method: str, p: int, seq: int, heads: int, dim: int, elem: int) -> float:
    d = heads * dim
    if method == "ring":
        return (p - 1) * 2 * -(-seq // p) * d * elem
    return 2 * (p - 1) / p * (d + 2 * heads) * 4  # reductions run in float32


def worker(cfg: dict, seqs: list[int], out_path: str) -> None:
    r, p = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, cfg["dtype"])
    elem = torch.finfo(dtype).bits // 8
    H, D = cfg["heads"], cfg["dim"]
    for seq in seqs:
        q = torch.randn(1, H, 1, D, generator=torch.Generator().manual_seed(0)).to(dtype)
        k, v = make_shard(r, shard_sizes(seq, p)[r], H, D, dtype)
        calls = [(f"tree {s}", partial(tree_decode, q, k, v, strategy=s, check=False)) for s in STRATS]
        for name, fn in [*calls, ("ring", partial(ring_decode, q, k, v, check=False))]:
            with comm.metering() as m:
                fn()
            t = torch.tensor([m.bytes_sent, m.bytes_recv], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r == 0:
                pred = predicted("ring" if name == "ring" else "tree", p, seq, H, D, elem)
                row = {"method": name, "p": p, "seq": seq, "heads": H, "dim": D, "dtype": cfg["dtype"],
                       "bytes_sent": int(t[0]), "bytes_recv": int(t[1]), "collectives": m.collectives,
                       "p2p_sends": m.calls.get("send", 0), "eq_bytes": pred,
                       "measured/eq": float(t[0] / pred) if pred else float("nan")}  # fmt: skip
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    pmax = ps[-1]
    for i, meth in enumerate(dict.fromkeys(r["method"] for r in rows)):
        pts = sorted((r["seq"], r["bytes_sent"], r["eq_bytes"]) for r in rows if r["method"] == meth and r["p"] == pmax)
        if pts:
            x, y, e = zip(*pts, strict=True)
            axes[0].plot(x, y, "o-", color=f"C{i}", label=meth)
            axes[0].plot(x, e, ":", color=f"C{i}", alpha=0.5)
    axes[0].set(xscale="log", yscale="log", xlabel="total context (tokens)", ylabel="bytes sent per rank per step",
                title=f"p = {pmax} (dotted: eq. 10-14)")  # fmt: skip
    smax = max(r["seq"] for r in rows)
    for i, meth in enumerate(dict.fromkeys(r["method"] for r in rows)):
        pts = sorted((r["p"], r["bytes_sent"]) for r in rows if r["method"] == meth and r["seq"] == smax)
        if pts:
            x, y = zip(*pts, strict=True)
            axes[1].plot(x, y, "o-", color=f"C{i}", label=meth)
    axes[1].set(yscale="log", xlabel="ranks p", title=f"context {smax:,}")
    finish_figure(fig, axes, path)
    plt.close(fig)
