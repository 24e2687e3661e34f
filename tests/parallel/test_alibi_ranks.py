"""ALiBi biases (treeattn.ops.Alibi) across ranks: tree/ring decode over a ShardedKVCache (one
query, and new tokens under a causal or tree mask, with a sliding window), ring/tree prefill
(whole and as a chunk), against float64 attention on the full K/V with the bias from global
positions; slopes that differ between ranks refused on every rank. One spawned group per world
size runs every case. Single-device checks (the slopes, bad shapes) run in-process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from reference import max_err
from treeattn.launch import launch
from treeattn.ops import Alibi, alibi_slopes, attention_with_lse

D = 16


def dense(q, k, v, vis, slopes, qpos, kpos, scale=None):
    """q [B, Hq, Tq, D] over k/v [B, Hkv, S, D], bool vis [B, Tq, S], bias slopes[h] * (kpos -
    qpos) (qpos [B, Tq], kpos [B, S]), in the inputs' dtype (float64: the reference)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = s + slopes.to(s.dtype).view(1, -1, 1, 1) * (kpos[:, None, None, :] - qpos[:, None, :, None]).to(s.dtype)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, lse


def close(out, lse, args, what):
    q, k, v, vis, slopes, qpos, kpos = args
    ro, rl = dense(q.double(), k.double(), v.double(), vis, slopes, qpos, kpos)
    po, pl = dense(q, k, v, vis, slopes, qpos, kpos)
    e, ep = max_err(out, ro), max_err(po, ro)
    assert e <= 2 * ep + 1e-6, f"{what}: out error {e:.3g} > 2 x plain torch {ep:.3g}"
    e, ep = max_err(lse, rl), max_err(pl, rl)
    assert e <= 2 * ep + 1e-5, f"{what}: lse error {e:.3g} > 2 x plain torch {ep:.3g}"
    if q.shape[2]:  # the bias matters here: without it the answer is another one
        zo, _ = dense(q.double(), k.double(), v.double(), vis, slopes * 0, qpos, kpos)
        assert max_err(zo, ro) > 20 * (ep + 1e-6), f"{what}: the bias changes nothing in this case"


DECODE = [  # (window, dtype, (Hq, Hkv), Tq, tree)
    (None, torch.float32, (6, 2), 1, False),
    (8, torch.float32, (4, 1), 1, False),
    (None, torch.bfloat16, (4, 4), 3, False),
    (5, torch.float32, (6, 3), 4, False),
    (None, torch.float32, (4, 2), 4, True),  # a token tree: 0 -> 1, 0 -> 2 -> 3
]


def decode_worker() -> None:
    from treeattn import ring_decode, tree_decode
    from treeattn.cache import ShardedKVCache

    rank, p = dist.get_rank(), dist.get_world_size()
    lens = torch.tensor([37, 23])
    B, Lmax = 2, 37
    for n, (placement, (W, dtype, (Hq, Hkv), Tq, tree)) in enumerate(
        [(pl, c) for pl in ("contiguous", "interleaved") for c in DECODE]
    ):
        g = torch.Generator().manual_seed(n)
        q = torch.randn(B, Hq, Tq, D, generator=g).to(dtype)
        K = torch.randn(B, Hkv, Lmax, D, generator=g).to(dtype)
        V = torch.randn(B, Hkv, Lmax, D, generator=g).to(dtype)
        slopes = alibi_slopes(Hq) * 4  # steep: the bias decides which keys weigh
        cache = ShardedKVCache(1, B, Hkv, D, dtype=dtype, placement=placement)
        mine = cache.begin_prefill(lens, Lmax)
        cache.store_prefill(0, K[:, :, mine], V[:, :, mine])
        k, v, kv_lens = cache.local(0)
        kp_here = cache.positions[:, : k.shape[2]]
        kw = dict(kv_lens=kv_lens, return_lse=True)
        parents = [-1, 0, 0, 2][:Tq] if tree else list(range(-1, Tq - 1))
        depth = torch.zeros(Tq, dtype=torch.int64)
        sees = torch.eye(Tq, dtype=torch.bool)
        for i, a in enumerate(parents):
            if a >= 0:
                depth[i], sees[i] = depth[a] + 1, sees[i] | sees[a]
        if Tq == 1:  # the query's own token is the last one in the cache (as generate)
            qpos = (lens - 1)[:, None]
            Kg, Vg, kpos = K, V, torch.arange(Lmax).expand(B, -1)
            vis = kpos[:, None, :] <= qpos[:, :, None]
            kw["alibi"] = Alibi(slopes, lens - 1, kp_here)
        else:  # Tq new tokens after the cache, in no shard, at positions lens + depth
            qpos = lens[:, None] + depth[None, :]
            nk = torch.randn(B, Hkv, Tq, D, generator=g).to(dtype)
            nv = torch.randn(B, Hkv, Tq, D, generator=g).to(dtype)
            kw.update(new_k=nk, new_v=nv, alibi=Alibi(slopes, qpos, kp_here))
            if tree:
                kw["new_mask"] = sees
            Kg, Vg = torch.cat([K, nk], 2), torch.cat([V, nv], 2)
            kpos = torch.cat([torch.arange(Lmax).expand(B, -1), qpos], 1)
            old = torch.arange(Lmax)[None, None, :] < lens[:, None, None]
            vis = torch.cat([old.expand(B, Tq, Lmax) & (kpos[:, None, :Lmax] <= qpos[:, :, None]),
                             sees.expand(B, Tq, Tq)], 2)  # fmt: skip
        if W is not None:
            vis &= kpos[:, None, :] > qpos[:, :, None] - W
            kw["kv_start"] = torch.stack([cache.slots_before(qpos[:, i] - W + 1) for i in range(Tq)], 1)
            if Tq > 1 and not tree:
                kw["window"] = W
            if Tq == 1:
                kw["kv_start"] = kw["kv_start"][:, 0]
        args = (q, Kg, Vg, vis, slopes, qpos, kpos)
        for fn, extra in ((tree_decode, {"strategy": "allreduce3"}), (tree_decode, {"strategy": "allgather"}),
                          (ring_decode, {})):  # fmt: skip
            what = f"rank {rank}/{p} {placement} W={W} {dtype} Hq={Hq} Tq={Tq} tree={tree} {fn.__name__} {extra}"
            out, lse = fn(q, k, v, **kw, **extra)
            close(out, lse, args, what)
    # slopes that differ between ranks: the same error everywhere
    q, k = torch.randn(1, 4, 1, D), torch.randn(1, 2, 5, D)
    bad = Alibi(alibi_slopes(4) * (1 + rank), torch.tensor([9]), torch.arange(5)[None])
    with pytest.raises(ValueError, match="ranks disagree on alibi slopes"):
        tree_decode(q, k, k, alibi=bad)
    with pytest.raises(ValueError, match="ranks disagree on alibi slopes"):
        ring_decode(q, k, k, alibi=bad)
    with pytest.raises(ValueError, match="alibi.k_pos"):
        tree_decode(q, k, k, alibi=Alibi(alibi_slopes(4), torch.tensor([9]), torch.arange(5 - rank)[None]))


PREFILL = [  # (placement, block, L, window, dtype, (Hq, Hkv))
    ("interleaved", 1, 45, None, torch.float32, (6, 2)),
    ("contiguous", 1, 45, 16, torch.float32, (4, 1)),
    ("interleaved", 4, 38, None, torch.bfloat16, (4, 4)),
]


def prefill_worker() -> None:
    from treeattn.cache import Placement
    from treeattn.parallel import ring_prefill, tree_prefill

    rank, p = dist.get_rank(), dist.get_world_size()
    for i, (kind, block, L, W, dtype, (Hq, Hkv)) in enumerate(PREFILL):
        g = torch.Generator().manual_seed(100 + i)
        B = 2
        q = torch.randn(B, Hq, L, D, generator=g).to(dtype)
        k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
        v = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
        slopes = alibi_slopes(Hq) * 4
        pos = [Placement(kind, p, block).prompt_positions(r, L) for r in range(p)]
        mine = pos[rank]
        j = torch.arange(L)
        vis = j[None, :] <= j[:, None]
        if W is not None:
            vis = vis & (j[None, :] > j[:, None] - W)
        vis = vis.expand(B, L, L)
        jj = j.expand(B, -1)
        what = f"rank {rank}/{p} {kind}/{block} L={L} W={W} {dtype} Hq={Hq}"
        kw = dict(window=W, return_lse=True, alibi=slopes)
        ref = (q[:, :, mine], k, v, vis[:, mine], slopes, jj[:, mine], jj)
        close(*ring_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos, **kw), ref, f"{what} ring")
        close(*tree_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos, mine, **kw), ref, f"{what} tree")
        lo, hi = L // 2, L // 2 + 9  # a chunk: queries at [lo, hi), keys [0, hi) stored
        qp, kp = [x[(x >= lo) & (x < hi)] for x in pos], [x[x < hi] for x in pos]
        cq = qp[rank]
        ref = (q[:, :, cq], k, v, vis[:, cq], slopes, jj[:, cq], jj)
        ks, vs = k[:, :, kp[rank]], v[:, :, kp[rank]]
        close(*ring_prefill(q[:, :, cq], ks, vs, kp, q_positions=cq, **kw), ref, f"{what} ring chunk")
        close(*tree_prefill(q[:, :, cq], ks, vs, qp, kp[rank], **kw), ref, f"{what} tree chunk")


def both() -> None:
    decode_worker()
    prefill_worker()


@pytest.mark.parametrize("p", [2, 3])
def test_alibi_across_ranks_matches_float64(p):
    launch(both, p, timeout=600)


def test_alibi_slopes_are_blooms():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for n in (1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 40):
        assert torch.equal(alibi_slopes(n), _get_alibi_slopes(n, "cpu")), n
    with pytest.raises(ValueError, match="n_heads must be"):
        alibi_slopes(0)


def test_alibi_single_device_and_bad_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, 3, D, generator=g), torch.randn(2, 2, 20, D, generator=g), torch.randn(2, 2, 20, D)
    slopes, kpos = alibi_slopes(6) * 4, torch.arange(20).expand(2, -1)
    qpos = torch.tensor([[17, 18, 19], [7, 8, 9]])
    lens = torch.tensor([20, 10])
    out, lse = attention_with_lse(q, k, v, kv_lens=lens, causal=True, alibi=Alibi(slopes, qpos, kpos))
    vis = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] < lens[:, None, None])
    close(out, lse, (q, k, v, vis, slopes, qpos, kpos), "one device")
    for bad, field in ((Alibi(slopes[:4], qpos, kpos), "alibi.slopes"), (Alibi(slopes, qpos.float(), kpos), "alibi.q_pos"),
                       (Alibi(slopes, qpos, kpos[:, :5]), "alibi.k_pos"), ((slopes, qpos, kpos), "treeattn.ops.Alibi")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            attention_with_lse(q, k, v, alibi=bad)
