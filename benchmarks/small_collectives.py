"""The small collectives of a decode step between CPU ranks of one host: through /dev/shm
(treeattn.comm.shm_small) against gloo's loopback, in one launch (each call alternates the two
paths block by block, so drift hits both): µs per call in blocks of 25 back-to-back calls, the
median of ``--reps`` calls' blocks, on rank 0; and the whole
state reduction of Tree decoding (``reduce_states``, strategy allgather: the all-gather and the
merge) for a SmolLM2-135M-shaped state (9 heads x 64) and a Llama-8B-shaped one (32 x 128);
then that reduction through /dev/shm as one compiled call against the Python steps, alternating.
Not a test: it prints what it measured.

    python benchmarks/small_collectives.py --nproc 2
"""

from __future__ import annotations

import argparse
import time


def worker(reps: int) -> None:
    import statistics

    import torch
    import torch.distributed as dist

    from treeattn.comm import shm_small
    from treeattn.comm.collectives import all_gather, all_reduce, broadcast, group_or_world
    from treeattn.comm.strategies import reduce_states

    rank, p = dist.get_rank(), dist.get_world_size()
    all_gather(torch.zeros(8), None)  # sets the shared-memory path up
    g = group_or_world(None)
    st = shm_small._GROUPS[g]
    if not st:
        raise SystemExit("the shared-memory path is off here (TREEATTN_SHM=0, or not x86-64)")

    def use_shm(on: bool) -> None:
        shm_small._GROUPS[g] = st if on else False

    def med(fn, use=use_shm, n: int = 25) -> tuple[float, float]:
        """µs per call: blocks of ``n`` back-to-back calls (as a decode step issues them),
        alternating the two paths (``use(True)``, ``use(False)``) block by block; the median
        block of each."""
        t = {True: [], False: []}
        for i in range(2 * max(reps // n, 1)):
            first = i % 2 == 0
            use(first)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t[first].append((time.perf_counter() - t0) / n)
        use(True)
        return 1e6 * statistics.median(t[True]), 1e6 * statistics.median(t[False])

    rows = []
    for nbytes in (256, 8 << 10, 64 << 10, 1 << 20):
        x = torch.randn(nbytes // 4)
        rows.append((f"all_gather {nbytes:,} B", *med(lambda x=x: all_gather(x, None))))
    x = torch.randn(2304)
    rows.append(("all_reduce sum 9,216 B", *med(lambda: all_reduce(x.clone(), dist.ReduceOp.SUM, None))))
    rows.append(("broadcast 9,216 B", *med(lambda: broadcast(x.clone(), None))))
    for name, (H, D) in {"SmolLM2-135M (9 x 64)": (9, 64), "Llama-8B (32 x 128)": (32, 128)}.items():
        out, lse = torch.randn(1, H, 1, D), torch.randn(1, H, 1)
        rows.append((f"reduce_states {name}", *med(lambda o=out, s=lse: reduce_states(o, s, strategy="allgather"))))
    # the all-gather strategy's round through /dev/shm: one compiled call, or the Python steps
    # (all_gather, then the merge), alternating block by block
    from treeattn.comm import strategies

    gm, rounds = strategies.gather_merge, []

    def use_compiled(on: bool) -> None:
        strategies.gather_merge = gm if on else (lambda *a: None)

    for name, (H, D) in {"SmolLM2-135M (9 x 64)": (9, 64), "Llama-8B (32 x 128)": (32, 128)}.items():
        out, lse = torch.randn(1, H, 1, D), torch.randn(1, H, 1)
        fn = lambda o=out, s=lse: reduce_states(o, s, strategy="allgather")  # noqa: E731
        rounds.append((f"reduce_states {name}", *med(fn, use_compiled)))
    if rank == 0:
        print(f"\np = {p}, µs per call: the median block of 25 back-to-back calls, {reps} calls per path (rank 0)\n")
        print("| call | /dev/shm | gloo | gloo / shm |")
        print("|---|---|---|---|")
        for name, a, b in rows:
            print(f"| {name} | {a:.0f} | {b:.0f} | {b / a:.1f}x |")
        print("\nthe reduction's round through /dev/shm, µs per call as above\n")
        print("| call | one compiled call | the Python steps | Python / compiled |")
        print("|---|---|---|---|")
        for name, a, b in rounds:
            print(f"| {name} | {a:.0f} | {b:.0f} | {b / a:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    from treeattn.launch import launch

    launch(worker, a.nproc, (a.reps,), timeout=1800)


if __name__ == "__main__":
    main()
