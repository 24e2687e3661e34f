"""``treeattn bench kernel``: local decode attention of every CPU backend vs the read-bandwidth floor.

Floor = (K + V bytes in their own dtype) / (this machine's single-thread read bandwidth),
the bandwidth measured with a read-only reduction (``torch.sum`` over a 512 MiB float32
buffer). K, V and that buffer sit on the same kind of pages: 2 MiB transparent huge pages
where the host allows (as :class:`~treeattn.cache.ShardedKVCache` allocates), 4 KiB pages with
``--small-pages``; the header says how much of the floor buffer got huge pages. On a shared machine the load drifts, so every timed call is paired with a bandwidth
measurement taken just before it: % of floor is the median over reps of (floor from that
rep's bandwidth) / (that rep's time); ms is the median time. Per dtype x heads x S: ms, GB/s and % of the floor for every
backend (1 thread) and for decode_cpu with ``--threads`` threads, median of ``--reps``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

from .._argtypes import at_least
from .._host import empty_huge, huge_page_bytes
from ..dtypes import CHOICES

K = 1024


def _time(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def read_bandwidth(reps: int = 7, mib: int = 512, buf: torch.Tensor | None = None) -> float:
    """Bytes per second one thread reads in ``torch.sum`` over ``mib`` MiB of float32 (or ``buf``)."""
    x = torch.ones(mib * (1 << 20) // 4) if buf is None else buf
    return x.numel() * 4 / _time(lambda: x.sum(), reps)


def _paired(f, buf: torch.Tensor, nbytes: int, reps: int) -> tuple[float, float, float]:
    """(median seconds of f, median fraction of the floor, median read bytes/s), each rep of
    f right after a ``torch.sum`` over ``buf``."""
    f()
    ts, fr, bws = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        t1 = time.perf_counter()
        f()
        t2 = time.perf_counter()
        bw = buf.numel() * buf.element_size() / (t1 - t0)
        ts.append(t2 - t1)
        bws.append(bw)
        fr.append(nbytes / bw / (t2 - t1))
    return statistics.median(ts), statistics.median(fr), statistics.median(bws)


def run(a) -> int:
    from ..ops import attention_state, kernel_info
    from ..ops.kernels import pick as _pick_backend

    torch.set_num_threads(1)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"] * 3
    alloc = functools.partial(empty_huge, huge=not a.small_pages)
    h0 = huge_page_bytes()
    buf = alloc(512 * (1 << 20) // 4, dtype=torch.float32).fill_(1.0)
    asked = "4 KiB pages" if a.small_pages else "huge pages"
    pages = f"asked for {asked}: {(huge_page_bytes() - h0) >> 20} of 512 MiB on huge pages"
    bw = read_bandwidth(buf=buf)
    print(
        f"read bandwidth (1 thread, torch.sum) {bw / 1e9:.1f} GB/s ({pages}); loadavg {' '.join(load)}; "
        f"torch {torch.__version__}"
    )
    print(f"decode_cpu kernel: {kernel_info()}\n")
    seqs = [4 * K, 16 * K, 64 * K] if a.quick else a.seq
    rows = []
    cols = [*a.backends, f"decode_cpu_{a.threads}t"]
    head = "| dtype | Hq/Hkv | S | read GB/s | floor ms | " + " | ".join(f"{b} ms (%floor)" for b in cols) + " | auto |"
    print(head + "\n" + "|---" * (head.count("|") - 1) + "|")
    for dt in a.dtypes:
        dtype = getattr(torch, dt)
        for hh in a.heads:
            hq, hkv = map(int, hh.split("/"))
            for S in seqs:
                g = torch.Generator().manual_seed(S)
                q = torch.randn(1, hq, 1, a.dim, generator=g).to(dtype)
                k = alloc(1, hkv, S, a.dim, dtype=dtype).copy_(torch.randn(1, hkv, S, a.dim, generator=g))
                v = alloc(1, hkv, S, a.dim, dtype=dtype).copy_(torch.randn(1, hkv, S, a.dim, generator=g))
                nbytes = 2 * k.numel() * k.element_size()
                cells, bws = [], []
                for b in cols:
                    name, nt = (b, 1) if not b.startswith("decode_cpu_") else ("decode_cpu", a.threads)
                    torch.set_num_threads(nt)
                    t, frac, bw = _paired(
                        lambda name=name, q=q, k=k, v=v: attention_state(q, k, v, backend=name), buf, nbytes, a.reps
                    )
                    torch.set_num_threads(1)
                    bws.append(bw)
                    rows.append(dict(dtype=dt, heads=hh, seq=S, backend=b, threads=nt, ms=t * 1e3,
                                     gbps=nbytes / t / 1e9, pct_floor=100 * frac, floor_ms=nbytes / bw * 1e3,
                                     read_gbps=bw / 1e9))  # fmt: skip
                    cells.append(f"{t * 1e3:.1f} ({frac:.0%})")
                bw = statistics.median(bws)
                floor = nbytes / bw
                print(f"| {dt} | {hh} | {S} | {bw / 1e9:.1f} | {floor * 1e3:.1f} | " + " | ".join(cells) + f" | {_pick_backend(q, k, v)} |",
                      flush=True)  # fmt: skip
                del q, k, v
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"] * 3
    print(f"\nloadavg at end: {' '.join(load)}")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {a.csv}")
    if a.plot:
        _plot(rows, a.plot)
    return 0


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    keys = sorted({(r["dtype"], r["heads"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
    for ax, (dt, hh) in zip(axes[0], keys, strict=True):
        for b in sorted({r["backend"] for r in rows}):
            pts = [(r["seq"], r["pct_floor"]) for r in rows if (r["dtype"], r["heads"], r["backend"]) == (dt, hh, b)]
            ax.plot(*zip(*pts, strict=True), marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dt} {hh}")
        ax.set_xlabel("S")
        ax.set_ylabel("% of read-bandwidth floor")
        ax.axhline(100, color="gray", lw=0.5)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def add_parser(bs) -> None:
    p = bs.add_parser(
        "kernel",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="local decode attention per backend vs the read-bandwidth floor",
    )
    p.add_argument("--quick", action="store_true", help="S in {4k, 16k, 64k}")
    p.add_argument(
        "--seq", type=at_least(1), nargs="+", default=[16 * K, 64 * K, 256 * K, 1024 * K], help="KV lengths S"
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=CHOICES,
        help="K/V dtypes",
    )
    p.add_argument("--heads", nargs="+", default=["16/16", "32/8"], help="Hq/Hkv pairs")
    p.add_argument("--dim", type=at_least(1), default=128, help="head dim")
    p.add_argument(
        "--backends",
        nargs="+",
        default=["torch", "flash_cpu", "decode_cpu"],
        help="attention_with_lse backends to time",
    )
    p.add_argument("--threads", type=at_least(1), default=2, help="threads for the extra decode_cpu column")
    p.add_argument("--reps", type=at_least(1), default=5, help="timed calls per case (the median is reported)")
    p.add_argument(
        "--small-pages", action="store_true", help="K/V and the floor buffer on 4 KiB pages instead of 2 MiB huge pages"
    )
    p.add_argument("--csv", default=None, help="write the rows to this CSV file")
    p.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    p.set_defaults(func=run)
