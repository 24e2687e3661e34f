"""Shared benchmark plumbing: timing across ranks, memory high-water marks, provenance, output."""

from __future__ import annotations

import csv
import datetime
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .._host import empty_huge


def shard_sizes(seq: int, p: int) -> list[int]:
    """Contiguous split of ``seq`` tokens over ``p`` ranks (the first ``seq % p`` get one more)."""
    return [seq // p + (r < seq % p) for r in range(p)]


def make_shard(r: int, size: int, heads: int, dim: int, dtype: torch.dtype, batch: int = 1):
    """Rank ``r``'s K/V shard ``[batch, heads, size, dim]``, reproducible from ``r`` alone."""
    g = torch.Generator().manual_seed(1000 + r)
    shape = (batch, heads, size, dim)
    # on huge pages where the host allows, as ShardedKVCache allocates its buffers
    k = empty_huge(*shape, dtype=dtype).copy_(torch.randn(*shape, generator=g))
    v = empty_huge(*shape, dtype=dtype).copy_(torch.randn(*shape, generator=g))
    return k, v


def timed(fn: Callable[[], object], reps: int, warmup: int, group=None) -> list[float]:
    """Per-step seconds of ``fn`` on every rank, each step the max over ranks (a step lasts
    as long as its slowest rank). Ranks start each step together (barrier)."""
    for _ in range(warmup):
        fn()
    ts = torch.empty(reps, dtype=torch.float64)
    for i in range(reps):
        if dist.is_initialized():
            dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        ts[i] = time.perf_counter() - t0
    if dist.is_initialized():
        dist.all_reduce(ts, op=dist.ReduceOp.MAX, group=group)
    return ts.tolist()


def timed_interleaved(
    fns: dict[str, Callable[[], object]], reps: int, warmup: int, group=None
) -> dict[str, list[float]]:
    """:func:`timed` for several functions, one step of each in turn per repetition, so that
    a change in the machine's load (shared hosts drift over seconds) hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    ts = torch.empty(len(fns), reps, dtype=torch.float64)
    for i in range(reps):
        for j, fn in enumerate(fns.values()):
            if dist.is_initialized():
                dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            ts[j, i] = time.perf_counter() - t0
    if dist.is_initialized():
        dist.all_reduce(ts, op=dist.ReduceOp.MAX, group=group)
    return {name: ts[j].tolist() for j, name in enumerate(fns)}


def summarize(ts: list[float]) -> dict[str, float]:
    s = sorted(ts)
    q = lambda f: s[round(f * (len(s) - 1))]  # noqa: E731
    return {"median_s": statistics.median(s), "p10_s": q(0.1), "p90_s": q(0.9), "reps": len(s)}


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[int, object]:
    """Bytes allocated by ``fn`` at its peak above what was resident before it, measured:
    on CUDA ``max_memory_allocated``; on CPU the process's resident-set high-water mark
    (``VmHWM``, reset through ``/proc/self/clear_refs``). Large tensors are mmap-backed, so
    RSS follows tensor allocations closely."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    out = fn()
    return max(0, _status("VmHWM") - base), out


def provenance(**extra) -> dict:
    from .. import __version__

    cpu = "unknown"
    try:
        cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["treeattn", *sys.argv[1:]]) if sys.argv else "",
        "treeattn": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": "cuda" if torch.cuda.is_available() else f"cpu ({cpu})",
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
        **extra,
    }


def write_results(out: Path, name: str, rows: list[dict], prov: dict, columns: list[str]) -> None:
    """``out/name.json`` (provenance + rows), ``out/name.csv`` and a markdown table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / f"{name}.csv", "w", newline="") as f:
        f.write("".join(f"# {k}: {v}\n" for k, v in prov.items()))
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(markdown(rows, columns))


def markdown(rows: list[dict], columns: list[str]) -> str:
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def finish_figure(fig, axes, path: Path, legend_title: str | None = None, fontsize: int = 7) -> None:
    """Grid and legend on every axis, tight layout, saved as ``path`` (110 dpi)."""
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title=legend_title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
