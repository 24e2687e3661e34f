"""Does ``auto`` pick the fastest reduction strategy? Measured on local gloo ranks (loopback).

For every world size, node layout (ranks per node) and shape ``(B, H, D, S)`` each rank times a
decode step (``tree_decode``, ``check=False``, one query token) of every Tree strategy, the
strategies interleaved step by step so that the machine's load hits them alike; a step lasts as
long as its slowest rank. Then the choice of each cost model (``choose`` on the step's state) is
scored: the fastest measured, or within 10 % of it.

    python benchmarks/bench_auto.py --configs calib --out results/auto      # rows to calibrate from
    treeattn simulate --preset local --calibrate results/auto/latency_rows_calib.json \
        --profile-out results/auto/profile.json
    python benchmarks/bench_auto.py --configs eval --profile results/auto/profile.json --out results/auto

Models compared: the calibrated ``--profile``, the built-in ``local`` preset, and the constants
``auto`` used before the cost package (30 us / 10 GB/s intra-node, 60 us / 5 GB/s inter-node,
collective latency and bandwidth terms only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from treeattn import Topology, tree_decode
from treeattn.bench.common import make_shard, markdown, read_jsonl, shard_sizes, summarize
from treeattn.cost import PRESETS, Cluster, choose, load_profile
from treeattn.launch import launch

TREE = ("allreduce3", "allreduce2", "allgather", "hierarchical")
# (B, H, D, S), 16-64 MB of K/V: calibration shapes and (other) evaluation shapes
CONFIGS = {
    "calib": [(1, 8, 64, 4096), (4, 16, 128, 1024), (16, 32, 128, 256), (64, 32, 128, 64)],
    "eval": [(1, 8, 64, 16384), (1, 32, 128, 2048), (8, 32, 128, 256), (32, 32, 128, 64)],
}
OLD = Cluster(name="previous constants", nodes=1, devices_per_node=1 << 20, intra_alpha=30e-6, intra_beta=10e9,
              inter_alpha=60e-6, inter_beta=5e9, device_mem_bw=1e18, attn_efficiency=1.0)  # fmt: skip


def layouts(p: int) -> list[int]:
    """Ranks per node: one node, and two-level layouts with 2+ ranks on 2+ nodes."""
    return [p] + [r for r in (p // 2,) if r > 1 and p // r > 1]


def worker(configs: list, reps: int, warmup: int, out: str) -> None:
    rank, p = dist.get_rank(), dist.get_world_size()
    for rpn in layouts(p):
        topo = Topology(rpn)
        strats = TREE if rpn < p else TREE[:3]  # on one node hierarchical is allgather
        for B, H, D, S in configs:
            q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(0))
            k, v = make_shard(rank, shard_sizes(S, p)[rank], H, D, torch.float32, B)
            fns = [
                lambda s=s, q=q, k=k, v=v, t=topo: tree_decode(q, k, v, strategy=s, topology=t, check=False)
                for s in strats
            ]
            ts = torch.zeros(reps, len(fns), dtype=torch.float64)
            for i in range(-warmup, reps):
                for j, fn in enumerate(fns):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if i >= 0:
                        ts[i, j] = time.perf_counter() - t0
            dist.all_reduce(ts, op=dist.ReduceOp.MAX)
            if rank == 0:
                with open(out, "a") as f:
                    for j, s in enumerate(strats):
                        row = {"p": p, "ranks_per_node": rpn, "B": B, "H": H, "D": D, "S": S, "strategy": s}
                        f.write(json.dumps(row | summarize(ts[:, j].tolist())) + "\n")


def latency_rows(rows: list[dict]) -> list[dict]:
    """The rows in ``treeattn bench latency``'s format (+ ``ranks_per_node``), for ``treeattn simulate --calibrate``."""
    return [
        {"method": f"tree {r['strategy']}", "p": r["p"], "seq": r["S"], "batch": r["B"], "heads": r["H"],
         "kv_heads": r["H"], "dim": r["D"], "dtype": "float32", "median_s": r["median_s"],
         "ranks_per_node": r["ranks_per_node"]}
        for r in rows
    ]  # fmt: skip


def score(rows: list[dict], models: dict[str, Cluster]) -> tuple[list[dict], dict[str, list[int]]]:
    """Per configuration: the fastest strategy and each model's pick with its time / fastest."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["p"], r["ranks_per_node"], r["B"], r["H"], r["D"], r["S"]), {})[r["strategy"]] = r[
            "median_s"
        ]
    table, hits = [], {m: [0, 0, 0] for m in models}  # fastest, within 10 %, configurations
    for (p, rpn, B, H, D, S), t in sorted(groups.items()):
        best = min(t, key=t.get)
        row = {
            "p": p,
            "layout": f"{p // rpn}x{rpn}",
            "B,H,D,S": f"{B},{H},{D},{S}",
            "state KB": B * H * (D + 1) * 4 / 1e3,
        }
        row |= {f"{s} ms": t[s] * 1e3 if s in t else "-" for s in TREE} | {"fastest": best}
        for m, c in models.items():
            pick = choose(c, B * H * D * 4, B * H * 4, p, rpn)
            ratio = t[pick] / t[best]
            row[m] = f"{pick} ({ratio:.2f})"
            hits[m][0] += pick == best
            hits[m][1] += ratio <= 1.10
            hits[m][2] += 1
        table.append(row)
    return table, hits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", nargs="+", default=[], help="calibrated cost profiles (simulate --profile-out)")
    ap.add_argument("--configs", choices=list(CONFIGS), default="eval")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", default=None, help="score these measured rows (JSON lines) instead of measuring")
    ap.add_argument("--out", default="results/auto")
    a = ap.parse_args()
    profs = [load_profile(x) for x in a.profile]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.rows:
        rows = read_jsonl(Path(a.rows))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "rows.jsonl"
            for p in a.nproc:
                launch(worker, p, (CONFIGS[a.configs], a.reps, a.warmup, str(path)), timeout=3600)
            rows = read_jsonl(path)
        (out / f"auto_rows_{a.configs}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / f"latency_rows_{a.configs}.json").write_text(json.dumps({"rows": latency_rows(rows)}))
    models = {f"profile {Path(x.path).stem}": x.cluster for x in profs}
    models |= {"built-in local": PRESETS["local"], "previous constants": OLD}
    table, hits = score(rows, models)
    print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    print("".join(f"{m}: {x.describe()}\n" for m, x in zip(models, profs, strict=False)))
    print(markdown(table, list(dict.fromkeys(k for r in table for k in r))))
    print()
    for m, (best, near, n) in hits.items():
        print(f"{m}: fastest in {best}/{n}, fastest or within 10% in {near}/{n}")
    doc = {"command": " ".join(sys.argv), "loadavg": os.getloadavg(), "profiles": [x.describe() for x in profs], "table": table,
           "hits": {m: dict(zip(("fastest", "within_10pct", "n"), h, strict=True)) for m, h in hits.items()}}  # fmt: skip
    (out / f"auto_{a.configs}.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
