"""``treeattn simulate``: flags and the handler (predict a grid, calibrate, write a profile)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..._argtypes import at_least
from ...cost import model as cost_model
from ...cost.layouts import MODELS, table
from ...cost.model import DTYPE_BYTES, Cluster
from ...cost.presets import PRESET_GRID, PRESETS
from ...cost.profile import load_profile, save_profile
from ...dtypes import CHOICES
from ..common import provenance
from . import report
from .calibrate import calibrate, holdout_report
from .plots import plot_all


def _tokens(s: str) -> int:
    """A token count: ``131072``, ``80k``, ``5.12M``, ``1G`` (decimal suffixes)."""
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}
    t = s.strip().replace("_", "")
    f = mult.get(t[-1:].lower(), 1)
    try:
        v = float(t[:-1] if f != 1 else t) * f
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r}") from None
    if v < 1 or v != v:
        raise argparse.ArgumentTypeError(f"token count must be >= 1, got {s!r}")
    return int(round(v))


def add_parser(sub: Any) -> None:
    """Add the ``simulate`` sub-command to an argparse subparsers object; its handler is :func:`run`."""
    g = sub.add_parser(
        "simulate",
        help="analytic alpha-beta model of decode latency: Tree strategies vs Ring at cluster scale",
        description=(
            "Predict one decode step of every Tree strategy and of Ring Attention from an alpha-beta model "
            "of the cluster. Prints a markdown table and the paper's headline case (dgx-h100, 128 GPUs, "
            "5.12M tokens); --out writes CSV, JSON with provenance and plots; --calibrate fits the local "
            "preset to `treeattn bench latency` results."
        ),
    )
    g.add_argument("--preset", choices=list(PRESETS), default="dgx-h100")
    g.add_argument("--p", type=at_least(1), nargs="+", default=None, help="ranks (default: the preset's grid)")
    g.add_argument(
        "--seq", type=_tokens, nargs="+", default=None, help="total context tokens, e.g. 80k 5.12M 100M (default: grid)"
    )
    g.add_argument("--heads", type=at_least(1), default=16, help="query heads (default 16, the paper's Fig. 3)")
    g.add_argument("--kv-heads", type=at_least(1), default=None, help="K/V heads (default: --heads)")
    g.add_argument("--dim", type=at_least(1), default=128, help="head dimension (default 128)")
    g.add_argument("--batch", type=at_least(1), default=1)
    g.add_argument(
        "--dtype",
        choices=CHOICES,
        default=None,
        help="K/V dtype (default bf16; local: fp32)",
    )

    g.add_argument("--calibrate", metavar="RESULTS.json", default=None, help="fit the local preset to bench rows")
    g.add_argument("--fit-fraction", type=float, default=0.5, help="share of rows fitted in the holdout check")
    g.add_argument(
        "--profile", metavar="PATH", default=None,
        help="simulate the cluster of a cost profile (written by --profile-out) instead of --preset",
    )  # fmt: skip
    g.add_argument(
        "--profile-out", metavar="PATH", default=None,
        help="write the simulated cluster (with --calibrate: the fitted one) as a cost profile for auto "
        "(tree_decode(profile=PATH) or TREEATTN_PROFILE=PATH)",
    )  # fmt: skip
    g.add_argument("--out", metavar="DIR", default=None, help="write simulate.csv, simulate.json and PNG plots")
    g.add_argument("--layouts", action="store_true",
                   help="a whole model's decode step per layout of its weights and K/V (KVP only, TP only, KVP x TP) "
                   "for --models at --seq tokens on --p ranks (default 128k and 1M tokens, 8, 16 and 64 ranks)")  # fmt: skip
    g.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="with --layouts: the models (default all)")  # fmt: skip
    g.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"treeattn simulate: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Handler of ``treeattn simulate``; returns the exit status."""
    cluster: Cluster = PRESETS[args.preset]
    source = f"built-in preset {args.preset!r}"
    if getattr(args, "profile", None):
        try:
            prof = load_profile(args.profile)
        except ValueError as e:
            return _fail(str(e))
        cluster, source = prof.cluster, prof.describe()
    if args.layouts:
        seqs, ranks = args.seq or [131072, 1048576], args.p or [8, 16, 64]
        try:
            print(f"one decode step, ms/token, batch {args.batch}, bf16, {source} (treeattn.cost.layouts)\n")
            print(table(cluster, args.models, seqs, ranks, batch=args.batch))
        except ValueError as e:
            return _fail(str(e))
        return 0
    calib_json = fit = None
    if args.calibrate:
        base = cluster if getattr(args, "profile", None) else PRESETS["local"]
        try:
            data = json.loads(Path(args.calibrate).read_text())
            rows = data["rows"] if isinstance(data, dict) else data
            rep = holdout_report(rows, args.fit_fraction, base=base)
            cal = calibrate(rows, base=base)
        except (OSError, ValueError, KeyError, TypeError) as e:
            return _fail(f"cannot calibrate from {args.calibrate}: {e}")
        print(report.calibration_text(args.calibrate, args.fit_fraction, rep, cal))
        fit = {"source": str(args.calibrate), "n_rows": cal.n_rows, "fitted": cal.fitted, "fixed": list(cal.fixed),
               "fit_median_abs_rel_err": cal.median_rel_err, "holdout_median_abs_rel_err": rep["median_abs_rel_err"]}  # fmt: skip
        calib_json = {**fit, "file": str(args.calibrate), "fit_fraction": args.fit_fraction, "skipped": cal.skipped,
                      "holdout_points": rep["points"], "cluster": asdict(cal.cluster)}  # fmt: skip
        if args.preset == "local" or getattr(args, "profile", None):
            cluster, source = cal.cluster, f"{source} calibrated on {args.calibrate}"
    if getattr(args, "profile_out", None):
        named = replace(cluster, name=cluster.name if fit is None else f"{cluster.name}-calibrated")
        print(f"wrote cost profile {save_profile(args.profile_out, named, fit=fit)} ({source})\n")
    cpu = cluster.compute_slots > 0
    grid_p, grid_s = PRESET_GRID.get(
        args.preset if not getattr(args, "profile", None) else "", PRESET_GRID["local" if cpu else "dgx-h100"]
    )
    ps = sorted(set(args.p or grid_p))
    seqs = sorted(set(args.seq or grid_s))
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        return _fail(f"--heads {args.heads} is not a multiple of --kv-heads {kv_heads}")
    dtype = args.dtype or ("float32" if cpu else "bfloat16")
    shape = {"batch": args.batch, "heads": args.heads, "kv_heads": kv_heads, "head_dim": args.dim, "dtype": dtype}
    for p in ps:
        try:
            cluster.placement(p)
        except ValueError as e:
            return _fail(str(e))
    records, rows = report.grid(cluster, ps, seqs, shape, DTYPE_BYTES[dtype])
    print(report.grid_text(cluster, source, shape, records, rows))
    h = report.headline()
    print("\n" + report.headline_text(h))
    if args.out:
        out = Path(args.out)
        title = f"batch {args.batch}, {args.heads}/{kv_heads} heads x {args.dim}, {dtype}"
        out.mkdir(parents=True, exist_ok=True)
        pngs = plot_all(out, cluster.name, records, ps, seqs, title)
        doc: dict[str, Any] = {
            "provenance": provenance(args={k: v for k, v in vars(args).items() if k != "func"}),
            "preset": args.preset,
            "model_source": source,
            "cluster": asdict(cluster),
            "calibrated": calib_json is not None and cluster is not PRESETS[args.preset],
            "shape": shape,
            "p": ps,
            "seq": seqs,
            "model": cost_model.__doc__,
            "rows": records,
            "headline": h,
            "calibration": calib_json,
            "files": ["simulate.csv", *pngs],
        }
        report.write_files(out, records, doc)
        print(f"\nwrote {out / 'simulate.csv'}, {out / 'simulate.json'}, " + ", ".join(str(out / x) for x in pngs))
    return 0
