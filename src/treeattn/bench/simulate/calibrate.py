"""Fit a cluster's constants to measured decode steps (``treeattn bench latency`` rows)."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ...cost.model import DTYPE_BYTES, PREDICTED, Cluster, Lin, linear_params, predict, step_time, traced, value
from ...cost.presets import PRESETS


class _Row(NamedTuple):
    strategy: str
    p: int
    seq: int
    batch: int
    heads: int
    kv_heads: int
    dim: int
    dtype_bytes: int
    seconds: float
    method: str
    rpn: int | None = None  # ranks per node of a multi-node row

    def model(self, c: Cluster, P: dict[str, Any]) -> Any:
        return step_time(c, P, *self[1:8], self.strategy, self.rpn)


def _parse_row(row: Any) -> _Row | None:
    """A bench row, or None when it is unusable (unknown method, missing/invalid fields)."""
    try:
        method = str(row["method"]).strip()
        if method in ("ring", "local"):
            strategy = method
        elif method == "single device":  # full context on rank 0 alone: local attention at p = 1
            strategy = "local"
        elif method == "tree":
            strategy = "auto"
        elif method.startswith("tree "):
            strategy = method[5:].strip()
        else:
            return None
        if strategy not in PREDICTED:
            return None
        heads = int(row["heads"])
        parsed = _Row(
            strategy,
            1 if method == "single device" else int(row["p"]),
            int(row["seq"]),
            int(row.get("batch", 1)),
            heads,
            int(row.get("kv_heads") or heads),
            int(row["dim"]),
            DTYPE_BYTES[str(row.get("dtype", "float32"))],
            float(row["median_s"]),
            method,
            int(row["ranks_per_node"]) if row.get("ranks_per_node") else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not (parsed.seconds > 0 and math.isfinite(parsed.seconds)) or min(parsed[1:8]) < 1:
        return None
    if parsed.heads % parsed.kv_heads:
        return None
    return parsed


def _parse_rows(rows: Iterable[Any]) -> tuple[list[_Row], int]:
    out, skipped = [], 0
    for r in rows:
        x = _parse_row(r)
        if x is None:
            skipped += 1
        else:
            out.append(x)
    return out, skipped


def _with_params(base: Cluster, th: dict[str, float | None]) -> Cluster:
    return replace(
        base,
        collective_alpha=th["collective_alpha"],
        intra_alpha=th["intra_alpha"],
        intra_beta=1.0 / th["intra_inv_beta"],
        inter_alpha=th["inter_alpha"],
        inter_beta=1.0 / th["inter_inv_beta"],
        p2p_alpha=th["p2p_alpha"],
        p2p_beta=None if th["p2p_inv_beta"] is None else 1.0 / th["p2p_inv_beta"],
        attn_alpha=th["attn_alpha"],
        attn_efficiency=1.0 / (th["inv_attn_bw"] * base.device_mem_bw),
    )


def _natural(th: dict[str, float | None], names: Iterable[str]) -> dict[str, float]:
    """Fitted linear parameters in the units of :class:`Cluster` (s, B/s)."""
    rename = {
        "intra_inv_beta": "intra_beta",
        "inter_inv_beta": "inter_beta",
        "p2p_inv_beta": "p2p_beta",
        "inv_attn_bw": "attn_bw",
    }
    return {rename.get(k, k): (1.0 / th[k] if k in rename else th[k]) for k in names if th[k] is not None}


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`.

    Attributes:
        cluster: the base cluster with the fitted constants.
        fitted: fitted constants in natural units (s; B/s; ``attn_bw`` = mem_bw x efficiency).
        fixed: constants left at the base value: no row constrains them, or a bandwidth fitted <= 0.
            (A latency fitted <= 0 is reported in ``fitted`` as 0.)
        n_rows, skipped: usable and unusable input rows.
        rms_rel_err, median_rel_err: relative error of the fit on its own rows.
        iterations: refits until the overlap/algorithm branches stopped changing (or the cap, keeping
            the iterate with the least error).
    """

    cluster: Cluster
    fitted: dict[str, float]
    fixed: tuple[str, ...]
    n_rows: int
    skipped: int
    rms_rel_err: float
    median_rel_err: float
    iterations: int


# order in which parameters enter the fit when rows cannot separate all of them
_FIT_ORDER = (
    "inv_attn_bw",
    "collective_alpha",
    "intra_alpha",
    "intra_inv_beta",
    "p2p_inv_beta",
    "p2p_alpha",
    "attn_alpha",
    "inter_alpha",
    "inter_inv_beta",
)


def _independent(M: torch.Tensor, cols: Sequence[int], tol: float = 1e-7) -> list[int]:
    """Greedily keep the columns of ``M`` (in the given order) that add to its rank."""
    keep: list[int] = []
    for j in cols:
        if not bool(M[:, j].abs().max() > 0):
            continue
        trial = [*keep, j]
        N = M[:, trial] / M[:, trial].norm(dim=0)
        sv = torch.linalg.svdvals(N)
        if sv[-1] > tol * sv[0]:
            keep = trial
    return keep


def _calibrate(rows: list[_Row], skipped: int, base: Cluster, max_iter: int = 50) -> Calibration:
    if not rows:
        raise ValueError("no usable rows to calibrate from (need method, p, seq, heads, dim, median_s)")
    y = torch.tensor([r.seconds for r in rows], dtype=torch.float64)
    w = 1.0 / y  # minimise relative error: times span orders of magnitude
    base_th = linear_params(base)
    names = [k for k in _FIT_ORDER if base_th[k] is not None]
    cur = base
    fixed: list[str] = []
    best: tuple[float, Cluster, torch.Tensor, list[str]] | None = None
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - reported
        th = linear_params(cur)
        P = traced(cur)
        A = torch.zeros(len(rows), len(names), dtype=torch.float64)
        off = torch.zeros(len(rows), dtype=torch.float64)
        for i, r in enumerate(rows):
            t = r.model(cur, P)
            coef = t.c if isinstance(t, Lin) else {}
            A[i] = torch.tensor([coef.get(k, 0.0) for k in names], dtype=torch.float64)
            off[i] = value(t) - sum(coef.get(k, 0.0) * th[k] for k in names)
        Aw = A * w[:, None]
        free = _independent(Aw, range(len(names)))
        hold = {j: base_th[names[j]] for j in range(len(names)) if j not in free}
        zeroed: set[int] = set()
        while True:
            rhs = y - off - sum((A[:, j] * v for j, v in hold.items()), torch.zeros_like(y))
            x = torch.zeros(len(free), dtype=torch.float64)
            if free:
                M = Aw[:, free]
                s = M.norm(dim=0)
                x = torch.linalg.lstsq(M / s, (rhs * w)[:, None], driver="gelsd").solution[:, 0] / s
            bad = [free[i] for i in range(len(free)) if not x[i] > 0]
            if not bad:
                break
            # non-physical: a latency goes to 0 (the non-negative optimum), a bandwidth keeps its base value
            for j in bad:
                zero = names[j].endswith("alpha")
                hold[j] = 0.0 if zero else base_th[names[j]]
                zeroed |= {j} if zero else set()
            free = [j for j in free if j not in bad]
        new = dict(base_th)
        for i, j in enumerate(free):
            new[names[j]] = float(x[i])
        for j, v in hold.items():
            new[names[j]] = v
        fixed = [names[j] for j in range(len(names)) if j not in free and j not in zeroed]
        done = all(
            (new[k] is None and th[k] is None) or abs(new[k] - th[k]) <= 1e-9 * abs(th[k]) + 1e-30 for k in names
        )
        cur = _with_params(base, new)
        pred = torch.tensor([predict(cur, *r[1:8], r.strategy, r.rpn) for r in rows], dtype=torch.float64)
        rel = (pred - y) / y
        err = float(rel.pow(2).mean())
        if best is None or err < best[0]:
            best = (err, cur, rel, fixed)
        if done:
            break
    _, cur, rel, fixed = best  # branches may cycle on noisy rows: keep the best iterate
    tied: set[str] = set()  # inter-node constants that follow the intra-node ones (one host)
    if (base.inter_alpha, base.inter_beta) == (base.intra_alpha, base.intra_beta) and {
        "inter_alpha",
        "inter_inv_beta",
    } <= set(fixed):
        cur = replace(cur, inter_alpha=cur.intra_alpha, inter_beta=cur.intra_beta)
        tied = {"inter_alpha", "inter_inv_beta"}
        fixed = [k for k in fixed if k not in tied]
    final = linear_params(cur)
    return Calibration(
        cluster=cur,
        fitted=_natural(final, [k for k in names if k not in fixed and k not in tied]),
        fixed=tuple(fixed),
        n_rows=len(rows),
        skipped=skipped,
        rms_rel_err=float(rel.pow(2).mean().sqrt()),
        median_rel_err=float(rel.abs().median()),
        iterations=it,
    )


def calibrate(rows: Iterable[dict[str, Any]], base: Cluster | None = None) -> Calibration:
    """Fit the constants of ``base`` (default the ``local`` preset) to measured decode steps by
    least squares on the relative error.

    The model is linear in ``collective_alpha``, ``intra_alpha``, ``1/intra_beta``, ``p2p_alpha``,
    ``1/p2p_beta``, ``attn_alpha`` and ``1/(device_mem_bw·attn_efficiency)`` (plus the inter-node
    pair on multi-node rows) once the ring's overlap branch (``max(T, C)``) and the all-reduce
    algorithm are fixed, so it alternates: choose branches with the current constants, solve, repeat
    until they stop changing. Constants no row constrains (missing methods), or that the rows cannot
    separate from already fitted ones, keep the base value. A latency fitted <= 0 is set to 0 and an
    inverse bandwidth fitted <= 0 keeps the base value, then the rest is refitted (an active-set
    non-negative least squares). ``device_mem_bw`` is kept; ``attn_efficiency`` absorbs the fitted
    bandwidth. Times are weighted by 1/measured, so the fit minimises relative error. When no
    row spans nodes and ``base`` has equal intra- and inter-node links (one host, as ``local``),
    the inter-node constants follow the fitted intra-node ones.

    Args:
        rows: dicts as written by ``treeattn bench latency``: ``method`` (``"tree <strategy>"``,
            ``"ring"``, ``"local"``, or ``"single device"`` read as local at p = 1), ``p``, ``seq``,
            ``batch``, ``heads``, ``kv_heads``, ``dim``, ``dtype``, ``median_s`` (s), optionally
            ``ranks_per_node`` (the layout of a multi-node row; default: the base's placement). Unusable rows
            (other methods, missing or invalid fields) are skipped and counted.
        base: cluster whose topology and defaults are used.

    Raises:
        ValueError: no usable row.
    """
    parsed, skipped = _parse_rows(rows)
    return _calibrate(parsed, skipped, base or PRESETS["local"])


def holdout_report(
    rows: Iterable[dict[str, Any]], fit_fraction: float = 0.5, base: Cluster | None = None, seed: int = 0
) -> dict[str, Any]:
    """Fit on a random ``fit_fraction`` of the rows of each method (at least one per method, seeded)
    and predict the others.

    Returns:
        ``{"fit": Calibration, "n_fit", "n_holdout", "skipped", "points": [{method, p, seq, batch,
        heads, kv_heads, dim, measured_s, predicted_s, rel_err}], "median_abs_rel_err"}``
        (``rel_err = predicted/measured - 1``; the median is NaN when nothing was held back).
    """
    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    parsed, skipped = _parse_rows(rows)
    by_method: dict[str, list[_Row]] = {}
    for r in parsed:
        by_method.setdefault(r.method, []).append(r)
    rng = random.Random(seed)
    fit, held = [], []
    for m in sorted(by_method):
        rs = by_method[m]
        idx = list(range(len(rs)))
        rng.shuffle(idx)
        k = max(1, math.ceil(fit_fraction * len(rs) - 1e-9))
        fit += [rs[i] for i in idx[:k]]
        held += [rs[i] for i in idx[k:]]
    cal = _calibrate(fit, skipped, base or PRESETS["local"])
    points = []
    for r in sorted(held, key=lambda r: (r.method, r.p, r.seq, r.batch, r.heads)):
        pred = predict(cal.cluster, *r[1:8], r.strategy, r.rpn)
        points.append(
            {
                "method": r.method,
                "p": r.p,
                "seq": r.seq,
                "batch": r.batch,
                "heads": r.heads,
                "kv_heads": r.kv_heads,
                "dim": r.dim,
                "measured_s": r.seconds,
                "predicted_s": pred,
                "rel_err": pred / r.seconds - 1.0,
            }
        )
    med = statistics.median(abs(x["rel_err"]) for x in points) if points else float("nan")
    return {
        "fit": cal,
        "n_fit": len(fit),
        "n_holdout": len(held),
        "skipped": skipped,
        "points": points,
        "median_abs_rel_err": med,
    }
