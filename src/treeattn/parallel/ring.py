"""Ring Attention: every rank's K/V block travels around the ring by send/recv.

Each hop's transfer overlaps attention over the block received in the previous hop
(double buffering) and states merge online in float32. For decoding, p - 1 hops move
``(p-1)·S_local`` tokens of K/V per rank per step, so traffic grows with the context —
unlike :func:`treeattn.tree_decode`. The same ring pass serves causal prefill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import all_gather, sendrecv, world
from ..comm.shm import shm_exchange
from ..ops import attention_state
from ..ops.alibi import Alibi
from ..ops.state import merge_states, merge_states_n
from ._common import validate_decode
from .tree import new_token_state

_POOL: dict[tuple, list[Tensor]] = {}


def release_buffers() -> None:
    """Free the ring's persistent receive buffers (they are re-allocated on demand)."""
    _POOL.clear()


def _buffers(numel: int, like: Tensor) -> list[Tensor]:
    key = (like.device, like.dtype)
    bufs = _POOL.get(key)
    if bufs is None or bufs[0].numel() < numel:
        _POOL.pop(key, None)  # free the old pair before allocating the new one
        bufs = _POOL[key] = [like.new_empty(numel), like.new_empty(numel)]
    return bufs


def ring_pass(
    k: Tensor, v: Tensor, sizes: list[int], group, visit: Callable[[int, Tensor, Tensor], None], *, shm: bool = False
) -> None:
    """Call ``visit(src, k_src, v_src)`` for every rank's block (own first, then rank - 1,
    rank - 2, ...), moving the blocks one hop per step; ``sizes[j]`` is rank j's block length
    (dim 2).

    Each hop sends the block this rank holds as two messages (K and V, no packing copy) and
    receives the next into one of two persistent buffers (no allocation per step, like a
    preallocated ring); ``visit`` of the block held (the own block at the first hop) runs
    while the transfer is in flight. With ``shm`` and CPU blocks on ranks of one host, the
    blocks go through shared memory instead (:mod:`treeattn.comm.shm`: each rank publishes
    its block once, peers read it in place), same visits in the same order.
    """
    rank, p = world(group)
    if p == 1:
        visit(rank, k, v)
        return
    if shm and k.device.type == "cpu":
        ex = shm_exchange(group)
        if ex is not None and ex.fits(k, v, sizes):
            blocks = ex.exchange(k, v, sizes)
            visit(rank, k, v)  # while the peers publish theirs
            for src, kb, vb in blocks:
                visit(src, kb, vb)
            return
    B, H, _, D = k.shape
    Dv = v.shape[3]
    bufs = _buffers(max(1, max(sizes)) * B * H * (D + Dv), k)

    def block(buf: Tensor, s: int) -> tuple[Tensor, Tensor]:
        if s == 0:  # gloo needs non-empty messages: a one-element stand-in for each
            return buf[:1], buf[1:2]
        n = B * H * s
        return buf[: n * D].view(B, H, s, D), buf[n * D : n * (D + Dv)].view(B, H, s, Dv)

    def shaped(src: int, held: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return held if sizes[src] else (k[:, :, :0], v[:, :, :0])

    held = (k.contiguous(), v.contiguous()) if k.shape[2] else block(bufs[0].new_zeros(2), 0)
    held_src = rank
    for hop in range(1, p):
        src = (rank - hop) % p
        nxt = block(bufs[hop % 2], sizes[src])
        reqs = sendrecv(list(held), (rank + 1) % p, list(nxt), (rank - 1) % p, group)
        visit(held_src, *shaped(held_src, held))  # while the next block is in flight
        for r in reqs:
            r.wait()
        held, held_src = nxt, src
    visit(held_src, *shaped(held_src, held))


def _visible_slice(k: Tensor, v: Tensor, kv_lens: Tensor | None, kv_start: Tensor, alibi: Alibi | None):
    """This shard's slots some query can see (``[a, b)``) and the bounds relative to it, on
    the host: only those travel around the ring (with ``alibi``, its key positions sliced alike)."""
    B, S = k.shape[0], k.shape[2]
    lens = torch.full((B,), S, dtype=torch.int64) if kv_lens is None else kv_lens.cpu().to(torch.int64)
    st = kv_start.cpu().to(torch.int64).clamp(0, S)
    lo = st.view(B, -1).amin(1) if B else st.view(0)
    live = lo < lens
    a, b = (int(lo[live].min()), int(lens[live].max())) if bool(live.any()) else (0, 0)
    n = b - a
    alibi = None if alibi is None else alibi._replace(k_pos=alibi.k_pos[:, a:b])
    return k[:, :, a:b], v[:, :, a:b], (lens - a).clamp(0, n), (st - a).clamp(0, n), alibi


def _positions(alibi: Alibi, S: int, info: Tensor | None, group) -> list[Tensor]:
    """Every rank's key positions ``[B, S_j]`` (``info``: the gathered lengths; None: one rank)."""
    kp = alibi.k_pos[:, :S].to(torch.int64)
    if info is None:
        return [kp]
    sizes = info[:, 0].tolist()
    pad = kp.new_full((kp.shape[0], max(1, max(sizes)) - S), -1)
    allp = all_gather(torch.cat([kp, pad], 1), group)
    return [allp[j, :, : sizes[j]] for j in range(len(sizes))]


def ring_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    kv_lens: Tensor | None = None,
    new_k: Tensor | None = None,
    new_v: Tensor | None = None,
    new_mask: Tensor | None = None,
    return_lse: bool = False,
    check: bool = True,
    backend: str = "auto",
    kv_start: Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    alibi: Alibi | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Same contract as :func:`treeattn.tree_decode` (minus ``strategy``/``topology``), computed
    by Ring Attention. With ``alibi`` every shard's key positions are all-gathered once per call
    (integers, ``1 / (2 Hkv D)`` of the K/V that travel). Before the ring, one small all-gather shares every shard's length
    and ``kv_lens`` (a host sync: receive buffers are sized from it). The p partial states
    are merged in rank order, so the result is bitwise identical on every rank. With
    ``kv_start`` (a sliding window) only the slots some query can see travel the ring."""
    if check:
        validate_decode(q, k, v, kv_lens, new_k, new_v, new_mask, scale, "ring", group, ("ring",), 0, kv_start,
                        softcap, window, alibi=alibi)  # fmt: skip
    _, p = world(group)
    B = k.shape[0]
    if kv_start is not None and p > 1:
        k, v, lens, starts, alibi = _visible_slice(k, v, kv_lens, kv_start, alibi)
        starts = starts.reshape(B, -1)
    else:
        lens = kv_lens if kv_lens is not None else torch.full((B,), k.shape[2], device=q.device)
        starts = None
    S = k.shape[2]
    info = None
    if p > 1:
        parts = [lens.new_tensor([S]), lens] + ([starts.flatten()] if starts is not None else [])
        info = all_gather(torch.cat([x.to(torch.int64) for x in parts]).to(q.device), group).cpu()
    kpos = _positions(alibi, k.shape[2], info, group) if alibi is not None else None
    states: dict[int, tuple[Tensor, Tensor]] = {}

    def visit(src: int, kb: Tensor, vb: Tensor) -> None:
        if info is None:
            lb, sb = kv_lens, kv_start
        else:
            lb = info[src, 1 : 1 + B]
            sb = None
            if starts is not None:
                sb = info[src, 1 + B :].view(B, -1)
                sb = (sb[:, 0] if kv_start.ndim == 1 else sb).to(q.device)  # attention_state skips an unseen block
            lb = None if bool((lb == kb.shape[2]).all()) else lb.to(q.device)  # info is on the host
        bias = None if alibi is None else alibi._replace(k_pos=kpos[src][:, : kb.shape[2]])
        states[src] = attention_state(q, kb, vb, scale=scale, kv_lens=lb, kv_start=sb, softcap=softcap, backend=backend,
                                 keep_fp32=True, alibi=bias)  # fmt: skip

    ring_pass(k, v, info[:, 0].tolist() if info is not None else [S], group, visit)
    # merge in rank order, not arrival order: the result is bitwise identical on every rank
    out, lse = merge_states_n(
        torch.stack([states[r][0] for r in sorted(states)]), torch.stack([states[r][1] for r in sorted(states)])
    )
    if new_k is not None:
        out, lse = merge_states(
            out, lse, *new_token_state(q, new_k, new_v, new_mask, scale, softcap=softcap, window=window, alibi=alibi)
        )
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
