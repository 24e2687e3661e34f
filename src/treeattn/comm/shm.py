"""Shared-memory block exchange between the ranks of one host (CPU tensors).

Ring Attention on co-located CPU ranks moved every K/V block through gloo's TCP loopback: two
kernel copies, socket wakeups and gloo's I/O threads competing with the compute for the same
cores. Here each rank publishes its block in its own ``/dev/shm`` segment and its peers read it
in place; only one 8-byte "ready" message per peer travels through the process group (which
also orders the memory: a peer reads after the message arrives).

Safety of reuse: a segment has two slots used alternately by consecutive exchanges, and an
exchange returns only after every peer's block of that exchange was announced, which each peer
does after it finished reading the exchange before. So a slot is written again only after
every reader is done with it, for any group size.

The segments are created ``0600`` with unguessable names, mapped by every rank of the group,
then unlinked at once (nothing is left in ``/dev/shm`` if a rank dies later). Used only when
every rank of the group verifiably maps its peers' segments (a token written by each owner is
read back by every peer); else the caller keeps the process group's send/recv. Set
``TREEATTN_SHM=0`` to disable it. Raw bytes only: nothing is unpickled.
"""

from __future__ import annotations

import os
import secrets
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from . import meter
from .collectives import _failure, _Request, all_gather, all_reduce, broadcast, world

_DIR = "/dev/shm"
_TAG = 9  # the ready messages' tag (the ring's own messages use tags 0 and 1)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _Shm, or False


class _Shm:
    """One group's segments: this rank's (two slots) and its peers' mappings."""

    def __init__(self, group, base: str) -> None:
        self.group, self.base, self.gen, self.slot_bytes, self.calls = group, base, 0, 0, 0
        self.maps: list[Tensor] = []

    def _path(self, rank: int, gen: int) -> str:
        return os.path.join(_DIR, f"{self.base}-{gen}-{rank}")

    def _map_all(self, nbytes: int, token: int | None = None) -> bool:
        """Collective: every rank creates a segment of ``nbytes`` (allocated up front: a full
        ``/dev/shm`` fails here, not with SIGBUS later) and maps every peer's. True when every
        rank mapped every peer's (and, with a ``token``, read back each owner's token)."""
        rank, p = world(self.group)
        self.gen += 1
        self.maps, self.slot_bytes = [], 0
        mine, maps, ok = self._path(rank, self.gen), {}, True
        try:
            fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            maps[rank] = torch.from_file(mine, shared=True, size=nbytes, dtype=torch.uint8)
            if token is not None:
                maps[rank][:8].view(torch.int64).fill_(token)
        except (OSError, RuntimeError):
            ok = False
        try:  # every rank takes part in every collective below, whatever failed
            if token is not None:
                tokens = all_gather(torch.tensor([token], dtype=torch.int64), self.group).view(-1).tolist()
            else:
                all_reduce(torch.zeros(1), dist.ReduceOp.SUM, self.group)  # every segment exists
            for j in range(p):
                if j != rank and ok:
                    try:
                        maps[j] = torch.from_file(self._path(j, self.gen), shared=True, size=nbytes, dtype=torch.uint8)
                    except (OSError, RuntimeError):
                        ok = False
                    else:
                        ok = token is None or int(maps[j][:8].view(torch.int64)) == tokens[j]
            ok = bool(all_reduce(torch.tensor([float(ok)]), dist.ReduceOp.MIN, self.group)[0] > 0)  # all mapped
        finally:
            if rank in maps or os.path.exists(mine):
                os.unlink(mine)
        if ok:
            self.maps, self.slot_bytes = [maps[j] for j in range(p)], nbytes // 2
        return ok

    def fits(self, k: Tensor, v: Tensor, sizes: list[int]) -> bool:
        """Collective when the segments must grow (every rank sees the same ``sizes``, so all
        grow together): whether an exchange of these blocks can go through shared memory.
        False (for this and every later call) when growing failed on some rank."""
        B, H, _, D = k.shape
        need = max(max(sizes), 1) * B * H * (D + v.shape[3]) * k.element_size()
        if need <= self.slot_bytes:
            return True
        if self._map_all(2 * (-(-(need + need // 4) // 4096) * 4096)):  # slots page-aligned
            return True
        _GROUPS[self.group if self.group is not None else dist.group.WORLD] = False
        return False

    def exchange(self, k: Tensor, v: Tensor, sizes: list[int]) -> Iterator[tuple[int, Tensor, Tensor]]:
        """Publish this rank's ``k [B, H, sizes[rank], D]`` / ``v`` and announce it; yields
        every peer's block ``(src, k_src, v_src)`` in ring order (rank - 1, rank - 2, ...),
        each once its owner announced it. Views into shared memory: valid until the exchange
        after next. Call :meth:`fits` first; consume the iterator fully (that completes the
        exchange)."""
        rank, p = world(self.group)
        B, H, _, D = k.shape
        Dv, es = v.shape[3], k.element_size()
        slot = (self.calls % 2) * self.slot_bytes
        self.calls += 1

        def block(j: int) -> tuple[Tensor, Tensor]:
            n = B * H * sizes[j]
            buf = self.maps[j][slot : slot + n * (D + Dv) * es].view(k.dtype)
            return buf[: n * D].view(B, H, sizes[j], D), buf[n * D :].view(B, H, sizes[j], Dv)

        kb, vb = block(rank)
        kb.copy_(k)
        vb.copy_(v)
        flag = torch.tensor([self.calls], dtype=torch.int64)
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(p)]
        g = self.group if self.group is not None else dist.group.WORLD
        ops = []
        for j in range(p):
            if j != rank:
                ops.append(dist.P2POp(dist.isend, flag, dist.get_global_rank(g, j), self.group, tag=_TAG))
                ops.append(dist.P2POp(dist.irecv, got[j], dist.get_global_rank(g, j), self.group, tag=_TAG))
        try:
            reqs = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise _failure("send-recv", self.group, e, "ring") from e
        return self._blocks(
            [_Request(r, self.group) for r in reqs], got, self.calls, block, (k.numel() + v.numel()) * es
        )

    def _blocks(
        self, reqs: list, got: list[Tensor], calls: int, block, held: int
    ) -> Iterator[tuple[int, Tensor, Tensor]]:
        rank, p = world(self.group)
        for src in [(rank - hop) % p for hop in range(1, p)]:
            reqs[2 * (src if src < rank else src - 1) + 1].wait()
            if int(got[src]) != calls:
                raise RuntimeError(f"treeattn: shared-memory exchange out of step with rank {src}")
            ks, vs = block(src)
            got_bytes = (ks.numel() + vs.numel()) * ks.element_size()
            meter.record("send", held, 0)  # what the ring would move at this hop
            meter.record("recv", 0, got_bytes)
            held = got_bytes
            yield src, ks, vs
        for r in reqs[0::2]:
            r.wait()


def shm_exchange(group) -> _Shm | None:
    """The group's shared-memory exchange, or None when its ranks cannot share memory (other
    hosts, no ``/dev/shm``, ``TREEATTN_SHM=0``). Collective on first use per group."""
    g = group if group is not None else dist.group.WORLD
    st = _GROUPS.get(g)
    if st is None:
        st = _setup(group)
        _GROUPS[g] = st
    return st or None


def _setup(group) -> _Shm | bool:
    rank, _ = world(group)
    local = os.environ.get("TREEATTN_SHM", "1") != "0" and os.path.isdir(_DIR) and os.access(_DIR, os.W_OK)
    if not bool(all_reduce(torch.tensor([float(local)]), dist.ReduceOp.MIN, group)[0] > 0):
        return False
    seed = broadcast(torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.int64), group)
    st = _Shm(group, f"treeattn-{os.getuid()}-{int(seed[0]):x}")
    try:
        return st if st._map_all(4096, token=secrets.randbits(62)) else False
    except OSError:
        return False
