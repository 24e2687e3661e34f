"""Small collectives among the ranks of one host through shared memory (CPU tensors).

A decode step at p = 2 made about 30 all-gathers and all-reduces of a few KB through gloo's
TCP loopback, about 1.6 ms each: socket wakeups and gloo's I/O threads, for payloads two
processes on one host can swap in microseconds. Here each rank owns one ``/dev/shm`` segment
(mapped and checked as in :mod:`treeattn.comm.shm`: ``0600``, peers read-only, unlinked at
once) holding a header and two data slots. A collective is one *round*: a rank writes its
payload into slot ``round % 2``, then publishes the round number in its header; a reader
waits until the owner's round number reaches the round, then copies the owner's slot. A slot
is written again two rounds later, only after every peer published the round in between,
which each does after it finished reading the round before: no reader ever sees a slot
change under it, for any group size and any mix of collectives. Ordering rests on x86's
total store order (the payload's stores land before the round number's), so it is used on
x86-64 only; elsewhere, and for payloads over :data:`SMALL` bytes, gloo carries them.

Waiting spins briefly, then yields the core, then sleeps in short steps, so ranks that
share cores (tests run more ranks than cores) still make progress. A peer that exits or
dies (its process is gone or a zombie) ends the wait at once with :class:`CollectiveError`;
a peer that stalls ends it at the group's collective timeout. Never an endless spin.

Tree decoding's state reduction (the all-gather strategy: gather, then merge in rank order)
runs a round in one compiled call where the decode kernel is built (``ops/_merge_shm.c``,
this protocol byte for byte, so ranks on either path exchange with each other): ~20 µs a
call at p = 2 against ~60 through the Python steps. It waits for a peer :data:`SPINS` pauses
at most, then hands the wait to the loop above.

``all_reduce`` gathers and reduces in rank order on every rank: the result is identical on
every rank and, for MAX/MIN and integers, bitwise gloo's; a float SUM over three or more
ranks may round differently from gloo's (it is gloo's to within rounding). ``TREEATTN_SHM=0``
turns this off (as it does the ring's exchange).
"""

from __future__ import annotations

import ctypes
import os
import platform
import secrets
import struct
import time
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import merge_packed_cpu, shm_gather_merge
from . import _pg, meter
from .shm import _DIR, as_tensor, map_group

SPINS = 20000  # pauses the compiled round waits for a peer before the Python wait takes over
SMALL = 1 << 20  # bytes of the largest payload per rank that goes through shared memory
_HEAD = 4096  # header: int64 words [round, pid, start time]; the slots follow, page-aligned
_SLOT = SMALL + 4096
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _Small, or False
SHM_OPS = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum,
        dist.ReduceOp.PRODUCT: torch.mul}  # fmt: skip
_WORD = struct.Struct("<q")
_TAG = struct.Struct("<qq")  # a slot's round and payload bytes; the payload starts 64 bytes in


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot) and whether it runs: None when the
    process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _timeout(group) -> float:
    try:
        return _pg.group_or_world(group)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # no such attribute in this torch: gloo's default
        return 1800.0


class _Small:
    """One group's segments and its round counter."""

    def __init__(self, group, maps, rank: int) -> None:
        self._ref = None if group is None else weakref.ref(group)
        self.maps, self.rank, self.round, self._op = maps, rank, 0, ""
        self.bufs = [as_tensor(m) for m in maps]
        self.own = self.bufs[rank]
        self.timeout = _timeout(group)
        self.pids: list[int | None] = []  # peers whose liveness /proc can tell (None: only the timeout)
        self.segs = (ctypes.c_void_p * len(maps))(*[b.data_ptr() for b in self.bufs])  # for the compiled round

    @property
    def group(self):
        return None if self._ref is None else self._ref()

    def _wait(self, j: int, r: int) -> None:
        """Until peer ``j`` published round ``r``."""
        m, unpack = self.maps[j], _WORD.unpack_from
        for _ in range(2000):  # the common case: the peer is there or nearly
            if unpack(m, 0)[0] >= r:
                return
        t0 = time.monotonic()
        check, nap = t0, 0.0
        while unpack(m, 0)[0] < r:
            now = time.monotonic()
            if now - t0 > 0.02:  # long waits (an idle server, a slow peer) sleep, in steps up to 1 ms
                nap = min(1e-3, nap + 5e-5)
                time.sleep(nap)
            else:
                os.sched_yield()
            if now - check > 0.05:
                check = now
                why = None
                if self.pids[j] is not None and _start_time(self.pids[j]) is None:
                    why = f"group rank {j} (pid {self.pids[j]}) exited"
                elif now - t0 > self.timeout:
                    why = (
                        f"Timed out: group rank {j} did not arrive within the collective timeout ({self.timeout:.0f} s)"
                    )
                if why is not None:
                    e = RuntimeError(f"shared-memory round {r}: {why}")
                    raise _pg._failure(self._op, self.group, e)

    def _publish(self, payload: Tensor | None) -> int:
        """Start a round: write ``payload`` (flat bytes) to this rank's slot once every peer
        is done with the slot's previous round, then publish the round. A slot opens with
        its round and size (written as -1 first, then after the payload: a reader that finds
        them changed after its copy knows the slot moved under it)."""
        r = self.round = self.round + 1
        off = _HEAD + (r % 2) * _SLOT
        if payload is not None:
            for j in range(len(self.maps)):
                if j != self.rank:
                    self._wait(j, r - 1)
            m = self.maps[self.rank]
            _TAG.pack_into(m, off, -1, -1)
            self.own[off + 64 : off + 64 + payload.numel()].copy_(payload)
            _TAG.pack_into(m, off, r, payload.numel())
        _WORD.pack_into(self.maps[self.rank], 0, r)
        return off

    def _read(self, j: int, r: int, off: int, dst: Tensor) -> None:
        self._wait(j, r)
        dst.copy_(self.bufs[j][off + 64 : off + 64 + dst.numel()])
        tag, n = _TAG.unpack_from(self.maps[j], off)
        if tag != r or n != dst.numel():
            why = (
                f"group rank {j} sent {n} bytes where this rank expects {dst.numel()} (every rank must pass "
                f"the same shape and dtype)"
                if tag == r
                else f"out of step with group rank {j} ({tag} != {r})"
            )
            raise _pg._failure(self._op, self.group, RuntimeError(f"shared-memory round {r}: {why}"))

    def all_gather(self, t: Tensor, out: Tensor, op: str = "all_gather") -> Tensor:
        """``out [p * t.numel()]`` (t's dtype) filled in rank order; ``op`` names it in errors."""
        self._op = op
        src = t.reshape(-1).contiguous().view(torch.uint8)
        r = self.round + 1
        off = self._publish(src)
        dst = out.view(torch.uint8).view(len(self.maps), -1)
        for j in range(len(self.maps)):
            if j == self.rank:
                dst[j].copy_(src)
            else:
                self._read(j, r, off, dst[j])
        return out

    def gather_merge(self, out: Tensor, lse: Tensor, k: int = 1) -> tuple[Tensor, Tensor] | None:
        """The all-gather of this rank's ``k`` states ``out [k, R, Dv]``, ``lse [k, R]`` (float32,
        contiguous; any shapes of those sizes) packed as ``[out | lse]`` rows, and the merge of the
        ``p k`` states in order, rank by rank (:func:`~treeattn.ops.packed.merge_packed` of the
        gathered ``[p k, R, Dv + 1]``, bitwise), in one compiled call (``ops/_merge_shm.c``, this
        class's protocol byte for byte): ``(out [R, Dv], lse [R])``. None without the compiled
        kernel, or when a peer is still reading this rank's slot (nothing sent: the caller takes
        the general path). A peer that is slow to arrive is waited for here, with the liveness
        checks and the timeout of every round."""
        f = shm_gather_merge()
        if f is None:
            return None
        self._op = "all_gather"
        p, Dv = len(self.maps), out.shape[-1]
        R = lse.numel() // k
        r = self.round + 1
        off = _HEAD + (r % 2) * _SLOT
        f32 = dict(dtype=torch.float32, device="cpu")  # what the C code writes, whatever torch's defaults
        buf, o, ls = torch.empty(p * k, R, Dv + 1, **f32), torch.empty(R, Dv, **f32), torch.empty(R, **f32)
        got = f(self.segs, p, self.rank, r, off, out.data_ptr(), lse.data_ptr(), k, R, Dv, SPINS, buf.data_ptr(),
                o.data_ptr(), ls.data_ptr())  # fmt: skip
        if got == 1:
            return None
        self.round = r
        if got == 2:  # published; a peer not there yet (or a bad slot: _read says what)
            dst = buf.view(torch.uint8).view(p, -1)
            for j in range(p):
                if j != self.rank:
                    self._read(j, r, off, dst[j])
            m = merge_packed_cpu(buf)
            assert m is not None  # the kernel is loaded: f came from it
            return m
        return o, ls

    def broadcast(self, t: Tensor) -> None:
        """``t`` of rank 0, in place (``t`` contiguous)."""
        self._op = "broadcast"
        flat = t.view(-1).view(torch.uint8)
        r = self.round + 1
        off = self._publish(flat if self.rank == 0 else None)
        if self.rank:
            self._read(0, r, off, flat)


def small_group(group, t: Tensor, nbytes: int, op: str) -> _Small | None:
    """The group's shared-memory exchange when a collective ``op`` of ``nbytes`` per rank on
    ``t`` may use it, else None. Every rank decides alike (same size, dtype, device and
    group); collective on the first eligible call per group (a failure there is ``op``'s)."""
    if not 0 < nbytes <= SMALL or t.device.type != "cpu":
        return None
    g = _pg.group_or_world(group)
    st = _GROUPS.get(g)
    if st is None:
        _GROUPS[g] = False  # its set-up runs collectives: they take gloo, unmetered
        try:
            with meter.paused():
                st = _GROUPS[g] = _setup(group)
        except _pg.CollectiveError as e:  # a peer stalled or died during the set-up
            raise _pg._failure(op, group, e.__cause__ or e) from (e.__cause__ or e)
    return st or None


def _setup(group) -> _Small | bool:
    try:
        gloo = dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):
        gloo = False
    ok = gloo and platform.machine().lower() in ("x86_64", "amd64")  # the same on every rank of a host
    ok = ok and os.environ.get("TREEATTN_SHM", "1") != "0" and os.path.isdir(_DIR) and os.access(_DIR, os.W_OK)
    if not gloo or not bool(_pg.all_reduce(torch.tensor([float(ok)]), dist.ReduceOp.MIN, group)[0] > 0):
        return False
    rank, p = _pg.world(group)
    maps = map_group(group, _HEAD + 2 * _SLOT, token=secrets.randbits(62))
    if maps is None:
        return False
    st = _Small(group, maps, rank)
    me = _start_time(os.getpid()) or -1
    _WORD.pack_into(maps[rank], 0, 0)
    _WORD.pack_into(maps[rank], 8, os.getpid())
    _WORD.pack_into(maps[rank], 16, me)
    _pg.all_reduce(torch.zeros(1), dist.ReduceOp.SUM, group)
    for j in range(p):  # a pid is checked only where /proc shows the same process (one pid namespace)
        pid, start = _WORD.unpack_from(maps[j], 8)[0], _WORD.unpack_from(maps[j], 16)[0]
        st.pids.append(pid if j != rank and start >= 0 and _start_time(pid) == start else None)
    return st


def reduce_gathered(g: Tensor, op) -> Tensor:
    """``g [p, ...]`` reduced over dim 0 in rank order."""
    acc = g[0].clone()
    f = SHM_OPS[op]
    for j in range(1, g.shape[0]):
        acc = f(acc, g[j], out=acc)
    return acc
