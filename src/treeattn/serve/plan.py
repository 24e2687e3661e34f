"""One step of the batched server, as rank 0 decides it and every rank executes it, and its
encoding as one int64 vector (what the broadcast carries: nothing is pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# The most tokens a request drafts per step: a token and its draft make one line of at most
# ``treeattn.runtime.batch.PLACED_MAX`` tokens, placed as a lone decode token is (its own tokens
# attended on their owners; its shared-prefix pass the decode path, as for every line with logits
# at every token).
MAX_DRAFT = 15


class Line(NamedTuple):
    """One line of a step's forward: the next tokens ``ids`` of row ``row``; ``open``: the row
    starts here, after the first ``keep`` tokens of prefix ``pid`` (-1: none); ``full``: logits
    at every token (a token and its draft), else at the last."""

    row: int
    open: int
    pid: int
    keep: int
    full: int
    ids: list[int]


@dataclass
class Plan:
    """In execution order: ``trims`` (row, own tokens to keep: a rejected draft's go),
    ``closes`` (row, adopt), ``drops`` (prefix ids), ``prefix`` (pid, ids: a chunk of a new
    prefix, prefilled by its Session) or None, then ``lines`` (row, open, pid or -1, keep,
    full, ids), run together in one forward: one token of a decoding request, a token and the
    draft that follows it (``full``: logits at every token), or a chunk of a joining request's
    own prompt (``open``: its row starts here, after the first ``keep`` tokens of prefix
    ``pid``)."""

    trims: list[tuple[int, int]] = field(default_factory=list)
    closes: list[tuple[int, int]] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)
    prefix: tuple[int, list[int]] | None = None
    lines: list[Line] = field(default_factory=list)
    jobs: list = field(default_factory=list)  # rank 0 only: the job of each line
    builder: object = None  # rank 0 only: the job whose prefix chunk this is

    def empty(self) -> bool:
        return not (self.trims or self.closes or self.drops or self.prefix or self.lines)

    def encode(self) -> list[int]:
        out = [len(self.trims)] + [x for t in self.trims for x in t] + [len(self.closes)] + [x for c in self.closes for x in c] + [len(self.drops)] + list(self.drops)
        out += [0] if self.prefix is None else [1, self.prefix[0], len(self.prefix[1]), *self.prefix[1]]
        out.append(len(self.lines))
        for *head, ids in self.lines:
            out += [*head, len(ids), *ids]
        return out

    @classmethod
    def decode_from(cls, v: list[int]) -> Plan:
        p, i = cls(), 0

        def take(n: int) -> list[int]:
            nonlocal i
            if n < 0 or i + n > len(v):
                raise ValueError(f"a step plan of {len(v)} values is cut short")
            i += n
            return v[i - n : i]

        (n,) = take(1)
        p.trims = [tuple(take(2)) for _ in range(n)]
        (n,) = take(1)
        p.closes = [tuple(take(2)) for _ in range(n)]
        (n,) = take(1)
        p.drops = take(n)
        if take(1)[0]:
            pid, n = take(2)
            p.prefix = (pid, take(n))
        (n,) = take(1)
        for _ in range(n):
            row, opening, pid, keep, full, m = take(6)
            p.lines.append(Line(row, opening, pid, keep, full, take(m)))
        if i != len(v):
            raise ValueError(f"a step plan of {len(v)} values has {len(v) - i} left over")
        return p
