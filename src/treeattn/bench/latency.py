"""Decode-step latency: Tree (each strategy) vs Ring vs local and single-device attention."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..comm.strategies import auto_model, choose_strategy
from ..comm.topology import Topology
from ..dtypes import torch_dtype
from ..ops import attention_state, decode_torch
from ..parallel import ring_decode, tree_decode
from .common import make_shard, shard_sizes, summarize, timed, timed_interleaved

STRATS = ("allreduce3", "allreduce2", "allgather", "hierarchical", "auto")


def measure(cfg: dict, seq: int) -> tuple[list[dict], dict]:
    """On every rank: one context length. Returns (rows, extra) on rank 0 (others: [], {}).

    cfg keys: heads, kv_heads, dim, dtype, batch, reps, warmup, check (compare with float64
    on rank 0), single (also time single-device attention over the full context on rank 0).
    """
    dtype = torch_dtype(cfg["dtype"])
    r, p = dist.get_rank(), dist.get_world_size()
    B, H, Hkv, D = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["dim"]
    sizes = shard_sizes(seq, p)
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(0)).to(dtype)
    k, v = make_shard(r, sizes[r], Hkv, D, dtype, B)
    full = ref_o = None
    tol = float("nan")
    if r == 0 and (cfg["check"] or cfg["single"]):
        parts = [make_shard(i, s, Hkv, D, dtype, B) for i, s in enumerate(sizes)]
        full = (torch.cat([x[0] for x in parts], 2), torch.cat([x[1] for x in parts], 2))
        del parts
        if cfg["check"]:
            # float64 in chunks of keys (decode_torch): a whole float64 copy of K/V would be twice
            # their size again on this rank (the demo's 256k tokens: 8 GiB more)
            ref_o = decode_torch(q.double().reshape(B, Hkv, H // Hkv, D), *full, D**-0.5)[0].reshape(B, H, 1, -1)
            one, _ = attention_state(q, *full)
            tol = 2 * (one.double() - ref_o).abs().max().item() + 1e-6
    methods = {"local": lambda: attention_state(q, k, v)}
    for s in STRATS:
        methods[f"tree {s}"] = lambda s=s: tree_decode(q, k, v, strategy=s, check=False)
    methods["ring"] = lambda: ring_decode(q, k, v, check=False)
    rows, seen = [], {}
    base = {"p": p, "seq": seq, "batch": B, "heads": H, "kv_heads": Hkv, "dim": D, "dtype": cfg["dtype"]}
    for name, fn in methods.items():
        with comm.metering() as m:
            out = fn()
        out = out[0] if isinstance(out, tuple) else out
        err = None
        if ref_o is not None and name != "local":
            err = (out.double() - ref_o).abs().max().item()
        seen[name] = (m, err)
    times = timed_interleaved(methods, cfg["reps"], cfg["warmup"])  # methods side by side, step by step
    for name, (m, err) in seen.items():
        rows.append(
            {"method": name, **base, **summarize(times[name]), "bytes_sent": m.bytes_sent, "collectives": m.collectives,
             "p2p_sends": m.calls.get("send", 0), "max_err": err}
        )  # fmt: skip
    if cfg["single"]:
        if r == 0:
            fn = lambda: attention_state(q, *full)  # noqa: E731
            for _ in range(cfg["warmup"]):
                fn()
            ts = []
            for _ in range(cfg["reps"]):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            rows.append({"method": "single device", **base, **summarize(ts), "bytes_sent": 0, "collectives": 0,
                         "p2p_sends": 0, "max_err": None})  # fmt: skip
        dist.barrier()
    extra = {
        "auto": choose_strategy(B * H * D * 4, B * H * 4, p, Topology.from_env(), profile=auto_model()[0]),
        "auto_model": auto_model()[1],
        "validation_s": validation_cost(q, k[:, :, :16], v[:, :, :16]),
        "tol": tol,
    }
    return (rows, extra) if r == 0 else ([], {})


def validation_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reps: int = 40) -> float:
    """Median extra seconds per call of ``check=True`` (on a tiny shard, so that attention
    time and its noise do not drown the cost)."""
    with_check = summarize(timed(lambda: tree_decode(q, k, v), reps, 3))["median_s"]
    without = summarize(timed(lambda: tree_decode(q, k, v, check=False), reps, 3))["median_s"]
    return with_check - without


def worker(cfg: dict, seqs: list[int], out_path: str) -> None:
    """Launched on every rank: measure each context length; rank 0 appends JSON lines."""
    for seq in seqs:
        rows, extra = measure(cfg, seq)
        if rows:
            with open(out_path, "a") as f:
                for row in rows:
                    f.write(json.dumps({**row, **{f"x_{k}": v for k, v in extra.items()}}) + "\n")


def ratios(rows: list[dict]) -> list[dict]:
    """Ring/Tree ratios per (p, seq) from latency rows."""
    out = []
    keys = sorted({(r["p"], r["seq"]) for r in rows})
    for p, seq in keys:
        m = {r["method"]: r["median_s"] for r in rows if (r["p"], r["seq"]) == (p, seq)}
        if "ring" in m and "tree auto" in m:
            best = min((k for k in m if k.startswith("tree ")), key=m.get)
            out.append(
                {"p": p, "seq": seq, "ring_s": m["ring"], "tree_auto_s": m["tree auto"], "ring/tree(auto)": m["ring"] / m["tree auto"],
                 "best tree": best, "ring/tree(best)": m["ring"] / m[best], "tree(auto)/local": m["tree auto"] / m["local"]}
            )  # fmt: skip
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(4.5 * len(ps), 4), squeeze=False, sharey=True)
    for ax, p in zip(axes[0], ps, strict=True):
        for meth in dict.fromkeys(r["method"] for r in rows):
            pts = sorted(
                (r["seq"], r["median_s"], r["p10_s"], r["p90_s"]) for r in rows if r["p"] == p and r["method"] == meth
            )
            if not pts:
                continue
            x, y, lo, hi = zip(*pts, strict=True)
            ax.errorbar(x, [v * 1e3 for v in y], yerr=[[(a - b) * 1e3 for a, b in zip(y, lo, strict=True)],
                        [(b - a) * 1e3 for a, b in zip(y, hi, strict=True)]], marker="o", label=meth, capsize=2)  # fmt: skip
        ax.set(xscale="log", yscale="log", title=f"p = {p}", xlabel="total context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode step latency (ms, median, p10-p90)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
