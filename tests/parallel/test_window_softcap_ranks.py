"""Sliding window (on global positions) and softcap across ranks: tree/ring decode over a
ShardedKVCache and ring/tree prefill, against float64 attention on the full K/V. One
spawned group per world size runs every case."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from reference import max_err
from treeattn.launch import launch

D = 16


def dense(q, k, v, vis, softcap, scale=None):
    """Attention of q [B, Hq, Tq, D] over k/v [B, Hkv, S, D] with a bool mask vis [B, Tq, S],
    in the inputs' dtype (float64: the reference). Rows with nothing visible: (0, -inf)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~vis[:, None], float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, lse


def close(out, lse, args, what):
    q, k, v, vis, cap = args
    ro, rl = dense(q.double(), k.double(), v.double(), vis, cap)
    po, pl = dense(q, k, v, vis, cap)
    e, ep = max_err(out, ro), max_err(po, ro)
    assert e <= 2 * ep + 1e-6, f"{what}: out error {e:.3g} > 2 x plain torch {ep:.3g}"
    e, ep = max_err(lse, rl), max_err(pl, rl)
    assert e <= 2 * ep + 1e-5, f"{what}: lse error {e:.3g} > 2 x plain torch {ep:.3g}"


def kernel_calls(run) -> int:
    """How many local attention kernels (torch, flash_cpu or decode_cpu path) ``run()`` started."""
    import treeattn.ops._decode_cpu as C
    import treeattn.ops.dispatch as A

    calls, real = [], (A._chunked, A._flash_cpu, C.decode_cpu)

    def counted(fn):
        return lambda *a, **kw: calls.append(1) or fn(*a, **kw)

    A._chunked, A._flash_cpu, C.decode_cpu = (counted(f) for f in real)
    try:
        run()
    finally:
        A._chunked, A._flash_cpu, C.decode_cpu = real
    return len(calls)


def same_everywhere(t: torch.Tensor) -> bool:
    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t.contiguous())
    return all(torch.equal(b, t) for b in bufs)


DECODE = [  # (window, softcap, dtype, (Hq, Hkv), Tq)
    (3, None, torch.float32, (4, 2), 1),
    (8, 2.0, torch.float32, (4, 1), 1),
    (1, 5.0, torch.bfloat16, (4, 4), 1),
    (20, None, torch.float16, (6, 2), 3),
    (5, 3.0, torch.float32, (4, 2), 3),
    (2, None, torch.float32, (4, 2), 5),  # windows shorter than the new tokens: they cut into them
    (3, 4.0, torch.bfloat16, (6, 3), 6),
    (1000, 2.0, torch.float32, (4, 2), 1),  # the window covers everything
]


def decode_worker() -> None:
    from treeattn import ring_decode, tree_decode
    from treeattn.cache import ShardedKVCache

    rank, p = dist.get_rank(), dist.get_world_size()
    lens = torch.tensor([37, 23])
    B, Lmax = 2, 37
    n = 0
    for placement, block in (("contiguous", 1), ("interleaved", 1), ("interleaved", 3)):
        for W, cap, dtype, (Hq, Hkv), Tq in DECODE:
            n += 1
            g = torch.Generator().manual_seed(n)
            q = torch.randn(B, Hq, Tq, D, generator=g).to(dtype) * 2
            K = torch.randn(B, Hkv, Lmax, D, generator=g).to(dtype)
            V = torch.randn(B, Hkv, Lmax, D, generator=g).to(dtype)
            cache = ShardedKVCache(1, B, Hkv, D, dtype=dtype, placement=placement, block=block)
            mine = cache.begin_prefill(lens, Lmax)
            cache.store_prefill(0, K[:, :, mine], V[:, :, mine])
            k, v, kv_lens = cache.local(0)
            kw = dict(kv_lens=kv_lens, softcap=cap, return_lse=True)
            if Tq == 1:  # the query's own token is the last one in the cache (as generate)
                qpos = (lens - 1)[:, None]
                kw["kv_start"] = cache.window_start(W, lens - 1)
                Kg, Vg = K, V
            else:  # Tq new tokens after the cache, in no shard
                qpos = lens[:, None] + torch.arange(Tq)
                kw["kv_start"] = torch.stack([cache.slots_before(lens + i - W + 1) for i in range(Tq)], 1)
                nk = torch.randn(B, Hkv, Tq, D, generator=g).to(dtype)
                nv = torch.randn(B, Hkv, Tq, D, generator=g).to(dtype)
                kw.update(new_k=nk, new_v=nv, window=W)
                # new token j of sequence b sits at position lens[b] + j: put it there
                Kg = torch.cat([K, torch.zeros(B, Hkv, Tq, D, dtype=dtype)], 2)
                Vg = torch.cat([V, torch.zeros(B, Hkv, Tq, D, dtype=dtype)], 2)
                for b in range(B):
                    Kg[b, :, int(lens[b]) : int(lens[b]) + Tq] = nk[b]
                    Vg[b, :, int(lens[b]) : int(lens[b]) + Tq] = nv[b]
            kpos = torch.arange(Kg.shape[2])
            valid = kpos[None, :] < (lens[:, None] + (0 if Tq == 1 else Tq))
            vis = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] > qpos[:, :, None] - W)
            vis &= valid[:, None, :]
            args = (q, Kg, Vg, vis, cap)
            for fn, strategy in ((tree_decode, "allreduce3"), (tree_decode, "allgather"), (ring_decode, None)):
                what = f"rank {rank}/{p} {placement}/{block} W={W} cap={cap} {dtype} Tq={Tq} {fn.__name__} {strategy}"
                extra = {"strategy": strategy} if strategy else {}
                out, lse = fn(q, k, v, **kw, **extra)
                close(out, lse, args, what)
                assert same_everywhere(torch.cat([out.float().flatten(), lse.flatten()])), what
            # a rank whose keys all lie outside the window runs no kernel (Tq = 1: no new tokens)
            if Tq == 1 and placement == "contiguous" and W <= 8:
                calls = kernel_calls(lambda: tree_decode(q, k, v, **kw))  # noqa: B023
                start = kw["kv_start"].cpu()
                outside = bool((start >= kv_lens.cpu()).all())
                if W == 3 and rank == 0:  # both windows (positions >= 20) lie past rank 0's chunk
                    assert outside, f"{what}: start {start.tolist()} lens {kv_lens.tolist()}"
                assert calls == (0 if outside else 1), f"{what}: {calls} kernel calls"
    # ranks that disagree on softcap or on kv_start's presence: the same error everywhere
    q = torch.randn(1, 4, 1, D)
    k = v = torch.randn(1, 2, 5, D)
    with pytest.raises(ValueError, match="ranks disagree on softcap"):
        tree_decode(q, k, v, softcap=1.0 + rank)
    with pytest.raises(ValueError, match="ranks disagree on kv_start"):
        ring_decode(q, k, v, kv_start=torch.tensor([1]) if rank else None)
    with pytest.raises(ValueError, match="kv_start must lie in"):
        tree_decode(q, k, v, kv_start=torch.tensor([6 if rank == 0 else 0]))
    with pytest.raises(ValueError, match="window must be an int"):
        tree_decode(q, k, v, window=0)


PREFILL = [  # (placement, block, L, window, softcap, dtype, (Hq, Hkv))
    ("interleaved", 1, 45, 7, 3.0, torch.float32, (4, 2)),
    ("contiguous", 1, 45, 16, None, torch.float32, (4, 1)),
    ("interleaved", 4, 38, 1, 2.0, torch.bfloat16, (4, 4)),
    ("contiguous", 1, 40, 10, 5.0, torch.float16, (6, 2)),
    ("contiguous", 1, 2, 3, 1.0, torch.float32, (4, 2)),  # fewer tokens than ranks
]


def prefill_worker() -> None:
    from treeattn.cache import Placement
    from treeattn.parallel import ring_prefill, tree_prefill

    rank, p = dist.get_rank(), dist.get_world_size()
    for i, (kind, block, L, W, cap, dtype, (Hq, Hkv)) in enumerate(PREFILL):
        g = torch.Generator().manual_seed(100 + i)
        B = 2
        q = torch.randn(B, Hq, L, D, generator=g).to(dtype) * 2
        k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
        v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
        pos = [Placement(kind, p, block).prompt_positions(r, L) for r in range(p)]
        mine = pos[rank]
        j = torch.arange(L)
        vis = ((j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - W)).expand(B, L, L)
        ref_args = (q[:, :, mine], k, v, vis[:, mine], cap)
        what = f"rank {rank}/{p} {kind}/{block} L={L} W={W} cap={cap} {dtype}"
        kw = dict(window=W, softcap=cap, return_lse=True)
        out, lse = ring_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos, **kw)
        close(out, lse, ref_args, f"{what} ring")
        out, lse = tree_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos, mine, **kw)
        close(out, lse, ref_args, f"{what} tree")
        assert out.is_contiguous() and lse.is_contiguous(), what  # not views into the exchange buffer
        # a chunk of a chunked prefill: queries at positions [lo, hi), keys [0, hi) stored
        lo, hi = L // 2, L // 2 + 9
        qp = [x[(x >= lo) & (x < hi)] for x in pos]
        kp = [x[x < hi] for x in pos]
        cq = qp[rank]
        ref_args = (q[:, :, cq], k, v, vis[:, cq], cap)
        ks, vs = k[:, :, kp[rank]], v[:, :, kp[rank]]
        out, lse = ring_prefill(q[:, :, cq], ks, vs, kp, q_positions=cq, **kw)
        close(out, lse, ref_args, f"{what} ring chunk")
        out, lse = tree_prefill(q[:, :, cq], ks, vs, qp, kp[rank], **kw)
        close(out, lse, ref_args, f"{what} tree chunk")


def kernel_prefill_worker() -> None:
    """Ring and Tree prefill whose blocks the float32 prefill kernel takes (D = 64, its
    threshold off): both placements, with and without a window, whole and as a later chunk."""
    import treeattn.ops._prefill_cpu as PC
    import treeattn.ops.causal as CA
    from treeattn.cache import Placement
    from treeattn.ops._decode_cpu import kernel_features
    from treeattn.parallel import ring_prefill, tree_prefill

    PC._MIN_WORK, PC._MIN_FILL = 0, 0
    taken, real = [], CA.prefill_states

    def spy(*a):
        st = real(*a)
        taken.append(st is not None)
        return st

    CA.prefill_states = spy
    rank, p = dist.get_rank(), dist.get_world_size()
    L, Hq, Hkv, Dk = 150, 9, 3, 64
    for i, (kind, block, W) in enumerate([("contiguous", 1, None), ("interleaved", 4, None), ("contiguous", 1, 33)]):
        g = torch.Generator().manual_seed(200 + i)
        q = torch.randn(1, Hq, L, Dk, generator=g) * 2
        k, v = torch.randn(1, Hkv, L, Dk, generator=g), torch.randn(1, Hkv, L, Dk, generator=g)
        pos = [Placement(kind, p, block).prompt_positions(r, L) for r in range(p)]
        mine = pos[rank]
        j = torch.arange(L)
        vis = j[None, :] <= j[:, None]
        if W is not None:
            vis &= j[None, :] > j[:, None] - W
        vis = vis[None]
        what = f"rank {rank}/{p} {kind}/{block} W={W} kernel"
        kw = dict(window=W, return_lse=True)
        out, lse = ring_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos, **kw)
        close(out, lse, (q[:, :, mine], k, v, vis[:, mine], None), f"{what} ring")
        out, lse = tree_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos, mine, **kw)
        close(out, lse, (q[:, :, mine], k, v, vis[:, mine], None), f"{what} tree")
        qp = [x[(x >= 100) & (x < 140)] for x in pos]  # a later chunk: queries [100, 140)
        kp = [x[x < 140] for x in pos]
        cq = qp[rank]
        ks, vs = k[:, :, kp[rank]], v[:, :, kp[rank]]
        out, lse = ring_prefill(q[:, :, cq], ks, vs, kp, q_positions=cq, **kw)
        close(out, lse, (q[:, :, cq], k, v, vis[:, cq], None), f"{what} ring chunk")
        out, lse = tree_prefill(q[:, :, cq], ks, vs, qp, kp[rank], **kw)
        close(out, lse, (q[:, :, cq], k, v, vis[:, cq], None), f"{what} tree chunk")
    CA.prefill_states = real
    assert taken and all(taken) == ("prefill512" in kernel_features()), taken  # every block


def both() -> None:
    decode_worker()
    prefill_worker()
    kernel_prefill_worker()


@pytest.mark.parametrize("p", [2, 3])
def test_window_softcap_across_ranks(p):
    launch(both, p, timeout=300)
