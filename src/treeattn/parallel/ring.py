"""Ring Attention decoding: the baseline the seed paper compares against.

Every rank's K/V shard travels around the ring by point-to-point send/recv; each hop's
transfer overlaps attention over the shard received in the previous hop (double
buffering); states merge online in float32. p - 1 hops move ``(p-1)·S_local`` tokens of K/V
per rank per step, so traffic grows with the context — unlike :func:`tree_decode`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import all_gather, sendrecv, world
from ..ops.attention import _attention
from ..ops.state import merge_states
from ._common import validate_decode
from .tree import new_token_state


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
) -> Tensor | tuple[Tensor, Tensor]:
    """Same contract as :func:`treeattn.tree_decode` (minus ``strategy``/``topology``), computed
    by Ring Attention. Before the ring, one small all-gather shares every shard's length
    and ``kv_lens`` (a host sync: receive buffers are sized from it)."""
    if check:
        validate_decode(q, k, v, kv_lens, new_k, new_v, new_mask, scale, "ring", group, ("ring",))
    rank, p = world(group)
    out, lse = _attention(q, k, v, scale=scale, kv_lens=kv_lens, backend=backend, keep_fp32=True)
    if p > 1:
        out, lse = _ring(q, k, v, kv_lens, scale, backend, out, lse, rank, p, group)
    if new_k is not None:
        out, lse = merge_states(out, lse, *new_token_state(q, new_k, new_v, new_mask, scale))
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _ring(q, k, v, kv_lens, scale, backend, out, lse, rank, p, group):
    B, Hkv, S, D = k.shape
    Dv = v.shape[3]
    lens = kv_lens if kv_lens is not None else torch.full((B,), S, device=q.device)
    info = all_gather(torch.cat([lens.new_tensor([S]), lens]).to(torch.int64), group).cpu()
    sizes = info[:, 0].tolist()
    nk, nv = B * Hkv * D, B * Hkv * Dv  # elements per token
    shape = (B, Hkv, D, Dv)
    cur = torch.cat([k.reshape(-1), v.reshape(-1)]) if S else k.new_empty(1)  # one packed message
    for hop in range(1, p):
        src = (rank - hop) % p
        nxt = k.new_empty(max(1, sizes[src] * (nk + nv)))
        reqs = sendrecv(cur, (rank + 1) % p, nxt, (rank - 1) % p, group)
        if hop > 1:  # attend to the shard received last hop while this one is in flight
            prev = (src + 1) % p
            out, lse = _merge_shard(q, cur, sizes[prev], info[prev, 1:], shape, out, lse, scale, backend)
        for r in reqs:
            r.wait()
        cur = nxt
    last = (rank + 1) % p
    return _merge_shard(q, cur, sizes[last], info[last, 1:], shape, out, lse, scale, backend)


def _merge_shard(q, buf, s, lens, shape, out, lse, scale, backend):
    """Attend to the shard packed in ``buf`` (``s`` tokens) and merge it into (out, lse)."""
    if s == 0:
        return out, lse
    B, Hkv, D, Dv = shape
    n = B * Hkv * s
    kk = buf[: n * D].view(B, Hkv, s, D)
    vv = buf[n * D : n * (D + Dv)].view(B, Hkv, s, Dv)
    lens = None if bool((lens == s).all()) else lens.to(q.device)  # lens is on the host
    o, l = _attention(q, kk, vv, scale=scale, kv_lens=lens, backend=backend, keep_fp32=True)
    return merge_states(out, lse, o, l)
