# ruff: noqa: B023  (each lambda is timed at once, inside its loop iteration)
"""The GPU decode kernel table: treeattn's local op against PyTorch SDPA, as % of the HBM
read floor (K+V bytes / the rate of a 2 GiB ``sum`` on the same GPU), CUDA events, medians.
In order: host time and CUDA-graph replay of one call, the split-count, kernel-shape and
multiply-add sweeps (Triton), a square causal prefill block (Triton against aten's flash
kernel and SDPA), tree_decode at p = 1 against the local op (``profile``: where
the host time of both goes, not in the default sections), then the table; a
failing cell (out of memory, a compile error) is NaN, the run goes on. ``--sections`` picks.

    python benchmarks/gpu_kernel.py                       # bf16 and fp32, B 1 and 8, S 32k..1M
    python benchmarks/gpu_kernel.py --quick               # a few shapes
    python benchmarks/gpu_kernel.py --json out.json

Columns (same q/k/v, one run, variants interleaved per shape): ``treeattn`` =
``attention_with_lse(check=False)`` with ``backend="auto"`` (the Triton split-KV kernel on
CUDA), ``ragged`` = the same with ``kv_lens`` (every row full: the ragged path's cost),
``fused_cuda`` = the aten kernels on folded rows (what auto used before), ``sdpa`` =
``F.scaled_dot_product_attention(enable_gqa=True)`` (no lse). ``tree_decode p=1`` reports
tree_decode(check=False) on a one-rank NCCL group minus the local op, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from treeattn import attention_with_lse, tree_decode


def timed(fn, reps: int, warmup: int = 5) -> float:
    """Median ms of ``reps`` calls, each timed by CUDA events."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def cell(fn, reps: int) -> float:
    """``timed``, or NaN (with the reason on stderr) when the call fails, e.g. out of memory:
    one cell must not cost the rest of a run on a borrowed GPU."""
    return guarded(timed, fn, reps)


def host_us(fn, n: int = 200) -> float:
    """Host microseconds per call, enqueueing ``n`` calls without a sync (the GPU keeps up at
    these sizes, so this is the Python + launch cost)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t
    torch.cuda.synchronize()
    return t / n * 1e6


def graph_ms(fn, reps: int) -> float:
    """Median ms of one CUDA-graph replay of ``fn`` (GPU time without the host's)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timed(g.replay, reps)


def guarded(f, *args) -> float:
    """``f(*args)``, or NaN when it fails (out of memory, a Triton compile error)."""
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001
        print(f"cell failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        return float("nan")


def read_rate() -> float:
    """Bytes/s of a 2 GiB sum (the floor's rate)."""
    x = torch.ones(1 << 29, dtype=torch.float32, device="cuda")
    ms = timed(x.sum, 20)
    del x
    return (1 << 31) / (ms / 1e3)


def host_and_graph(a, rows, T) -> None:
    """One call's host cost and its GPU time alone (a CUDA-graph replay), beside the eager
    event timing: the eager time is the larger of the two when the call is launch-bound."""
    Hq, Hkv, D = a.heads[0], a.heads[1], a.dim
    print("\n| dtype | B | S | variant | eager ms | host µs/call | graph ms |")
    print("|---|---|---|---|---|---|---|")
    s0 = a.sweep_seq[0]
    for dname, B, S in [("bfloat16", 1, S) for S in a.sweep_seq[:2]] + [("float32", 1, s0), ("bfloat16", 8, s0)]:
        dt = getattr(torch, dname)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dt)
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dt)
        lens = torch.full((B,), S, device="cuda")
        qg = q.view(B, Hkv, Hq // Hkv, D)
        fns = {
            "treeattn": lambda: attention_with_lse(q, k, v, check=False),
            "ragged": lambda: attention_with_lse(q, k, v, kv_lens=lens, check=False),
            "kernel alone": lambda: T._split_kv(qg, k, v, None, None, D**-0.5, 0.0, False),
            "kernel, Triton's launch": lambda: unlean(T, T._split_kv, qg, k, v, None, None, D**-0.5, 0.0, False),
            "custom op": lambda: T.split_kv_attention(qg, k, v, None, None, D**-0.5, 0.0, False),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        }
        for name, fn in fns.items():
            ev = cell(fn, a.reps)
            h = guarded(host_us, fn)
            gr = guarded(graph_ms, fn, a.reps)
            rows.append(dict(what="host and graph", dtype=dname, B=B, S=S, variant=name, eager_ms=ev, host_us=h, graph_ms=gr))
            print(f"| {dname} | {B} | {S} | {name} | {ev:.3f} | {h:.1f} | {gr:.3f} |", flush=True)
        q = k = v = None
        torch.cuda.empty_cache()


def unlean(T, f, *args):
    """``f(*args)`` with every launch through Triton's own (``_triton_launch.LEAN`` off)."""
    from treeattn.ops import _triton_launch as L

    L.LEAN = False
    try:
        return f(*args)
    finally:
        L.LEAN = True


def profile(a, T) -> None:
    """Where an eager call's host time goes: cProfile of 300 calls (bf16, B = 1, the first
    sweep length), the 25 costliest functions by own time."""
    import cProfile
    import pstats

    Hq, Hkv, D, S = a.heads[0], a.heads[1], a.dim, a.sweep_seq[0]
    q = torch.randn(1, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for what, fn in (("attention_with_lse", lambda: attention_with_lse(q, k, v, check=False)),
                     ("tree_decode p=1", lambda: tree_decode(q, k, v, check=False))):  # fmt: skip
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        print(f"\n{what}, 300 calls:")
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def prefill_square(a, rows) -> None:
    """A square causal block in bf16 (a whole prompt at p = 1, as ``parallel.prefill`` passes it):
    treeattn's path by default (the Triton kernel, per-row bounds), the same block through aten's
    flash kernel (``ops.causal.SQUARE_FLASH``, which this decides), and SDPA (``is_causal``,
    ``enable_gqa``; no lse); 32/8 heads x 64 (the 1B-shaped model of gpu_e2e.py) and x 128."""
    from treeattn.ops import causal as C

    print("\n| heads x dim | T = S | Triton, per-row bounds ms | aten flash ms | SDPA ms | TFLOP/s: Triton / flash |")
    print("|---|---|---|---|---|---|")
    for D in (64, 128):
        for T in (2048, 8192):
            q = torch.randn(1, 32, T, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 8, T, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            end = torch.arange(1, T + 1)
            t = {}
            for flag in (False, True):
                C.SQUARE_FLASH = flag
                t[flag] = cell(lambda: C.causal_block_states(q, k, v, None, end, None, None, "auto"), a.reps)
            C.SQUARE_FLASH = False
            sd = cell(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), a.reps)
            tf = 2 * 32 * T * T * D / 1e9  # causal: half of 4 T^2 D flops per head
            rows.append(dict(what="prefill square", D=D, T=T, triton_ms=t[False], flash_ms=t[True], sdpa_ms=sd))
            print(f"| 32/8 x {D} | {T} | {t[False]:.3f} | {t[True]:.3f} | {sd:.3f} | "
                  f"{tf / t[False]:.0f} / {tf / t[True]:.0f} |", flush=True)  # fmt: skip
            q = k = v = None
            torch.cuda.empty_cache()


def fma_sweep(a, rows, T, rate) -> None:
    """tl.dot (rows padded to 16) against multiply-adds over the real rows, per kernel shape."""
    Hq, Hkv, D = a.heads[0], a.heads[1], a.dim
    saved_rows, saved_cfg = dict(T.FMA_ROWS), dict(T.FMA_CONFIG)
    head = "| dtype | B | S | floor ms | dot ms | " + " | ".join(f"fma {c[0]},{c[1]},{c[2]} ms" for c in a.fma_configs)
    print("\n" + head + " |")
    print("|---|---|---|---|---|" + "---|" * len(a.fma_configs))
    ends = sorted({a.sweep_seq[0], a.sweep_seq[-1]})
    for dname, B, S in [(d, B, S) for d in ("float32", "bfloat16") for B in (1, 8) for S in ends]:
        dt = getattr(torch, dname)
        nbytes = 2 * B * Hkv * S * D * dt.itemsize
        if nbytes > a.max_gb * 1e9:
            continue
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        T.FMA_ROWS = {}
        ts = [cell(lambda: attention_with_lse(q, k, v, check=False), a.reps)]
        T.FMA_ROWS = {dt: 64}
        for bn, w, st in a.fma_configs:
            T.FMA_CONFIG.update(BLOCK_N=bn, num_warps=w, num_stages=st)
            ts.append(cell(lambda: attention_with_lse(q, k, v, check=False), a.reps))
        T.FMA_ROWS, T.FMA_CONFIG = dict(saved_rows), dict(saved_cfg)
        floor = nbytes / rate * 1e3
        rows.append(dict(what="fma", dtype=dname, B=B, S=S, floor_ms=floor, dot_ms=ts[0], fma_ms=ts[1:],
                         configs=[list(c) for c in a.fma_configs]))  # fmt: skip
        print(f"| {dname} | {B} | {S} | {floor:.3f} | " + " | ".join(f"{x:.3f}" for x in ts) + " |", flush=True)
        q = k = v = None
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seq", type=int, nargs="+", default=[32768, 131072, 524288, 1048576])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--max-gb", type=float, default=40.0, help="skip shapes whose K+V exceed this")
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="split-count sweep")
    ap.add_argument("--sweep-seq", type=int, nargs="+", default=[32768, 131072, 1048576])
    ap.add_argument("--configs", type=lambda x: tuple(int(y) for y in x.split(",")), nargs="+",
                    default=[(64, 4, 2), (64, 4, 3), (32, 4, 4), (64, 8, 2), (32, 4, 2)])
    ap.add_argument("--fma-configs", type=lambda x: tuple(int(y) for y in x.split(",")), nargs="+",
                    default=[(16, 1, 2), (16, 2, 2), (8, 2, 2), (16, 1, 3), (32, 2, 2)])
    ap.add_argument("--sections", nargs="+", default=["host", "splits", "configs", "fma", "prefill", "tree", "table"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    if a.quick:
        a.batch, a.seq, a.reps = [1], [32768, 1048576], 10
    torch.manual_seed(0)
    rate = read_rate()
    dev = torch.cuda.get_device_name()
    print(f"{dev}; read rate {rate / 1e12:.2f} TB/s (2 GiB sum); Hq/Hkv {a.heads[0]}/{a.heads[1]} x {a.dim}; "
          f"medians of {a.reps} CUDA-event timings\n")  # fmt: skip
    rows = []
    Hq, Hkv, D = a.heads[0], a.heads[1], a.dim
    from treeattn.ops import _triton_attn as T

    if "host" in a.sections:
        host_and_graph(a, rows, T)
    # the split count: programs per SM (bf16, B = 1 and 8)
    print("\n| B | S | " + " | ".join(f"{n}/SM ms" for n in a.per_sm) + " |")
    print("|---|---|" + "---|" * len(a.per_sm))
    default = T.PROGRAMS_PER_SM
    for B, S in [(B, S) for B in (1, 8) for S in a.sweep_seq] if "splits" in a.sections else []:
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)  # not k again: V's loads must cost what they cost
        ts = []
        for n in a.per_sm:
            T.PROGRAMS_PER_SM = n
            ts.append(cell(lambda: attention_with_lse(q, k, v, check=False), a.reps))
        T.PROGRAMS_PER_SM = default
        rows.append(dict(what="programs per SM", B=B, S=S, per_sm=a.per_sm, ms=ts))
        print(f"| {B} | {S} | " + " | ".join(f"{x:.3f}" for x in ts) + " |", flush=True)
        q = k = v = None
        torch.cuda.empty_cache()
    # the kernel's shape: (BLOCK_N, num_warps, num_stages) of the decode and prefill configs
    print("\n| config (BLOCK_N, warps, stages) | " + " | ".join(f"decode S={S} ms" for S in a.sweep_seq)
          + " | prefill 4096 rows x 8192 ms |")  # fmt: skip
    print("|---|" + "---|" * (len(a.sweep_seq) + 1))
    from treeattn.ops.attention import attention_state

    saved = dict(T.DECODE_CONFIG), dict(T.PREFILL_CONFIG)
    qp = torch.randn(1, Hq, 1024, D, device="cuda", dtype=torch.bfloat16)
    kp = torch.randn(1, Hkv, 8192, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    end = (torch.arange(1024, device="cuda") + 8192 - 1024 + 1).view(1, -1)
    for bn, w, st in a.configs if "configs" in a.sections else []:
        cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=st)
        T.DECODE_CONFIG.update(cfg)
        T.PREFILL_CONFIG.update(cfg)
        ts = []
        for S in a.sweep_seq:
            q = torch.randn(1, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            ts.append(cell(lambda: attention_with_lse(q, k, v, check=False), a.reps))
        ts.append(cell(lambda: attention_state(qp, kp, vp, kv_end=end, backend="triton", keep_fp32=True), a.reps))
        rows.append(dict(what="config", config=[bn, w, st], ms=ts))
        print(f"| {bn}, {w}, {st} | " + " | ".join(f"{x:.3f}" for x in ts) + " |", flush=True)
    T.DECODE_CONFIG.update(saved[0])
    T.PREFILL_CONFIG.update(saved[1])
    if "fma" in a.sections:
        fma_sweep(a, rows, T, rate)
    if "prefill" in a.sections:
        prefill_square(a, rows)
    # tree_decode at p = 1 (NCCL) against the local op
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 's')}", rank=0, world_size=1)
        print("\n| dtype | S | local op ms | tree_decode p=1 ms | difference µs | host µs/call: local op | tree_decode |")
        print("|---|---|---|---|---|---|---|")
        for S in (32768, 131072) if "tree" in a.sections else ():
            dt = torch.bfloat16
            q = torch.randn(1, Hq, 1, D, device="cuda", dtype=dt)
            k = torch.randn(1, Hkv, S, D, device="cuda", dtype=dt)
            v = torch.randn(1, Hkv, S, D, device="cuda", dtype=dt)
            loc = cell(lambda: attention_with_lse(q, k, v, check=False), a.reps)
            tre = cell(lambda: tree_decode(q, k, v, check=False), a.reps)
            hl = guarded(host_us, lambda: attention_with_lse(q, k, v, check=False))
            ht = guarded(host_us, lambda: tree_decode(q, k, v, check=False))
            rows.append(dict(what="tree_decode p=1", S=S, local_ms=loc, tree_ms=tre, local_host_us=hl, tree_host_us=ht))
            print(f"| bfloat16 | {S} | {loc:.3f} | {tre:.3f} | {1e3 * (tre - loc):.0f} | {hl:.1f} | {ht:.1f} |", flush=True)
        if "profile" in a.sections:
            profile(a, T)
        dist.destroy_process_group()
    # the table last: it takes longest (a time limit then costs only its last rows)
    print()
    print("| dtype | B | S | floor ms | treeattn ms (% floor) | ragged ms | fused_cuda ms | sdpa ms (% floor) | treeattn / sdpa |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dname in a.dtypes if "table" in a.sections else []:
        dt = getattr(torch, dname)
        for B in a.batch:
            for S in a.seq:
                nbytes = 2 * B * Hkv * S * D * dt.itemsize
                if nbytes > a.max_gb * 1e9:
                    print(f"| {dname} | {B} | {S} | skipped: K+V {nbytes / 1e9:.0f} GB > --max-gb |")
                    continue
                q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt)
                k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dt)
                v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dt)
                lens = torch.full((B,), S, device="cuda")
                floor = nbytes / rate * 1e3
                t = {  # float32 SDPA runs its math kernel, which repeats K/V for GQA: it may not fit (NaN)
                    "treeattn": cell(lambda: attention_with_lse(q, k, v, check=False), a.reps),
                    "ragged": cell(lambda: attention_with_lse(q, k, v, kv_lens=lens, check=False), a.reps),
                    "fused_cuda": cell(lambda: attention_with_lse(q, k, v, backend="fused_cuda", check=False), a.reps),
                    "sdpa": cell(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), a.reps),
                }
                row = dict(dtype=dname, B=B, S=S, floor_ms=floor, **{f"{n}_ms": x for n, x in t.items()})
                rows.append(row)
                print(f"| {dname} | {B} | {S} | {floor:.3f} | {t['treeattn']:.3f} ({100 * floor / t['treeattn']:.0f} %) | "
                      f"{t['ragged']:.3f} | {t['fused_cuda']:.3f} | {t['sdpa']:.3f} ({100 * floor / t['sdpa']:.0f} %) | "
                      f"{t['treeattn'] / t['sdpa']:.2f} |", flush=True)  # fmt: skip
                q = k = v = None  # free before the next shape
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=dev, read_rate=rate, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
