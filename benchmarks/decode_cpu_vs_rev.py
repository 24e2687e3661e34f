"""decode_cpu of this tree against the same kernel at another git revision, in one process.

The revision's ``ops/_decode_cpu.py`` and C sources and headers are taken with ``git show`` into a
temporary directory and imported beside today's (each builds its own shared object in
``$TREEATTN_CACHE_DIR``); every case alternates the two calls, so the machine's drift falls on
both. Medians of the per-call times; the last column checks that both give the same bits
(they need not: a change of split or rounding shows there).

    python benchmarks/decode_cpu_vs_rev.py --rev 48e7d4e
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import treeattn.ops._decode_cpu as today

ROOT = Path(__file__).resolve().parents[1]
# name, B, Hkv, rows per KV head (G x Tq), S, D, dtype, repetitions
CASES = [
    ("bf16 32/8 x 128, 1 token, S = 512k", 1, 8, 4, 512 * 1024, 128, torch.bfloat16, 11),
    ("float32 32/8 x 128, 1 token, S = 128k", 1, 8, 4, 128 * 1024, 128, torch.float32, 11),
    ("float32 16/16 x 128, 1 token, S = 128k", 1, 16, 1, 128 * 1024, 128, torch.float32, 11),
    ("float32 9/3 x 64 (SmolLM2), 1 token, S = 3.9k", 1, 3, 3, 3900, 64, torch.float32, 41),
    ("float32 9/3 x 64, 1 token, S = 16", 1, 3, 3, 16, 64, torch.float32, 201),
    ("bf16 16/16 x 128 (MHA), 1 token, S = 128k", 1, 16, 1, 128 * 1024, 128, torch.bfloat16, 11),
    ("float32 8/4 x 256 (G = 2), 1 token, S = 8k", 1, 4, 2, 8192, 256, torch.float32, 41),
    ("bf16 8/4 x 256 (G = 2), 1 token, S = 8k", 1, 4, 2, 8192, 256, torch.bfloat16, 41),
    ("bf16 9/3 x 64, 1 token, S = 3.9k", 1, 3, 3, 3900, 64, torch.bfloat16, 41),
    ("float32 9/3 x 64, 2 tokens (R = 6), S = 3.9k", 1, 3, 6, 3900, 64, torch.float32, 41),
    ("float32 9/3 x 64, 5 tokens (R = 15), S = 3.9k", 1, 3, 15, 3900, 64, torch.float32, 41),
    ("float32 9/3 x 64, 6 tokens (R = 18), S = 3.9k", 1, 3, 18, 3900, 64, torch.float32, 41),
]


def load_rev(rev: str, where: Path):
    """The module ``ops._decode_cpu`` as it was at ``rev`` (its C sources beside it)."""
    ls = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "src/treeattn/ops/"], check=True,
                        capture_output=True, text=True).stdout.split()  # fmt: skip
    for f in ["_decode_cpu.py"] + [Path(x).name for x in ls if x.endswith((".c", ".h"))]:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/treeattn/ops/{f}"], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        (where / f).write_text(text)
    spec = importlib.util.spec_from_file_location("treeattn.ops._decode_cpu_rev", where / "_decode_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # relative imports resolve in treeattn.ops
    if not mod.kernel_available():
        sys.exit(f"the kernel at {rev} did not build: {mod.kernel_info()}")
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD~1", help="git revision to compare with (default HEAD~1)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--only", nargs="+", default=[], help="run the cases whose names contain one of these")
    a = ap.parse_args()
    if not today.kernel_available():
        sys.exit(f"the kernel did not build: {today.kernel_info()}")
    with tempfile.TemporaryDirectory() as d:
        rev = load_rev(a.rev, Path(d))
        print(f"| case | threads | {a.rev} ms | now ms | now / {a.rev} | same bits |")
        print("|---|---|---|---|---|---|")
        g = torch.Generator().manual_seed(0)
        for name, B, H, R, S, D, dt, reps in CASES:
            if a.only and not any(x in name for x in a.only):
                continue
            q = torch.randn(B, H, R, D, generator=g).to(dt)
            k, v = (torch.randn(B, H, S, D, generator=g).to(dt) for _ in range(2))
            for th in a.threads:
                t = {"rev": [], "now": []}
                for _ in range(reps):
                    for key, f in (("rev", rev.decode_cpu), ("now", today.decode_cpu)):
                        f(q, k, v, 0.1, threads=th)
                        t0 = time.perf_counter()
                        f(q, k, v, 0.1, threads=th)
                        t[key].append(time.perf_counter() - t0)
                o1, l1 = rev.decode_cpu(q, k, v, 0.1, threads=th)
                o2, l2 = today.decode_cpu(q, k, v, 0.1, threads=th)
                same = torch.equal(o1, o2) and torch.equal(l1, l2)
                mr, mn = (statistics.median(t[x]) * 1e3 for x in ("rev", "now"))
                print(f"| {name} | {th} | {mr:.3f} | {mn:.3f} | {mn / mr:.3f} | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
