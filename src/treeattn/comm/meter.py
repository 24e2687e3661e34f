"""Opt-in communication meter: collectives, bytes sent and received per rank.

Off by default and free when off (one truthiness check per collective). Bytes follow the
usual bandwidth-optimal algorithm per call, as the seed paper's eq. 10-14 count them::

    all_reduce of n bytes over p ranks:      sent = recv = 2 (p-1)/p * n
    all_gather of n bytes per rank:          sent = recv = (p-1) * n
    point-to-point:                           the bytes of the message
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CommMeter", "metering"]


@dataclass
class CommMeter:
    """Counts per rank. ``calls`` maps an op name (``"all_reduce"``, ``"all_gather"``,
    ``"send"``, ``"recv"``) to its number of calls; ``label`` groups counts by caller."""

    calls: Counter = field(default_factory=Counter)
    bytes_sent: int = 0
    bytes_recv: int = 0
    by_label: dict[str, Counter] = field(default_factory=dict)

    @property
    def collectives(self) -> int:
        """Number of collective calls (p2p sends/receives are not collectives)."""
        return sum(n for op, n in self.calls.items() if op not in ("send", "recv"))

    def record(self, op: str, sent: float, recv: float, label: str | None = None) -> None:
        self.calls[op] += 1
        self.bytes_sent += round(sent)
        self.bytes_recv += round(recv)
        if label is not None:
            c = self.by_label.setdefault(label, Counter())
            c[op] += 1
            c["bytes_sent"] += round(sent)
            c["bytes_recv"] += round(recv)


_ACTIVE: list[CommMeter] = []
_LABEL: list[str] = []


@contextlib.contextmanager
def metering(meter: CommMeter | None = None) -> Iterator[CommMeter]:
    """Count every treeattn collective issued on this rank inside the block::

    with treeattn.comm.metering() as m:
        tree_decode(...)
    m.bytes_sent, m.calls
    """
    meter = CommMeter() if meter is None else meter
    _ACTIVE.append(meter)
    try:
        yield meter
    finally:
        _ACTIVE.remove(meter)


@contextlib.contextmanager
def label(name: str) -> Iterator[None]:
    """Attribute the collectives inside the block to ``name`` (e.g. a strategy)."""
    _LABEL.append(name)
    try:
        yield
    finally:
        _LABEL.pop()


def record(op: str, sent: float, recv: float) -> None:
    if _ACTIVE:
        lab = _LABEL[-1] if _LABEL else None
        for m in _ACTIVE:
            m.record(op, sent, recv, lab)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Count nothing inside the block (a transport's one-time set-up is not the caller's traffic)."""
    saved = _ACTIVE[:]
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE[:] = saved
