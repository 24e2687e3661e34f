"""Is ring_decode a fair baseline? Compare it with a minimal hand-made ring.

    python benchmarks/bench_ring_fairness.py [--nproc 2] [--seq 65536] [--heads 16] [--dim 128]

The minimal ring keeps K/V pre-packed in one buffer and a persistent receive buffer (both
allocated before timing), posts one send and one receive per hop and overlaps them with
attention over the block it holds. Also timed: the transfer alone and local attention alone.
Prints medians (max over ranks per step) and ring_decode / minimal ring.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from treeattn.bench.common import make_shard, shard_sizes, summarize, timed
from treeattn.launch import launch
from treeattn.ops.attention import attention_state
from treeattn.ops.state import merge_states
from treeattn.parallel import ring_decode


def worker(seq: int, heads: int, dim: int, reps: int) -> None:
    r, p = dist.get_rank(), dist.get_world_size()
    S = shard_sizes(seq, p)[r]
    q = torch.randn(1, heads, 1, dim, generator=torch.Generator().manual_seed(0))
    k, v = make_shard(r, S, heads, dim, torch.float32)
    packed = torch.cat([k.reshape(-1), v.reshape(-1)])
    bufs = [packed.clone(), torch.empty_like(packed)]  # equal shards: one size fits all

    def unpack(b):
        n = k.numel()
        return b[:n].view_as(k), b[n:].view_as(v)

    def minimal():
        cur, nxt = packed, bufs[1]
        state = None
        for _ in range(p - 1):
            ops = [dist.P2POp(dist.isend, cur, (r + 1) % p), dist.P2POp(dist.irecv, nxt, (r - 1) % p)]
            reqs = dist.batch_isend_irecv(ops)
            o = attention_state(q, *unpack(cur), keep_fp32=True)
            state = o if state is None else merge_states(*state, *o)
            for w in reqs:
                w.wait()
            cur, nxt = nxt, (bufs[0] if nxt is bufs[1] else bufs[1])
        o = attention_state(q, *unpack(cur), keep_fp32=True)
        return merge_states(*state, *o) if state is not None else o

    def transfer_only():
        ops = [dist.P2POp(dist.isend, packed, (r + 1) % p), dist.P2POp(dist.irecv, bufs[1], (r - 1) % p)]
        for _ in range(p - 1):
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    res = {}
    for name, fn in [
        ("local attention only", lambda: attention_state(q, k, v)),
        ("transfer only (p-1 hops)", transfer_only),
        ("minimal ring", minimal),
        ("ring_decode", lambda: ring_decode(q, k, v, check=False)),
    ]:
        res[name] = summarize(timed(fn, reps, 1))
    if r == 0:
        print(
            f"p={p}, {seq:,} tokens ({S:,} per rank, {packed.nbytes / 1e6:.0f} MB of K/V per hop), {heads}x{dim} float32"
        )
        print("| variant | median ms | p10-p90 ms |\n|---|---|---|")
        for name, s in res.items():
            print(f"| {name} | {s['median_s'] * 1e3:.1f} | {s['p10_s'] * 1e3:.1f}-{s['p90_s'] * 1e3:.1f} |")
        print(f"\nring_decode / minimal ring = {res['ring_decode']['median_s'] / res['minimal ring']['median_s']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    launch(worker, a.nproc, (a.seq, a.heads, a.dim, a.reps), timeout=3600)


if __name__ == "__main__":
    main()
