"""Peak memory per rank of one decode step, Tree vs Ring, against the paper's eq. 8-9.

Measured, not computed: the bytes a step allocates at its peak (CPU: resident-set
high-water mark; CUDA: max_memory_allocated) plus the resident local K/V shard. Ring's
persistent receive buffers are released before its measured step, so they count. The paper's
model (elements, d = hidden size, n_h heads, t = S/p tokens per rank, b batch)::

    Mem_ring = 4 b t d + 2 b d          (local K/V + the incoming K/V block, plus q/out)
    Mem_tree = 2 b t d + 2 b d + 2 b n_h (local K/V, plus q/out and the lse/max scalars)
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..dtypes import torch_dtype
from ..parallel import ring_decode, tree_decode
from ..parallel.ring import release_buffers
from .common import finish_figure, make_shard, peak_memory, shard_sizes


def predicted(method: str, p: int, seq: int, batch: int, heads: int, dim: int, elem: int) -> int:
    """Eq. 8-9 in bytes (``elem`` bytes per element)."""
    t, d = -(-seq // p), heads * dim
    if method == "ring":
        return (4 * batch * t * d + 2 * batch * d) * elem
    return (2 * batch * t * d + 2 * batch * d + 2 * batch * heads) * elem


def worker(cfg: dict, points: list[tuple[int, int, int]], out_path: str) -> None:
    """points: (seq, heads, dim). Rank 0 appends JSON lines; each value is the max over ranks."""
    r, p = dist.get_rank(), dist.get_world_size()
    dtype = torch_dtype(cfg["dtype"])
    elem = torch.finfo(dtype).bits // 8
    for seq, heads, dim in points:
        q = torch.randn(1, heads, 1, dim, generator=torch.Generator().manual_seed(0)).to(dtype)
        k, v = make_shard(r, shard_sizes(seq, p)[r], heads, dim, dtype)
        resident = k.nbytes + v.nbytes
        for method, fn in (
            ("tree allgather", partial(tree_decode, q, k, v, strategy="allgather", check=False)),
            ("tree allreduce3", partial(tree_decode, q, k, v, strategy="allreduce3", check=False)),
            ("ring", partial(ring_decode, q, k, v, check=False)),
        ):
            fn()  # warm-up: lazy allocations of the first call are not the step's
            release_buffers()  # but Ring's two receive buffers are: it must hold them to step
            dist.barrier()
            step, _ = peak_memory(fn, q.device)
            release_buffers()
            t = torch.tensor([step, resident], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if r == 0:
                pred = predicted("ring" if method == "ring" else "tree", p, seq, 1, heads, dim, elem)
                row = {"method": method, "p": p, "seq": seq, "heads": heads, "dim": dim, "dtype": cfg["dtype"],
                       "resident_kv_bytes": int(t[1]), "step_peak_bytes": int(t[0]),
                       "measured_bytes": int(t[0] + t[1]), "predicted_bytes": pred,
                       "measured/predicted": float((t[0] + t[1]) / pred)}  # fmt: skip
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    dims = sorted({r["heads"] * r["dim"] for r in rows})
    base = [r for r in rows if r["heads"] * r["dim"] == dims[-1]]
    for meth, c in (("tree allgather", "C0"), ("tree allreduce3", "C2"), ("ring", "C3")):
        pts = sorted((r["seq"], r["measured_bytes"], r["predicted_bytes"]) for r in base if r["method"] == meth)
        if pts:
            x, m, pr = zip(*pts, strict=True)
            axes[0].plot(x, [v / 2**20 for v in m], "o-", color=c, label=f"{meth} measured")
            axes[0].plot(x, [v / 2**20 for v in pr], "--", color=c, alpha=0.6, label=f"{meth} eq. 8-9")
    axes[0].set(xscale="log", yscale="log", xlabel="total context (tokens)", ylabel="peak MiB per rank",
                title=f"hidden {dims[-1]}")  # fmt: skip
    seqs = sorted({r["seq"] for r in rows})
    by_d = [r for r in rows if r["seq"] == seqs[-1]]
    for meth, c in (("tree allgather", "C0"), ("ring", "C3")):
        pts = sorted(
            (r["heads"] * r["dim"], r["measured_bytes"], r["predicted_bytes"]) for r in by_d if r["method"] == meth
        )
        if pts:
            x, m, pr = zip(*pts, strict=True)
            axes[1].plot(x, [v / 2**20 for v in m], "o-", color=c, label=f"{meth} measured")
            axes[1].plot(x, [v / 2**20 for v in pr], "--", color=c, alpha=0.6, label=f"{meth} eq. 8-9")
    axes[1].set(xscale="log", yscale="log", xlabel="hidden size (heads x dim)", title=f"context {seqs[-1]:,}")
    finish_figure(fig, axes, path)
    plt.close(fig)
