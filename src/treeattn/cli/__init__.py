"""The ``treeattn`` command line."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .._argtypes import at_least, positive_float
from .._host import available_memory
from ..dtypes import CHOICES, TORCH


def _heads_ok(cmd: str, heads: int, kv_heads: int) -> bool:
    if heads % kv_heads:
        print(f"treeattn {cmd}: --kv-heads {kv_heads} must divide --heads {heads}", file=sys.stderr)
        return False
    return True


def _core_demo(a: argparse.Namespace) -> int:
    from ..ops import attention_state
    from ..ops.energy import tree_reduce
    from ..ops.state import merge_states

    if not _heads_ok("merge-demo", a.heads, a.kv_heads):
        return 2
    torch.set_num_threads(a.threads)
    dtype = TORCH[a.dtype]
    g = torch.Generator().manual_seed(0)
    print(
        f"KV of {a.seq:,} tokens, q {a.heads} heads / kv {a.kv_heads} heads x {a.dim}, {a.dtype}, p = {a.nproc} chunks"
    )
    q = torch.randn(1, a.heads, 1, a.dim, generator=g).to(dtype)
    k = torch.randn(1, a.kv_heads, a.seq, a.dim, generator=g).to(dtype)
    v = torch.randn(1, a.kv_heads, a.seq, a.dim, generator=g).to(dtype)
    t0 = time.perf_counter()
    states = [
        attention_state(q, kc, vc) for kc, vc in zip(k.tensor_split(a.nproc, 2), v.tensor_split(a.nproc, 2), strict=True)
    ]
    t1 = time.perf_counter()
    (out, lse), depth = tree_reduce(states, lambda x, y: merge_states(*x, *y))
    t2 = time.perf_counter()
    ref_o, ref_l = attention_state(q.double(), k.double(), v.double(), backend="torch")  # float64, chunked
    full_o, full_l = attention_state(q, k, v)
    err = (out.to(dtype).double() - ref_o).abs().max().item()
    err_full = (full_o.double() - ref_o).abs().max().item()
    print(
        f"per-chunk states: {t1 - t0:.3f} s; tree merge of {a.nproc} states: depth {depth} = ceil(log2 {a.nproc}),"
        f" {(t2 - t1) * 1e3:.2f} ms"
    )
    print(f"max |out - float64 reference| = {err:.3e}  (one-pass attention in {a.dtype}: {err_full:.3e})")
    print(f"max |lse - float64 reference| = {(lse.double() - ref_l).abs().max().item():.3e}")
    ok = err <= 2 * err_full + 1e-6
    print("exact within tolerance" if ok else "ERROR: tree result outside tolerance")
    return 0 if ok else 1


def _demo(a: argparse.Namespace) -> int:
    from ..demo import worker
    from ..launch import LaunchError, launch

    if not _heads_ok("demo", a.heads, a.kv_heads or a.heads):
        return 2
    kv = a.seq * (a.kv_heads or a.heads) * a.dim * 2 * TORCH[a.dtype].itemsize
    need = 4 * kv  # the shards, ring's two receive buffers per rank, rank 0's full copy for the reference
    avail = available_memory()
    if avail is not None and need > avail:
        print(
            f"treeattn demo: {a.seq:,} tokens x {a.kv_heads or a.heads} kv heads x {a.dim} ({a.dtype}) needs about "
            f"{need / 2**30:.1f} GiB (K/V {kv / 2**30:.1f} GiB x 4: shards, ring buffers, reference copy) but "
            f"{avail / 2**30:.1f} GiB is available; use fewer --seq, --heads/--kv-heads or --dim",
            file=sys.stderr,
        )
        return 2
    try:
        launch(
            worker,
            a.nproc,
            (a.seq, a.heads, a.kv_heads or a.heads, a.dim, a.dtype, a.reps, a.warmup),
            threads=a.threads,
            timeout=a.timeout,
        )
    except LaunchError as e:
        print(f"treeattn demo failed: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="treeattn", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="Tree vs Ring decoding over a sharded KV on local ranks (the main demo)")
    d.add_argument("--nproc", type=at_least(1), default=2, help="ranks to launch (default 2)")
    d.add_argument("--seq", type=at_least(1), default=1 << 18, help="total KV length (default 262144)")
    d.add_argument("--heads", type=at_least(1), default=16, help="query heads (default 16)")
    d.add_argument(
        "--kv-heads", type=at_least(1), default=None, help="KV heads, dividing --heads (default: --heads, MHA)"
    )
    d.add_argument("--dim", type=at_least(1), default=128, help="head dim (default 128)")
    d.add_argument("--dtype", choices=CHOICES, default="float32")
    d.add_argument("--reps", type=at_least(1), default=10, help="timed steps per method (default 10)")
    d.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps per method first (default 2)")
    d.add_argument("--threads", type=at_least(1), default=1, help="compute threads per rank (default 1)")
    d.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds before the ranks are stopped (default 1800)")
    d.set_defaults(func=_demo)
    try:
        from .generate import add_parser
    except ImportError:  # transformers not installed: extra [hf]
        g = sub.add_parser("generate", help="(needs: pip install 'treeattn[hf]')")
        g.set_defaults(func=lambda a: print("treeattn generate needs transformers: pip install 'treeattn[hf]'") or 1)
    else:
        add_parser(sub)
        from .serve import add_parser as add_serve

        add_serve(sub)
    from ..bench.cli import add_parser as add_bench
    from ..bench.simulate import add_parser as add_simulate

    add_bench(sub)
    add_simulate(sub)
    d = sub.add_parser("merge-demo", help="tree merge of per-chunk attention states over a long KV (single process)")
    d.add_argument("--seq", type=at_least(1), default=1 << 20, help="total KV length (default 1M)")
    d.add_argument("--nproc", type=at_least(1), default=8, help="number of chunks p (default 8)")
    d.add_argument("--heads", type=at_least(1), default=8, help="query heads (default 8)")
    d.add_argument("--kv-heads", type=at_least(1), default=2, help="KV heads, dividing --heads (default 2)")
    d.add_argument("--dim", type=at_least(1), default=64, help="head dim (default 64)")
    d.add_argument("--dtype", choices=CHOICES, default="float32")
    d.add_argument("--threads", type=at_least(1), default=1, help="compute threads (default 1)")
    d.set_defaults(func=_core_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
