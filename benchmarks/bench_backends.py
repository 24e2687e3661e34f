"""Speed of each attention_with_lse backend on one thread vs the memory-bandwidth floor.

    python benchmarks/bench_backends.py [--seqs 16384 65536 262144 1048576] [--reps 5]

The floor is (K + V bytes) / (measured copy bandwidth), copy bandwidth = bytes read per
second by ``y.copy_(x)`` on 256 MiB. Prints a markdown table (median of ``--reps`` runs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from treeattn.ops.attention import _attention, _pick_backend


def timeit(f, reps: int) -> float:
    f()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def copy_bandwidth() -> float:
    """Bytes read per second by a 256 MiB float32 copy."""
    x = torch.randn(1 << 26)
    y = torch.empty_like(x)
    return x.numel() * 4 / timeit(lambda: y.copy_(x), 5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384, 65536, 262144, 1048576])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--heads", default="16/16,32/8", help="Hq/Hkv pairs, comma separated")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s, torch {torch.__version__}, threads {a.threads}\n")
    print("| dtype | Hq/Hkv | S | floor ms | torch ms | flash_cpu ms | auto picks | torch %floor | flash_cpu %floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dt in a.dtypes:
        dtype = getattr(torch, dt)
        for hh in a.heads.split(","):
            hq, hkv = map(int, hh.split("/"))
            for S in a.seqs:
                q = torch.randn(1, hq, 1, 128, dtype=dtype)
                k = torch.randn(1, hkv, S, 128, dtype=dtype)
                v = torch.randn(1, hkv, S, 128, dtype=dtype)
                floor = 2 * k.numel() * k.element_size() / bw
                t = {b: timeit(partial(_attention, q, k, v, backend=b), a.reps) for b in ("torch", "flash_cpu")}
                pick = _pick_backend(q, k, v)
                print(
                    f"| {dt} | {hq}/{hkv} | {S} | {floor * 1e3:.1f} | {t['torch'] * 1e3:.1f} | {t['flash_cpu'] * 1e3:.1f}"
                    f" | {pick} | {floor / t['torch']:.0%} | {floor / t['flash_cpu']:.0%} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
