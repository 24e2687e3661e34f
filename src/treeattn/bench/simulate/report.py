"""Text of ``treeattn simulate``: the prediction grid, the paper's headline case, the calibration
report (markdown on stdout) and the CSV/JSON files."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ...cost.model import PREDICTED, TREE_STRATEGIES, Cluster, breakdown, predict
from ...cost.presets import PRESETS
from ...cost.profile import git_commit
from ..common import markdown

#: The paper's headline (seed 000, section 6.1): Fig. 3 uses "a standard attention block of 16
#: heads of dimension 128", all computation in BF16; batch is not stated (1 assumed), MHA assumed.
PAPER_CASE: dict[str, Any] = {
    "preset": "dgx-h100",
    "p": 128,
    "seq": 5_120_000,
    "batch": 1,
    "heads": 16,
    "kv_heads": 16,
    "head_dim": 128,
    "dtype_bytes": 2,
    "paper_speedup": 8.0,
}


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table of pre-formatted cells."""
    return markdown([dict(zip(headers, r, strict=True)) for r in rows], headers)


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.4g}"


def fmt_si(v: float, unit: str) -> str:
    for f, pre in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n")):
        if abs(v) >= f:
            return f"{v / f:.4g} {pre}{unit}"
    return f"{v:.3g} {unit}"


def constants(cluster: Cluster) -> str:
    """``name = value`` of every constant, with SI units."""

    def one(k: str, v: Any) -> str:
        if isinstance(v, float) and (k.endswith(("alpha", "beta", "bw")) or k == "device_mem"):
            return fmt_si(v, "s" if k.endswith("alpha") else "B" if k == "device_mem" else "B/s")
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k} = {one(k, v)}" for k, v in asdict(cluster).items() if k not in ("notes", "name"))


def ratio(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def headline() -> dict[str, Any]:
    """The paper's headline case on ``dgx-h100``: predicted Ring / Tree speedups."""
    c = PRESETS[PAPER_CASE["preset"]]
    keys = ("p", "seq", "batch", "heads", "kv_heads", "head_dim", "dtype_bytes")
    shape = tuple(PAPER_CASE[k] for k in keys)
    t = {s: predict(c, *shape, s) for s in ("ring", *TREE_STRATEGIES)}
    best = min(TREE_STRATEGIES, key=t.__getitem__)
    k = PAPER_CASE["paper_speedup"]
    return {
        **PAPER_CASE,
        "ring_s": t["ring"],
        "allreduce3_s": t["allreduce3"],
        "best_tree": best,
        "best_tree_s": t[best],
        "speedup_vs_allreduce3": t["ring"] / t["allreduce3"],
        "speedup_vs_best_tree": t["ring"] / t[best],
        # a per-step cost X outside the model that both methods pay would give (ring+X)/(tree+X) = paper's 8x
        "overhead_for_paper_speedup_s": max(0.0, (t["ring"] - k * t["allreduce3"]) / (k - 1)),
    }


def headline_text(h: dict[str, Any]) -> str:
    return (
        f"Paper headline case (dgx-h100, p = {h['p']} = 16 nodes x 8, {h['seq']:,} tokens, {h['heads']} heads x "
        f"{h['head_dim']} (Fig. 3), batch {h['batch']}, bf16 K/V): Ring {ms(h['ring_s'])} ms, Tree allreduce3 "
        f"{ms(h['allreduce3_s'])} ms -> predicted speedup {ratio(h['speedup_vs_allreduce3'])}x "
        f"({ratio(h['speedup_vs_best_tree'])}x vs {h['best_tree']}); the paper measured ~{h['paper_speedup']:g}x. "
        f"A {ms(h['overhead_for_paper_speedup_s'])} ms per-step cost outside this model, paid by both, "
        "would reconcile the two."
    )


def calibration_text(source: str, fit_fraction: float, rep: dict[str, Any], cal: Any) -> str:
    """Markdown of a holdout report and the full fit (see :mod:`.calibrate`)."""
    out = [f"## Calibration of `{cal.cluster.name}` from {source}\n"]
    out.append(
        f"Holdout: fitted {rep['n_fit']} rows (fraction {fit_fraction} per method), "
        f"predicted {rep['n_holdout']} held-back rows; {rep['skipped']} unusable rows skipped.\n"
    )
    if rep["points"]:
        heads = ["method", "p", "seq", "batch", "heads", "kv_heads", "dim"]
        rows = [
            [x[k] for k in heads] + [ms(x["measured_s"]), ms(x["predicted_s"]), f"{x['rel_err']:+.1%}"]
            for x in rep["points"]
        ]
        out.append(table([*heads, "measured ms", "predicted ms", "error"], rows))
        out.append(f"\nmedian |error| on held-back rows: {rep['median_abs_rel_err']:.1%}\n")
    fitted = ", ".join(
        f"{k} = {fmt_si(v, 'B/s' if k.endswith(('beta', 'bw')) else 's')}" for k, v in cal.fitted.items()
    )
    out.append(
        f"Fit on all {cal.n_rows} rows: {fitted}; kept at default: {', '.join(cal.fixed) or 'none'}; "
        f"median |error| on its own rows {cal.median_rel_err:.1%}.\n"
    )
    return "\n".join(out)


def grid(cluster: Cluster, ps: list[int], seqs: list[int], shape: dict[str, Any], dtype_bytes: int):
    """Predict every strategy on the ``ps x seqs`` grid: ``(records, markdown rows)``."""
    b, h, kvh, d = shape["batch"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    records: list[dict[str, Any]] = []
    rows = []
    for p in ps:
        for s in seqs:
            t: dict[str, float | None] = {}
            ring_fits = None
            for strat in PREDICTED:
                try:
                    bd = breakdown(cluster, p, s, b, h, kvh, d, dtype_bytes, strat)
                except ValueError:  # hierarchical with unequal nodes
                    t[strat] = None
                    continue
                t[strat] = bd["total_s"]
                copies = 2 if strat == "ring" and p > 1 else 1  # Ring holds the incoming block too (paper eq. 8)
                fits = None if cluster.device_mem is None else copies * bd["kv_shard_bytes"] <= cluster.device_mem
                ring_fits = fits if strat == "ring" else ring_fits
                records.append(
                    {"preset": cluster.name, "p": p, "seq": s, **shape, "strategy": strat, "seconds": bd["total_s"]}
                    | {"compute_s": bd["compute_s"], "comm_s": bd["comm_s"], "kv_shard_bytes": bd["kv_shard_bytes"]}
                    | {"fits_memory": fits}
                )
            trees = {k: v for k, v in t.items() if k in TREE_STRATEGIES and v is not None}
            best = min(trees, key=trees.__getitem__)
            rows.append(
                [p, f"{s:,}" + (" †" if ring_fits is False else "")]
                + [ms(t[k]) for k in PREDICTED]
                + [ratio(t["ring"] / t["allreduce3"]), best, ratio(t["ring"] / trees[best])]
            )
    return records, rows


def grid_text(cluster: Cluster, source: str, shape: dict[str, Any], records: list[dict], rows: list[list]) -> str:
    out = [f"## treeattn simulate: {cluster.name}\n", f"Model: {source}\n", f"Constants: {constants(cluster)}\n"]
    out.append(f"{cluster.notes}\n")
    out.append(
        f"Shape: batch {shape['batch']}, {shape['heads']} query heads / {shape['kv_heads']} K/V heads x "
        f"{shape['head_dim']}, K/V {shape['dtype']}; states reduced in float32. Times in ms per decode step.\n"
    )
    out.append(table(["p", "seq", *PREDICTED, "ring/allreduce3", "best tree", "ring/best"], rows))
    if any(r["fits_memory"] is False for r in records):
        out.append(f"\n† Ring's two K/V blocks per device exceed {cluster.device_mem / 1e9:g} GB of device memory.")
    return "\n".join(out)


def write_files(out: Path, records: list[dict], doc: dict[str, Any]) -> None:
    """``simulate.csv`` (one row per prediction) and ``simulate.json`` (``doc`` + provenance commit)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "simulate.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(records[0]) if records else [])
        wr.writeheader()
        wr.writerows(records)
    doc["provenance"]["git_commit"] = git_commit()
    (out / "simulate.json").write_text(json.dumps(doc, indent=1, default=str))
