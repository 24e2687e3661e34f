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
from ..ops.attention import _attention
from ..ops.state import merge_states, merge_states_n
from ._common import validate_decode
from .tree import new_token_state


def ring_pass(k: Tensor, v: Tensor, sizes: list[int], group, visit: Callable[[int, Tensor, Tensor], None]) -> None:
    """Call ``visit(src, k_src, v_src)`` for every rank's block (own first), moving blocks
    one hop per step as one packed message; ``sizes[j]`` is rank j's block length (dim 2).
    The transfer of hop h overlaps ``visit`` of the block received at hop h - 1."""
    rank, p = world(group)
    visit(rank, k, v)
    if p == 1:
        return
    B, H, S, D = k.shape
    Dv = v.shape[3]

    def unpack(buf: Tensor, s: int) -> tuple[Tensor, Tensor]:
        n = B * H * s
        return buf[: n * D].view(B, H, s, D), buf[n * D : n * (D + Dv)].view(B, H, s, Dv)

    cur = torch.cat([k.reshape(-1), v.reshape(-1)]) if S else k.new_empty(1)
    for hop in range(1, p):
        src = (rank - hop) % p
        nxt = k.new_empty(max(1, B * H * sizes[src] * (D + Dv)))
        reqs = sendrecv(cur, (rank + 1) % p, nxt, (rank - 1) % p, group)
        if hop > 1:
            prev = (src + 1) % p
            visit(prev, *unpack(cur, sizes[prev]))
        for r in reqs:
            r.wait()
        cur = nxt
    last = (rank + 1) % p
    visit(last, *unpack(cur, sizes[last]))


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
    and ``kv_lens`` (a host sync: receive buffers are sized from it). The p partial states
    are merged in rank order, so the result is bitwise identical on every rank."""
    if check:
        validate_decode(q, k, v, kv_lens, new_k, new_v, new_mask, scale, "ring", group, ("ring",))
    _, p = world(group)
    B, S = k.shape[0], k.shape[2]
    lens = kv_lens if kv_lens is not None else torch.full((B,), S, device=q.device)
    info = all_gather(torch.cat([lens.new_tensor([S]), lens]).to(torch.int64), group).cpu() if p > 1 else None
    states: dict[int, tuple[Tensor, Tensor]] = {}

    def visit(src: int, kb: Tensor, vb: Tensor) -> None:
        if info is None:
            lb = kv_lens
        else:
            lb = info[src, 1:]
            lb = None if bool((lb == kb.shape[2]).all()) else lb.to(q.device)  # info is on the host
        states[src] = _attention(q, kb, vb, scale=scale, kv_lens=lb, backend=backend, keep_fp32=True)

    ring_pass(k, v, info[:, 0].tolist() if info is not None else [S], group, visit)
    # merge in rank order, not arrival order: the result is bitwise identical on every rank
    out, lse = merge_states_n(
        torch.stack([states[r][0] for r in sorted(states)]), torch.stack([states[r][1] for r in sorted(states)])
    )
    if new_k is not None:
        out, lse = merge_states(out, lse, *new_token_state(q, new_k, new_v, new_mask, scale))
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
