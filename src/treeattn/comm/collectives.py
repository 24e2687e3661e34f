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


def sendrecv(send: list[Tensor], dst: int, recv: list[Tensor], src: int, group: dist.ProcessGroup | None) -> list:
    """Post sends of ``send`` to ``dst`` and receives into ``recv`` from ``src`` (group ranks)
    together; returns the requests to wait on. Message i carries tag i, so the i-th send
    always lands in the i-th receive (backends may match same-tag messages out of order)."""
    g = group if group is not None else dist.group.WORLD
    gd, gs = dist.get_global_rank(g, dst), dist.get_global_rank(g, src)
    ops = []
    for i, t in enumerate(send):
        meter.record("send", t.numel() * t.element_size(), 0)
        ops.append(dist.P2POp(dist.isend, t, gd, group, tag=i))
    for i, t in enumerate(recv):
        meter.record("recv", 0, t.numel() * t.element_size())
        ops.append(dist.P2POp(dist.irecv, t, gs, group, tag=i))
    return dist.batch_isend_irecv(ops)
