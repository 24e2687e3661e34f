"""``treeattn bench``: latency, memory, comm and e2e benchmarks with CSV/JSON/PNG output."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .._argtypes import at_least, positive_float
from ..dtypes import CHOICES
from ..launch import LaunchError, launch
from .common import markdown, provenance, read_jsonl, write_results

K = 1024
QUICK = {
    "latency": dict(nproc=[1, 2], seq=[2 * K, 8 * K], heads=4, kv_heads=4, dim=64, reps=3, warmup=1),
    "memory": dict(nproc=[2], seq=[4 * K, 16 * K], heads=4, dim=64),
    "comm": dict(nproc=[2, 3], seq=[1 * K, 16 * K], heads=4, dim=64),
    "e2e": dict(nproc=[2], prompt=[64, 256], preset="tiny-llama", new_tokens=6),
}


def _run_launches(fn, nprocs: list[int], make_args, timeout: float, threads: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        for p in nprocs:
            launch(fn, p, (*make_args(p), str(path)), timeout=timeout, threads=threads)
        return read_jsonl(path)


def _out(a) -> Path:
    return Path(a.out)


def latency(a) -> int:
    from . import latency as L

    cfg = dict(heads=a.heads, kv_heads=a.kv_heads or a.heads, dim=a.dim, dtype=a.dtype, batch=a.batch,
               reps=a.reps, warmup=a.warmup, check=True, single=True)  # fmt: skip
    rows = _run_launches(L.worker, a.nproc, lambda p: (cfg, a.seq), a.timeout, a.threads)
    prov = provenance(sub="latency", nproc=a.nproc, seqs=a.seq, dtype=a.dtype, shape=dict(batch=a.batch, heads=a.heads, kv_heads=cfg["kv_heads"], dim=a.dim), reps=a.reps, warmup=a.warmup)  # fmt: skip
    write_results(_out(a), "latency", rows, prov, ["method", "p", "seq", "median_s", "p10_s", "p90_s", "bytes_sent", "collectives", "max_err"])  # fmt: skip
    rat = L.ratios(rows)
    print("\n" + markdown(rat, list(rat[0]) if rat else []))
    print("\nauto chose: " + ", ".join(sorted({f"p={r['p']}: {r['x_auto']}" for r in rows if "x_auto" in r})))
    vals = sorted({(r["p"], r["seq"], r["x_validation_s"]) for r in rows if "x_validation_s" in r})
    print("validation (check=True) per call: " + ", ".join(f"p={p} {v * 1e3:.2f} ms" for p, _, v in vals))
    L.plot(rows, _out(a) / "latency.png")
    return 0


def memory(a) -> int:
    from . import memory as M

    pts = [(s, a.heads, a.dim) for s in a.seq] + [(a.seq[-1], h, a.dim) for h in a.heads_sweep if h != a.heads]
    rows = _run_launches(M.worker, a.nproc, lambda p: (dict(dtype=a.dtype), pts), a.timeout, a.threads)
    prov = provenance(sub="memory", nproc=a.nproc, seqs=a.seq, dtype=a.dtype, heads=a.heads, heads_sweep=a.heads_sweep, dim=a.dim,
                      method="CPU: VmHWM high-water mark of the step (reset via /proc/self/clear_refs) + resident K/V")  # fmt: skip
    write_results(_out(a), "memory", rows, prov, ["method", "p", "seq", "heads", "dim", "resident_kv_bytes", "step_peak_bytes", "measured_bytes", "predicted_bytes", "measured/predicted"])  # fmt: skip
    M.plot(rows, _out(a) / "memory.png")
    return 0


def comm(a) -> int:
    from . import commvol as C

    cfg = dict(heads=a.heads, dim=a.dim, dtype=a.dtype)
    rows = _run_launches(C.worker, a.nproc, lambda p: (cfg, a.seq), a.timeout, a.threads)
    prov = provenance(sub="comm", nproc=a.nproc, seqs=a.seq, dtype=a.dtype, heads=a.heads, dim=a.dim)
    write_results(_out(a), "comm", rows, prov, ["method", "p", "seq", "bytes_sent", "collectives", "p2p_sends", "eq_bytes", "measured/eq"])  # fmt: skip
    C.plot(rows, _out(a) / "comm.png")
    return 0


def e2e(a) -> int:
    from . import e2e as E

    cfg = dict(preset=a.preset, dtype=a.dtype, new_tokens=a.new_tokens)
    rows = _run_launches(E.worker, a.nproc, lambda p: (cfg, a.prompt), a.timeout, a.threads)
    prov = provenance(
        sub="e2e", nproc=a.nproc, prompts=a.prompt, preset=a.preset, dtype=a.dtype, new_tokens=a.new_tokens
    )
    write_results(_out(a), "e2e", rows, prov, ["attention", "p", "prompt", "ttft_s", "decode_s_per_token"])
    E.plot(rows, _out(a) / "e2e.png")
    return 0


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks that reproduce the paper's claims (CSV/JSON/PNG + markdown)")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    bs = b.add_subparsers(dest="bench", required=True)

    def common(p, name):
        p.add_argument("--quick", action="store_true", help="small preset for smoke tests (< 1 min)")
        p.add_argument("--out", default="results", help="output directory")
        p.add_argument("--nproc", type=at_least(1), nargs="+", default=[2, 4, 8], help="rank counts p to run")
        p.add_argument("--dtype", choices=CHOICES, default="float32", help="K/V dtype")
        p.add_argument("--threads", type=at_least(1), default=1, help="compute threads per rank")
        p.add_argument("--timeout", type=positive_float, default=7200.0, help="seconds before a launch is stopped")
        p.set_defaults(func=lambda a: _dispatch(a, name))

    p = bs.add_parser(
        "latency", formatter_class=fmt, help="decode step latency: Tree strategies vs Ring vs local/single device"
    )
    common(p, "latency")
    p.add_argument(
        "--seq", type=at_least(1), nargs="+", default=[16 * K, 64 * K, 256 * K, 1024 * K], help="total KV lengths"
    )
    p.add_argument("--heads", type=at_least(1), default=16, help="query heads")
    p.add_argument("--kv-heads", type=at_least(1), default=None, help="KV heads (None: --heads, MHA)")
    p.add_argument("--dim", type=at_least(1), default=128, help="head dim")
    p.add_argument("--batch", type=at_least(1), default=1, help="sequences per step")
    p.add_argument("--reps", type=at_least(1), default=7, help="timed steps per method (the median is reported)")
    p.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps per method first")
    p = bs.add_parser("memory", formatter_class=fmt, help="peak memory per rank, Tree vs Ring, vs eq. 8-9")
    common(p, "memory")
    p.add_argument(
        "--seq", type=at_least(1), nargs="+", default=[16 * K, 64 * K, 256 * K, 1024 * K], help="total KV lengths"
    )
    p.add_argument("--heads", type=at_least(1), default=16, help="heads for the sequence sweep")
    p.add_argument(
        "--heads-sweep", type=at_least(1), nargs="+", default=[4, 8, 16, 32], help="heads for the head sweep"
    )
    p.add_argument("--dim", type=at_least(1), default=128, help="head dim")
    p = bs.add_parser("comm", formatter_class=fmt, help="bytes and collectives per rank per step vs eq. 10-14")
    common(p, "comm")
    p.add_argument("--seq", type=at_least(1), nargs="+", default=[16 * K, 64 * K, 256 * K], help="total KV lengths")
    p.add_argument("--heads", type=at_least(1), default=16, help="heads")
    p.add_argument("--dim", type=at_least(1), default=128, help="head dim")
    p = bs.add_parser(
        "e2e", formatter_class=fmt, help="time to first token and per-token decode of generation, Tree vs Ring"
    )
    common(p, "e2e")
    p.add_argument("--prompt", type=at_least(1), nargs="+", default=[1024, 4096, 16384], help="prompt lengths")
    p.add_argument("--preset", default="small-llama", help="random-weight model config")
    p.add_argument("--new-tokens", type=at_least(1), default=16, help="tokens generated per run")
    from .kernel import add_parser as add_kernel

    add_kernel(bs)


def _dispatch(a: argparse.Namespace, name: str) -> int:
    if a.quick:
        for k, v in QUICK[name].items():
            setattr(a, k, v)
        if name == "memory":
            a.heads_sweep = [2, 4]
    try:
        return {"latency": latency, "memory": memory, "comm": comm, "e2e": e2e}[name](a)
    except LaunchError as e:
        print(f"treeattn bench {name} failed: {e}", file=sys.stderr)
        return 1
