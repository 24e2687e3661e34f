"""Attention states reduced *scattered over heads* (Helix's all-to-all): each rank of the group
ends with the fully merged states of its own heads only, not of every head. Each rank sends
rank ``j`` its partial states of ``j``'s heads (one all-to-all, ``(p - 1) / p`` of the states
a rank holds, independent of the context length), then merges the ``p`` partials it received
in rank order (bitwise the same as the all-gather strategy's merge of those heads).

Between the CPU ranks of one host the states are tiny and go through ``/dev/shm`` as one
all-gather (each rank reads its heads of every peer's states); elsewhere through the process
group's ``all_to_all_single``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops.packed import merge_packed
from . import meter
from .collectives import all_gather, all_to_all, world
from .shm_small import small_group


def reduce_scatter_heads(out: Tensor, lse: Tensor, cuts: list[int], group) -> tuple[Tensor, Tensor]:
    """``out [B, H, T, Dv]``, ``lse [B, H, T]``: this rank's partial states of all ``H`` heads;
    ``cuts``: ``p + 1`` head cut points (rank ``j`` gets heads ``[cuts[j], cuts[j + 1])``).
    Returns this rank's heads' merged ``(out [B, h, T, Dv], lse [B, h, T])``, float32 (float64
    for float64 states); collective over ``group``."""
    rank, p = world(group)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    buf = torch.cat([out.to(acc), lse.to(acc).unsqueeze(-1)], -1)  # [B, H, T, Dv + 1]
    lo, hi = cuts[rank], cuts[rank + 1]
    if p == 1:
        return merge_packed(buf[None])
    n = buf.numel() * buf.element_size()
    with meter.label("scatter"):
        if small_group(group, buf, n, "all_to_all") is not None:  # one host: every rank's states, its heads merged
            got = all_gather(buf.contiguous(), group)  # [p, B, H, T, Dv + 1]
            return merge_packed(got[:, :, lo:hi].contiguous())
        m = max(cuts[j + 1] - cuts[j] for j in range(p))
        send = buf.new_zeros(p, buf.shape[0], m, *buf.shape[2:])
        for j in range(p):
            send[j, :, : cuts[j + 1] - cuts[j]] = buf[:, cuts[j] : cuts[j + 1]]
        got = all_to_all(send, group)  # [p, B, m, T, Dv + 1]: every rank's partials of this rank's heads
    return merge_packed(got[:, :, : hi - lo].contiguous())
