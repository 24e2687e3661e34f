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

The segments are created ``0600`` (``O_EXCL``, no symlinks followed) under a fresh random name
for every size, mapped by every rank of the group (peers: read-only, and only a regular file of
this user of the expected size), then unlinked at once: nothing is left in ``/dev/shm`` if a
rank dies later, and a peer on another host creates nothing. Used only when every rank of the
group verifiably maps its peers' segments (a token written by each owner is read back by every
peer); else the caller keeps the process group's send/recv. The segments grow with the largest
block and live as long as the group; a growth that fails on any rank (a full ``/dev/shm``:
Docker's default is 64 MB) switches the group to send/recv for good. Set ``TREEATTN_SHM=0`` to
disable it. Raw bytes only: nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
import struct
import warnings
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from . import meter
from ._pg import _failure, _Request, all_gather, all_reduce, broadcast, group_or_world, world

_DIR = "/dev/shm"
_TAG = 9  # the ready messages' tag (the ring's own messages use tags 0 and 1)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _Shm, or False


def _map(fd: int, nbytes: int, write: bool) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))


def as_tensor(m: mmap.mmap) -> Tensor:
    """A mapping as a flat uint8 tensor (sharing its memory)."""
    with warnings.catch_warnings():  # a peer's segment is mapped read-only: torch warns of that
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(m, dtype=torch.uint8)


def _create(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:  # allocated up front: a full /dev/shm fails here, not with SIGBUS later
        os.posix_fallocate(fd, 0, nbytes)
        return _map(fd, nbytes, True)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _open_peer(path: str, nbytes: int) -> mmap.mmap | None:
    """A peer's segment, read-only; None unless it is a regular file of ours of ``nbytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != nbytes:
            return None
        return _map(fd, nbytes, False)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def map_group(group, nbytes: int, token: int | None = None) -> list[mmap.mmap] | None:
    """Collective: every rank creates a segment of ``nbytes`` under a fresh random name and
    maps every peer's (read-only). The mappings in group rank order (this rank's writable),
    when every rank mapped every peer's (and, with a ``token``, read back each owner's token
    from its first 8 bytes); else None on every rank. No exception of one rank escapes it
    alone: a local failure is a None for the whole group."""
    rank, p = world(group)
    seed = broadcast(torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.int64), group)
    base = os.path.join(_DIR, f"treeattn-{os.getuid()}-{int(seed[0]):x}-")
    maps: dict[int, mmap.mmap | None] = {}
    try:
        maps[rank] = _create(base + str(rank), nbytes)
        if token is not None:
            struct.pack_into("<q", maps[rank], 0, token)
    except (OSError, ValueError, RuntimeError):
        maps.clear()
    try:  # every rank takes part in every collective below, whatever failed
        ok = bool(all_reduce(torch.tensor([float(bool(maps))]), dist.ReduceOp.MIN, group)[0] > 0)
        if token is not None:
            tokens = all_gather(torch.tensor([token], dtype=torch.int64), group).view(-1).tolist()
        for j in range(p):
            if j != rank and ok:
                maps[j] = m = _open_peer(base + str(j), nbytes)
                ok = m is not None and (token is None or struct.unpack_from("<q", m, 0)[0] == tokens[j])
        ok = bool(all_reduce(torch.tensor([float(ok)]), dist.ReduceOp.MIN, group)[0] > 0)  # all mapped
    finally:
        if rank in maps:  # ours: every peer that could map it has
            with contextlib.suppress(OSError):
                os.unlink(base + str(rank))
    return [maps[j] for j in range(p)] if ok else None


class _Shm:
    """One group's segments: this rank's (two slots) and its peers' mappings."""

    def __init__(self, group) -> None:
        self._ref = None if group is None else weakref.ref(group)  # the dict's key: no strong ref
        self.slot_bytes, self.calls = 0, 0
        self.maps: list[Tensor] = []

    @property
    def group(self):
        return None if self._ref is None else self._ref()

    def _map_all(self, nbytes: int, token: int | None = None) -> bool:
        """Collective: (re)map the group's segments at ``nbytes`` (:func:`map_group`)."""
        self.maps, self.slot_bytes = [], 0
        maps = map_group(self.group, nbytes, token)
        if maps is not None:
            self.maps, self.slot_bytes = [as_tensor(m) for m in maps], nbytes // 2
        return maps is not None

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
        _GROUPS[group_or_world(self.group)] = False
        return False

    def exchange(self, k: Tensor, v: Tensor, sizes: list[int]) -> Iterator[tuple[int, Tensor, Tensor]]:
        """Publish this rank's ``k [B, H, sizes[rank], D]`` / ``v`` and announce it; yields
        every peer's block ``(src, k_src, v_src)`` in ring order (rank - 1, rank - 2, ...),
        each once its owner announced it. Views into shared memory: valid until the exchange
        after next. Call :meth:`fits` first; consume the iterator fully (that completes the
        exchange)."""
        group = self.group
        rank, p = world(group)
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
        g, peers = group_or_world(group), [(rank - hop) % p for hop in range(1, p)]  # ring order
        ops = []
        for j in peers:
            ops.append(dist.P2POp(dist.isend, flag, dist.get_global_rank(g, j), group, tag=_TAG))
            ops.append(dist.P2POp(dist.irecv, got[j], dist.get_global_rank(g, j), group, tag=_TAG))
        try:
            reqs = [_Request(r, group) for r in dist.batch_isend_irecv(ops)]
        except RuntimeError as e:
            raise _failure("send-recv", group, e, "ring") from e
        return self._blocks(peers, reqs, got, self.calls, block, (k.numel() + v.numel()) * es)

    def _blocks(
        self, peers: list[int], reqs: list, got: list[Tensor], calls: int, block, held: int
    ) -> Iterator[tuple[int, Tensor, Tensor]]:
        for i, src in enumerate(peers):
            reqs[2 * i + 1].wait()  # src's ready message
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
    g = group_or_world(group)
    st = _GROUPS.get(g)
    if st is None:
        st = _setup(group)
        _GROUPS[g] = st
    return st or None


def _setup(group) -> _Shm | bool:
    local = os.environ.get("TREEATTN_SHM", "1") != "0" and os.path.isdir(_DIR) and os.access(_DIR, os.W_OK)
    if not bool(all_reduce(torch.tensor([float(local)]), dist.ReduceOp.MIN, group)[0] > 0):
        return False
    st = _Shm(group)
    return st if st._map_all(4096, token=secrets.randbits(62)) else False
