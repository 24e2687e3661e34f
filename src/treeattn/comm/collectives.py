"""Thin metered wrappers over torch.distributed (tensors only, nothing is pickled)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import meter

# torch >= 2.12 renames all_gather_into_tensor (and warns on the old name)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    _, p = world(group)
    if p > 1:
        n = t.numel() * t.element_size()
        meter.record("all_reduce", 2 * (p - 1) / p * n, 2 * (p - 1) / p * n)
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Gather ``t`` from every rank into a new tensor ``[p, *t.shape]`` in rank order."""
    _, p = world(group)
    if p == 1:
        return t.unsqueeze(0)
    out = torch.empty(p * t.numel(), dtype=t.dtype, device=t.device)
    n = t.numel() * t.element_size()
    meter.record("all_gather", (p - 1) * n, (p - 1) * n)
    _all_gather_flat(out, t.reshape(-1).contiguous(), group=group)
    return out.view(p, *t.shape)


def sendrecv(send: Tensor, dst: int, recv: Tensor, src: int, group: dist.ProcessGroup | None) -> list:
    """Post one send and one receive (group ranks) together; returns the requests."""
    g = group if group is not None else dist.group.WORLD
    meter.record("send", send.numel() * send.element_size(), 0)
    meter.record("recv", 0, recv.numel() * recv.element_size())
    ops = [
        dist.P2POp(dist.isend, send, dist.get_global_rank(g, dst), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(g, src), group),
    ]
    return dist.batch_isend_irecv(ops)
