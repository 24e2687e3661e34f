"""The ring's shared-memory exchange (treeattn.comm.shm) against its gloo send/recv, at p = 3.

Every block visited through /dev/shm equals, bit for bit, the block visited through gloo and
the owner's original, in the same order, across slot reuse, segment growth, empty blocks, a
sub-group and two dtypes, and back to back with a slow reader; Ring prefill over it is bitwise
the gloo ring's. With TREEATTN_SHM=0 (on every rank, or on one) the exchange is off and the
ring still exact, and a growth that fails on one rank turns the group to gloo on all. Nothing
is left in /dev/shm."""

from __future__ import annotations

import glob
import os
import time

import torch
import torch.distributed as dist

from reference import max_err, reference
from treeattn.launch import launch


def _visits(k, v, sizes, group, shm):
    from treeattn.parallel.ring import ring_pass

    seen = []
    ring_pass(k, v, sizes, group, lambda src, kb, vb: seen.append((src, kb.clone(), vb.clone())), shm=shm)
    return seen


def shm_worker() -> None:
    import treeattn.parallel.prefill as P
    import treeattn.parallel.ring as R
    from treeattn.cache import Placement
    from treeattn.comm.shm import _GROUPS, _Shm

    rank, p = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group([0, 2])  # every rank takes part in creating it
    cases = [  # (group, sizes per rank, heads, D, Dv, dtype): the 2nd grows the segments
        (None, [3, 0, 5], 2, 16, 16, torch.float32),
        (None, [40, 33, 41], 3, 16, 8, torch.float32),
        (None, [1, 2, 0], 2, 16, 16, torch.bfloat16),
        (None, [7, 7, 7], 1, 4, 4, torch.float32),
        (None, [40, 33, 41], 3, 16, 8, torch.bfloat16),
        (sub, [9, 4], 2, 8, 8, torch.float32),
    ]
    for i, (group, sizes, H, D, Dv, dtype) in enumerate(cases):
        if group is sub and rank == 1:
            continue
        r = dist.get_rank(group)
        g = torch.Generator().manual_seed(100 * i + r)
        k = torch.randn(2, H, sizes[r], D, generator=g).to(dtype)
        v = torch.randn(2, H, sizes[r], Dv, generator=g).to(dtype)
        a, b = _visits(k, v, sizes, group, True), _visits(k, v, sizes, group, False)
        n = len(sizes)
        assert [s for s, _, _ in a] == [(r - h) % n for h in range(n)] == [s for s, _, _ in b], i
        for (s, ka, va), (_, kb, vb) in zip(a, b, strict=True):
            assert ka.dtype == dtype and ka.shape == (2, H, sizes[s], D) and va.shape == (2, H, sizes[s], Dv)
            assert torch.equal(ka, kb) and torch.equal(va, vb), f"case {i}: block of rank {s}"
        assert torch.equal(a[0][1], k) and torch.equal(a[0][2], v)
    # back to back through shm only, one rank slow in its visits each time: a slot is never
    # written again while a peer still reads it (the data of every exchange arrives intact)
    from treeattn.parallel.ring import ring_pass

    for c in range(8):
        k = torch.full((1, 2, 5, 4), float(100 * c + rank))

        def visit(src, kb, vb, c=c):
            if rank == c % p:
                time.sleep(0.05)
            assert torch.equal(kb, torch.full_like(kb, 100 * c + src)) and torch.equal(vb, kb + 1), (c, src)

        ring_pass(k, k + 1, [5] * p, None, visit, shm=True)
    assert isinstance(_GROUPS[dist.group.WORLD], _Shm), "the exchange was not used"
    if rank != 1:
        assert isinstance(_GROUPS[sub], _Shm)

    # Ring prefill: bitwise the gloo ring's, exact against float64
    orig = R.ring_pass
    L, pl = 300, Placement("interleaved", p, 8)
    pos = [pl.prompt_positions(j, L) for j in range(p)]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, L, 16, generator=g) for h in (6, 2, 2))
    mine = pos[rank]
    via_shm = P.ring_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos)
    R.ring_pass = lambda *a, shm, **kw: orig(*a, shm=False, **kw)
    via_gloo = P.ring_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos)
    R.ring_pass = orig
    assert torch.equal(via_shm, via_gloo)
    assert max_err(via_shm, reference(q, k, v, causal=True)[0][:, :, mine]) < 1e-5


def off_worker() -> None:
    import treeattn.parallel.prefill as P
    from treeattn.comm.shm import shm_exchange

    rank, p = dist.get_rank(), dist.get_world_size()
    assert shm_exchange(None) is None
    sizes = [5, 3]
    k = torch.full((1, 2, sizes[rank], 4), float(rank))
    seen = _visits(k, k + 10, sizes, None, True)  # asks for shm, falls back to gloo
    assert [s for s, _, _ in seen] == [rank, 1 - rank]
    assert all(torch.equal(kb, torch.full_like(kb, s)) and kb.shape[2] == sizes[s] for s, kb, _ in seen)
    L = 64
    pos = [torch.arange(j, L, p) for j in range(p)]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, L, 8, generator=g) for _ in range(3))
    out = P.ring_prefill(q[:, :, pos[rank]], k[:, :, pos[rank]], v[:, :, pos[rank]], pos)
    assert max_err(out, reference(q, k, v, causal=True)[0][:, :, pos[rank]]) < 1e-5


def failure_worker() -> None:
    """A segment growth that fails on one rank (a full /dev/shm) turns the group to gloo on
    every rank, with no hang and no segment left; TREEATTN_SHM=0 on one rank only: no shm."""
    from treeattn.comm import shm
    from treeattn.comm.shm import _GROUPS, _Shm

    rank = dist.get_rank()
    small = _visits(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), [2, 2], None, True)
    assert isinstance(_GROUPS[dist.group.WORLD], _Shm) and len(small) == 2
    if rank == 1:

        def full(*a):
            raise OSError(28, "No space left on device")

        shm.os.posix_fallocate = full
    sizes = [3000, 2999]  # 3000 x 2 x 32 floats: more than the first segment
    k = torch.full((1, 2, sizes[rank], 16), float(rank))
    seen = _visits(k, -k, sizes, None, True)
    assert [s for s, _, _ in seen] == [rank, 1 - rank]
    assert all(torch.equal(kb, torch.full_like(kb, s)) and torch.equal(vb, -kb) for s, kb, vb in seen)
    assert _GROUPS[dist.group.WORLD] is False
    assert shm.shm_exchange(None) is None
    sub = dist.new_group([0, 1])
    if rank == 1:
        os.environ["TREEATTN_SHM"] = "0"
    assert shm.shm_exchange(sub) is None


def _ours() -> set[str]:
    return set(glob.glob(f"/dev/shm/treeattn-{os.getuid()}-*"))


def test_shm_exchange_bitwise_as_gloo():
    before = _ours()
    launch(shm_worker, 3, timeout=180)
    assert _ours() == before, "segments left in /dev/shm"


def test_shm_growth_failure_on_one_rank_falls_back():
    before = _ours()
    launch(failure_worker, 2, timeout=120)
    assert _ours() == before, "segments left in /dev/shm"


def test_shm_disabled_falls_back_to_gloo():
    launch(off_worker, 2, timeout=120, env={"TREEATTN_SHM": "0"})
