"""Small collectives through shared memory (treeattn.comm.shm_small) against gloo's.

One launch of 5 ranks covers groups of 5 (the world), 2 and 3 (sub-groups): every
all_gather and broadcast equals gloo's bit for bit, every all_reduce is identical on every
rank and bitwise gloo's for MAX/MIN/integers and for SUM at p = 2, within rounding of it for
a float SUM over more ranks; across hundreds of rounds with random stalls (slot reuse),
payload sizes at and over the limit, odd dtypes and non-contiguous inputs. Tree decoding's
reduction through it equals the gloo path's bit for bit, the compiled round of the all-gather
strategy included (empty and undefined states, a late rank, ranks on the Python path beside
it). A peer killed mid-exchange, or one that stalls (in an all-gather or in the compiled
round), ends every other rank with CollectiveError (at once, or at the collective
timeout), with no process and no segment left."""

from __future__ import annotations

import glob
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from procs import watch_children
from treeattn.launch import LaunchError, launch


def _ours() -> set[str]:
    return set(glob.glob(f"/dev/shm/treeattn-{os.getuid()}-*"))


def _gloo(fn, group, *a, **kw):
    """Run ``fn`` with the group's shared-memory path switched off (gloo's result)."""
    from treeattn.comm import shm_small
    from treeattn.comm.collectives import group_or_world

    g = group_or_world(group)
    st = shm_small._GROUPS[g]
    shm_small._GROUPS[g] = False
    try:
        return fn(*a, **kw)
    finally:
        shm_small._GROUPS[g] = st


def bitwise_worker() -> None:
    import treeattn
    from treeattn.comm import shm_small
    from treeattn.comm.collectives import all_gather, all_reduce, broadcast, group_or_world

    rank = dist.get_rank()
    pair, trio = dist.new_group([0, 2]), dist.new_group([1, 3, 4])  # every rank takes part
    groups = [(None, True), (pair, rank in (0, 2)), (trio, rank in (1, 3, 4))]
    rng = torch.Generator().manual_seed(1234)  # the same stream on every rank: same shapes
    R = shm_small.SMALL
    for i in range(240):
        group, member = groups[i % 3]
        kind = int(torch.randint(0, 6, (1,), generator=rng))
        n = int(torch.randint(1, 400, (1,), generator=rng))
        if i % 40 == 5:  # exactly the limit (shared memory), then one element over (gloo)
            n = R // 4 + (i // 40) % 2
        if not member:
            continue
        r, gp = dist.get_rank(group), dist.get_world_size(group)
        if torch.rand(1).item() < 0.1:  # one rank lags (a slot must not be rewritten under a reader)
            time.sleep(0.005)
        local = torch.Generator().manual_seed(10_000 * i + r)
        x = torch.randn(n, generator=local)
        what = f"round {i} group size {gp} kind {kind} n {n}"
        if kind == 0:
            a, b = all_gather(x, group), _gloo(all_gather, group, x, group)
        elif kind == 1:  # bf16, non-contiguous
            y = torch.randn(n, 3, generator=local).to(torch.bfloat16).t()
            a, b = all_gather(y, group), _gloo(all_gather, group, y, group)
        elif kind == 2:
            xi = torch.randint(-(2**62), 2**62, (n,), generator=local)
            op = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)[i % 3]
            a, b = all_reduce(xi.clone(), op, group), _gloo(all_reduce, group, xi.clone(), op, group)
        elif kind == 3:
            op = (dist.ReduceOp.MAX, dist.ReduceOp.MIN)[i % 2]
            a, b = all_reduce(x.clone(), op, group), _gloo(all_reduce, group, x.clone(), op, group)
        elif kind == 4:
            a, b = broadcast(x.clone(), group), _gloo(broadcast, group, x.clone(), group)
        else:  # float SUM: identical on every rank; gloo's bitwise at p = 2, else within rounding
            a, b = all_reduce(x.clone(), dist.ReduceOp.SUM, group), _gloo(all_reduce, group, x.clone(), dist.ReduceOp.SUM, group)  # fmt: skip
            everyone = _gloo(all_gather, group, a, group)
            assert all(torch.equal(everyone[0], e) for e in everyone), what
            if gp > 2:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * gp, msg=what)
                continue
        assert a.dtype == b.dtype and torch.equal(a, b), what
    # back-to-back broadcasts: the root never waits for readers, except before reusing a slot
    for i in range(60):
        x = torch.randn(300, generator=torch.Generator().manual_seed(i))
        if rank and torch.rand(1).item() < 0.3:
            time.sleep(0.003)
        got = broadcast(x.clone() if rank == 0 else torch.zeros(300), None)
        assert torch.equal(got, x), f"broadcast {i}"
    for group, member in groups:
        if member:
            st = shm_small._GROUPS[group_or_world(group)]
            assert isinstance(st, shm_small._Small) and st.round > 40, (group, st)

    # the compiled round of the all-gather strategy (gather and merge in one call) against gloo's
    # all-gather and the same merge: bitwise, with empty (+-inf) and undefined (NaN) states, one
    # or several states per rank (stacked), a lagging rank (the compiled wait gives up: code 2,
    # the Python wait takes over), a rank still in a broadcast (code 1: nothing sent, the general
    # path), and one rank of a group on the Python path (the two paths exchange with each other)
    from treeattn.comm import strategies
    from treeattn.ops.packed import merge_packed

    codes = torch.zeros(3, dtype=torch.int64)
    compiled = shm_small.shm_gather_merge
    assert compiled() is not None, "the compiled kernel did not build"

    def counting():
        f = compiled()

        def call(*a):
            got = f(*a)
            codes[got] += 1
            return got

        return call

    shm_small.shm_gather_merge = counting
    try:
        for i in range(180):
            group, member = groups[i % 3]
            if not member:
                continue
            r, gp = dist.get_rank(group), dist.get_world_size(group)
            local = torch.Generator().manual_seed(50_000 + 10 * i + r)
            H, Dv, k = 1 + i % 4, (8, 64, 3)[i % 3], (1, 1, 2, 3)[i % 4]
            stacked = i % 4 > 1
            out, lse = torch.randn(k, 2, H, 1, Dv, generator=local), torch.randn(k, 2, H, 1, generator=local) * 30
            special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
            pick = torch.randint(0, 12, lse.shape, generator=local)
            lse = torch.where(pick < 4, special[pick.clamp(max=3)], lse)
            if not stacked:
                out, lse = out[0], lse[0]
            if i % 7 == 3 and r == gp - 1:  # a late rank: the others outwait the compiled spin
                time.sleep(0.02)
            if i % 11 == 4:  # the root leaves a broadcast at once, a late rank is still before it
                if r == gp - 1:
                    time.sleep(0.02)
                broadcast(torch.zeros(4), group)
            python_path = i % 5 == 1 and r == 0
            if python_path:
                saved = strategies.gather_merge
                strategies.gather_merge = lambda *a: None
            try:
                got = strategies.reduce_states(out, lse, group=group, strategy="allgather", stacked=stacked)
            finally:
                if python_path:
                    strategies.gather_merge = saved
            every = _gloo(all_gather, group, torch.cat([out, lse.unsqueeze(-1)], -1), group)
            ref = merge_packed(every.flatten(0, 1) if stacked else every)
            what = f"states {i} group size {gp} k {k}"
            assert all(torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
                       for x, y in zip(got, ref, strict=True)), what  # fmt: skip
    finally:
        shm_small.shm_gather_merge = compiled
    for group, member in groups:  # every path left the group's ranks at the same round
        if member:
            n = torch.tensor([shm_small._GROUPS[group_or_world(group)].round])
            assert (_gloo(all_gather, group, n, group) == n).all(), "round counters differ"
    codes = _gloo(all_gather, None, codes, None).sum(0)
    assert (codes > 0).all(), f"return codes 0 / 1 / 2 seen {codes.tolist()} times"

    # Tree decoding's reduction (allgather, allreduce2): the same bits either way
    for strategy in ("allgather", "allreduce2"):
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(7))
        k, v = torch.randn(2, 2, 11 + rank, 16, generator=g), torch.randn(2, 2, 11 + rank, 16, generator=g)
        out = treeattn.tree_decode(q, k, v, strategy=strategy, return_lse=True)
        ref = _gloo(treeattn.tree_decode, None, q, k, v, strategy=strategy, return_lse=True)
        if strategy == "allgather":
            assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True)), strategy
        else:
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_small_collectives_bitwise_as_gloo():
    before = _ours()
    launch(bitwise_worker, 5, timeout=300)
    assert _ours() == before, "segments left in /dev/shm"


def fault_worker(outdir: str, how: str, op: str) -> None:
    from treeattn.comm.collectives import CollectiveError, all_gather
    from treeattn.comm.strategies import reduce_states

    rank = dist.get_rank()
    x = torch.ones(64)
    step = all_gather
    if op == "states":  # the compiled round of the all-gather strategy
        from treeattn.ops._decode_cpu import shm_gather_merge

        assert shm_gather_merge() is not None, "the compiled kernel did not build"
        step = lambda x, group: reduce_states(x.reshape(4, 16), x[:4], group=group, strategy="allgather")  # noqa: E731
    for _ in range(20):
        step(x, None)
    if rank == 2:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # stalls past the collective timeout
    t0 = time.monotonic()
    try:
        step(x, None)
    except CollectiveError as e:
        Path(outdir, f"{rank}.txt").write_text(f"{time.monotonic() - t0}\n{e}")
        raise SystemExit(1) from e


@pytest.mark.parametrize("how,op", [("kill", "all_gather"), ("stall", "all_gather"), ("kill", "states"),
                                    ("stall", "states")])  # fmt: skip
def test_peer_killed_or_stalled_mid_exchange(tmp_path, how, op):
    before = _ours()
    t0 = time.monotonic()
    with watch_children(3), pytest.raises(LaunchError):
        launch(fault_worker, 3, (str(tmp_path), how, op), timeout=60, collective_timeout=4)
    assert time.monotonic() - t0 < 40
    for r in (0, 1):
        waited, msg = Path(tmp_path, f"{r}.txt").read_text().split("\n", 1)
        assert "all_gather failed on rank" in msg and "group rank 2" in msg, msg
        if how == "kill":
            assert "exited" in msg and float(waited) < 2.0, (waited, msg)
        else:
            assert "collective timeout (4 s)" in msg and 3.9 < float(waited) < 10, (waited, msg)
    assert _ours() == before, "segments left in /dev/shm"
