"""PNG plots of ``treeattn simulate`` predictions (matplotlib's Figure, no pyplot state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..common import finish_figure

STYLES = {"ring": "k-o", "allreduce3": "C0-s", "allreduce2": "C1-^", "allgather": "C2-v", "hierarchical": "C3-D",
          "local": "C7--"}  # fmt: skip


def _save(path: Path, lines: list[tuple[list, list, str, str]], xlabel: str, ylabel: str, xbase: int, title: str,
          legend_title: str | None = None) -> None:  # fmt: skip
    """One log-log figure of ``(x, y, style, label)`` lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    for x, y, style, label in lines:
        ax.plot(x, y, style, label=label, markersize=4)
    ax.set_xscale("log", base=xbase)
    ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    finish_figure(fig, [ax], path, legend_title, fontsize=8)


def plot_all(
    out: Path, name: str, records: list[dict[str, Any]], ps: list[int], seqs: list[int], title: str
) -> list[str]:
    """``latency_vs_p.png``, ``latency_vs_seq.png`` and ``speedup_vs_p.png`` in ``out``; returns the names."""
    by = {(r["strategy"], r["p"], r["seq"]): r["seconds"] for r in records}
    files = []
    for fname, key, fixed_key, fixed, xlabel in (
        ("latency_vs_p.png", "p", "seq", max(seqs), "ranks p"),
        ("latency_vs_seq.png", "seq", "p", max(ps), "context length (tokens)"),
    ):
        lines = []
        for s, st in STYLES.items():
            pts = [(r[key], r["seconds"] * 1e3) for r in records if r["strategy"] == s and r[fixed_key] == fixed]
            if pts:
                lines.append(([x for x, _ in pts], [v for _, v in pts], st, s))
        _save(out / fname, lines, xlabel, "predicted decode step (ms)", 2 if key == "p" else 10,
              f"{name}: {fixed_key} = {fixed:,}\n{title}")  # fmt: skip
        files.append(fname)
    lines = []
    for i, s in enumerate(seqs):
        x = [p for p in ps if ("ring", p, s) in by and ("allreduce3", p, s) in by]
        if x:
            lines.append((x, [by["ring", p, s] / by["allreduce3", p, s] for p in x], f"C{i % 10}-o", f"{s:,}"))
    _save(out / "speedup_vs_p.png", lines, "ranks p", "Ring / Tree (allreduce3) predicted time", 2,
          f"{name}: predicted speedup of Tree over Ring\n{title}", "context tokens")  # fmt: skip
    files.append("speedup_vs_p.png")
    return files
