"""One rank of the two-"node" benchmark (started by benchmarks/bench_topology.sh inside a
network namespace). Times a decode step of every Tree strategy and Ring; rank 0 prints."""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from treeattn import Topology, ring_decode, tree_decode
from treeattn.bench.common import make_shard, shard_sizes, summarize, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    r, p = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=r, world_size=p,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    topo = Topology(int(os.environ["LOCAL_WORLD_SIZE"]))
    q = torch.randn(1, a.heads, 1, a.dim, generator=torch.Generator().manual_seed(0))
    k, v = make_shard(r, shard_sizes(a.seq, p)[r], a.heads, a.dim, torch.float32)
    res = {}
    for s in ("allreduce3", "allreduce2", "allgather", "hierarchical", "auto"):
        res[f"tree {s}"] = summarize(
            timed(lambda s=s: tree_decode(q, k, v, strategy=s, topology=topo, check=False), a.reps, 2)
        )
    res["ring"] = summarize(timed(lambda: ring_decode(q, k, v, check=False), a.reps, 1))
    if r == 0:
        print(f"{a.label}: p={p} ({p // topo.ranks_per_node} nodes x {topo.ranks_per_node}), {a.seq:,} tokens, "
              f"{a.heads}x{a.dim} float32; median ms (p10-p90)")  # fmt: skip
        for name, x in res.items():
            print(f"| {a.label} | {name} | {x['median_s'] * 1e3:.2f} | {x['p10_s'] * 1e3:.2f}-{x['p90_s'] * 1e3:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
