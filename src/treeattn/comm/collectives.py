"""Thin metered wrappers over torch.distributed (tensors only, nothing is pickled): the
collectives every treeattn module calls.

Between CPU ranks of one host the small ones (payloads up to :data:`.shm_small.SMALL` bytes)
go through ``/dev/shm`` (:mod:`.shm_small`); everything else, and every rank that cannot share
memory with its peers, through the process group (:mod:`._pg`: gloo or NCCL, CUDA tensors
staged through host memory under gloo). A failure either way is a :class:`CollectiveError`
naming the operation, the caller, this rank and the group size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import _pg, meter
from ._pg import CollectiveError, _failure, _Request, all_to_all, group_or_world, sendrecv, world
from .shm_small import SHM_OPS, reduce_gathered, small_group

__all__ = ["CollectiveError", "all_gather", "all_reduce", "all_to_all", "broadcast", "sendrecv", "world"]
_ = (_failure, _Request, group_or_world)  # named here too: callers import them from this module


def all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    """In place when ``t`` is contiguous; use the returned tensor. Ranks may hold the same
    logical tensor in different memory layouts: the backend reduces storage order, so a
    non-contiguous ``t`` is made contiguous first. Through shared memory: gathered, then
    reduced in rank order on every rank (identical everywhere)."""
    _, p = world(group)
    if p > 1 and op in SHM_OPS:
        n = t.numel() * t.element_size()
        sm = small_group(group, t, n, "all_reduce")
        if sm is not None:
            t = t.contiguous()
            meter.record("all_reduce", 2 * (p - 1) / p * n, 2 * (p - 1) / p * n)
            g = sm.all_gather(t, torch.empty(p * t.numel(), dtype=t.dtype), "all_reduce")
            return t.copy_(reduce_gathered(g.view(p, *t.shape), op))
    return _pg.all_reduce(t, op, group)


def all_gather(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Gather ``t`` from every rank into a new tensor ``[p, *t.shape]`` in rank order."""
    _, p = world(group)
    if p > 1:
        n = t.numel() * t.element_size()
        sm = small_group(group, t, n, "all_gather")
        if sm is not None:
            meter.record("all_gather", (p - 1) * n, (p - 1) * n)
            return sm.all_gather(t, torch.empty(p * t.numel(), dtype=t.dtype)).view(p, *t.shape)
    return _pg.all_gather(t, group)


def gather_merge(out: Tensor, lse: Tensor, group: dist.ProcessGroup | None,
                 stacked: bool = False) -> tuple[Tensor, Tensor] | None:  # fmt: skip
    """The all-gather of the packed states ``[out | lse]`` and their merge in rank order
    (:func:`~treeattn.ops.packed.merge_packed` of :func:`all_gather`'s result, bitwise) in one
    compiled call where this group's ranks share memory (``out [..., Dv]``, ``lse [...]``
    float32 CPU tensors of a group of two or more); None elsewhere: the caller gathers and
    merges. ``stacked``: each rank's ``k`` states on dim 0 (``out [k, ..., Dv]``, ``lse [k,
    ...]``), all ``p k`` merged, rank by rank: ``(out [..., Dv], lse [...])``."""
    if out.dtype != torch.float32 or lse.dtype != torch.float32 or out.device.type != "cpu" or lse.device.type != "cpu":
        return None
    if out.ndim < 1 + stacked or out.shape[:-1] != lse.shape:  # the general path says what is wrong
        return None
    n = (out.numel() + lse.numel()) * 4
    sm = small_group(group, out, n, "all_gather")
    if sm is None or len(sm.maps) < 2:
        return None
    k = out.shape[0] if stacked else 1
    got = sm.gather_merge(out.contiguous(), lse.contiguous(), k)
    if got is None:
        return None
    p = len(sm.maps)
    meter.record("all_gather", (p - 1) * n, (p - 1) * n)
    shape = lse.shape[1:] if stacked else lse.shape
    return got[0].view(*shape, out.shape[-1]), got[1].view(shape)


def broadcast(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t`` of the group's rank 0 on every rank (in place; every rank passes a tensor of the
    same shape and dtype). A host tensor travels through the current CUDA device on NCCL."""
    rank, p = world(group)
    if p > 1:
        n = t.numel() * t.element_size()
        sm = small_group(group, t, n, "broadcast")
        if sm is not None:
            meter.record("broadcast", n if rank == 0 else 0, 0 if rank == 0 else n)
            via = t.contiguous()
            sm.broadcast(via)
            return t if via is t else t.copy_(via)
    return _pg.broadcast(t, group)
