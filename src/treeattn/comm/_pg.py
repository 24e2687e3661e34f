"""The process group's own collectives (gloo or NCCL), metered, with errors named.

Under gloo, CUDA tensors are staged through host memory (gloo's CUDA support is partial and
its send/recv of CUDA tensors kills the process), so several ranks can share one GPU in
tests; NCCL takes them directly.

A backend failure inside a wrapper (gloo/NCCL timeout, a peer that closed its connection,
...) is re-raised as :class:`CollectiveError` naming the operation, the caller, this rank
and the group size, chained to the backend's own exception. The success path adds nothing
but a ``try`` (free in CPython >= 3.11) and, for point-to-point, one small request wrapper.

The transports of one host (:mod:`.shm`, :mod:`.shm_small`) set themselves up through these;
:mod:`.collectives`, above them all, picks the transport per call.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import Tensor

from . import meter

_TRANSPORT = {__name__, "treeattn.comm.collectives", "treeattn.comm.shm_small"}
# torch >= 2.12 renames all_gather_into_tensor (and warns on the old name)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveError(RuntimeError):
    """A torch.distributed operation issued by treeattn failed on this rank: the backend's
    timeout (a peer stalled) or a broken connection (a peer died or exited). The message
    names the operation (``all_reduce``, ``all_gather``, ``send-recv``), the caller (the
    reduction strategy, ``ring``, or the treeattn function that issued it), this rank and
    the group size; ``__cause__`` is the backend's exception. The process group is not
    usable afterwards: tear it down (the usual reaction is to let the process exit)."""

    def __init__(self, msg: str, *, op: str = "", caller: str = "", rank: int = -1, size: int = -1) -> None:
        super().__init__(msg)
        self.op, self.caller, self.rank, self.size = op, caller, rank, size


def _failure(op: str, group: dist.ProcessGroup | None, e: BaseException, default: str | None = None) -> CollectiveError:
    """Build the CollectiveError for a failed ``op`` (error path only: may be slow)."""
    path = []
    f = sys._getframe(1)
    while f is not None:  # the treeattn functions on the stack, innermost first
        mod = f.f_globals.get("__name__", "")
        if not mod.startswith("treeattn."):
            break
        if mod not in _TRANSPORT:  # the collectives' own frames say nothing of who called
            path.append(f.f_code.co_name)
        f = f.f_back
    path.reverse()
    caller = meter._LABEL[-1] if meter._LABEL else default or (path[0] if path else "?")
    try:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        glob = f" (global rank {dist.get_rank()})" if group is not None and dist.get_rank() != rank else ""
    except Exception:  # the group itself is unusable: still report the failure
        rank, size, glob = -1, -1, ""
    where = " > ".join(path) or "?"
    return CollectiveError(
        f"treeattn {op} failed on rank {rank} of {size}{glob} (caller: {caller}; path: {where}): "
        f"{type(e).__name__}: {e}",
        op=op,
        caller=caller,
        rank=rank,
        size=size,
    )


def group_or_world(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the world group for None (what ``get_global_rank`` and weak keys need)."""
    return group if group is not None else dist.group.WORLD


def world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _staged(t: Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether ``t`` must travel through host memory: a non-CPU tensor on a gloo group."""
    if t.device.type == "cpu":
        return False
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        return False


def all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    """In place when ``t`` is contiguous; use the returned tensor. Ranks may hold the same
    logical tensor in different memory layouts: the backend reduces storage order, so a
    non-contiguous ``t`` is made contiguous first."""
    _, p = world(group)
    if p > 1:
        t = t.contiguous()
        n = t.numel() * t.element_size()
        meter.record("all_reduce", 2 * (p - 1) / p * n, 2 * (p - 1) / p * n)
        via = t.cpu() if _staged(t, group) else t
        try:
            dist.all_reduce(via, op=op, group=group)
        except RuntimeError as e:
            raise _failure("all_reduce", group, e) from e
        if via is not t:
            t.copy_(via)
    return t


def all_gather(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Gather ``t`` from every rank into a new tensor ``[p, *t.shape]`` in rank order."""
    _, p = world(group)
    if p == 1:
        return t.unsqueeze(0)
    stage = _staged(t, group)
    out = torch.empty(p * t.numel(), dtype=t.dtype, device="cpu" if stage else t.device)
    n = t.numel() * t.element_size()
    meter.record("all_gather", (p - 1) * n, (p - 1) * n)
    try:
        _all_gather_flat(out, (t.cpu() if stage else t).reshape(-1).contiguous(), group=group)
    except RuntimeError as e:
        raise _failure("all_gather", group, e) from e
    return out.view(p, *t.shape).to(t.device)


def all_to_all(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t [p, ...]``: block j goes to rank j; returns ``[p, ...]`` whose block j came from rank j."""
    _, p = world(group)
    if p == 1:
        return t
    device = t.device
    t = t.contiguous()
    t = t.cpu() if _staged(t, group) else t
    out = torch.empty_like(t)
    n = t.numel() * t.element_size()
    meter.record("all_to_all", (p - 1) * n // p, (p - 1) * n // p)
    try:
        dist.all_to_all_single(out, t, group=group)
    except RuntimeError as e:
        raise _failure("all_to_all", group, e) from e
    return out.to(device)


class _Request:
    """A point-to-point request whose ``wait()`` raises :class:`CollectiveError`; ``done``
    (a staged receive) copies the host buffer to its device target after the wait."""

    __slots__ = ("_work", "_group", "_done")

    def __init__(self, work, group, done=None) -> None:
        self._work, self._group, self._done = work, group, done

    def wait(self, *args, **kwargs):
        try:
            r = self._work.wait(*args, **kwargs)
        except RuntimeError as e:
            raise _failure("send-recv", self._group, e, "ring") from e
        if self._done is not None:
            self._done()
            self._done = None
        return r

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def sendrecv(send: list[Tensor], dst: int, recv: list[Tensor], src: int, group: dist.ProcessGroup | None) -> list:
    """Post sends of ``send`` to ``dst`` and receives into ``recv`` from ``src`` (group ranks)
    together; returns the requests to wait on (``wait()`` raises :class:`CollectiveError`).
    Message i carries tag i, so the i-th send always lands in the i-th receive (backends may
    match same-tag messages out of order)."""
    g = group_or_world(group)
    gd, gs = dist.get_global_rank(g, dst), dist.get_global_rank(g, src)
    ops, done = [], []
    for i, t in enumerate(send):
        meter.record("send", t.numel() * t.element_size(), 0)
        ops.append(dist.P2POp(dist.isend, t.contiguous().cpu() if _staged(t, group) else t, gd, group, tag=i))
        done.append(None)
    for i, t in enumerate(recv):
        meter.record("recv", 0, t.numel() * t.element_size())
        via = t
        if _staged(t, group):
            via = torch.empty(t.shape, dtype=t.dtype)
            done.append(lambda t=t, via=via: t.copy_(via))
        else:
            done.append(None)
        ops.append(dist.P2POp(dist.irecv, via, gs, group, tag=i))
    try:
        reqs = dist.batch_isend_irecv(ops)
    except RuntimeError as e:
        raise _failure("send-recv", group, e, "ring") from e
    if len(reqs) == len(done):  # gloo: a request per message
        return [_Request(r, group, d) for r, d in zip(reqs, done, strict=True)]
    # NCCL coalesces the batch into one request: the staged copies (none there) follow its wait
    todo = [d for d in done if d is not None]
    tail = (lambda: [d() for d in todo]) if todo else None
    return [_Request(r, group, tail if i == len(reqs) - 1 else None) for i, r in enumerate(reqs)]


def broadcast(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t`` of the group's rank 0 on every rank (in place; every rank passes a tensor of the
    same shape and dtype). A host tensor travels through the current CUDA device on NCCL."""
    rank, p = world(group)
    if p > 1:
        n = t.numel() * t.element_size()
        meter.record("broadcast", n if rank == 0 else 0, 0 if rank == 0 else n)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        via = t
        if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
            via = t.to(torch.device("cuda", torch.cuda.current_device()))
        elif _staged(t, group):
            via = t.contiguous().cpu()
        try:
            dist.broadcast(via, src=src, group=group)
        except RuntimeError as e:
            raise _failure("broadcast", group, e) from e
        if via is not t:
            t.copy_(via)
    return t
