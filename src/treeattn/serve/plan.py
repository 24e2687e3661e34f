"""One step of the batched server, as rank 0 decides it and every rank executes it, and its
encoding as one int64 vector (what the broadcast carries: nothing is pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Plan:
    """In execution order: ``closes`` (row, adopt), ``drops`` (prefix ids), at most one of
    ``prefix`` (pid, ids: a chunk of a new prefix) and ``join`` (row, pid or -1, keep, open,
    ids: a chunk of a joining request's own tokens), then ``decode`` (row, token) pairs."""

    closes: list[tuple[int, int]] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)
    prefix: tuple[int, list[int]] | None = None
    join: tuple[int, int, int, int, list[int]] | None = None
    decode: list[tuple[int, int]] = field(default_factory=list)
    prefilling: object = None  # rank 0 only: the job of the prefill item
    decoding: list = field(default_factory=list)  # rank 0 only: the job of each decode row

    def empty(self) -> bool:
        return not (self.closes or self.drops or self.prefix or self.join or self.decode)

    def encode(self) -> list[int]:
        out = [len(self.closes)] + [x for c in self.closes for x in c] + [len(self.drops)] + list(self.drops)
        if self.prefix is not None:
            out += [1, self.prefix[0], len(self.prefix[1]), *self.prefix[1]]
        elif self.join is not None:
            *head, ids = self.join
            out += [2, *head, len(ids), *ids]
        else:
            out += [0]
        return out + [len(self.decode)] + [x for d in self.decode for x in d]

    @classmethod
    def decode_from(cls, v: list[int]) -> Plan:
        p, i = cls(), 0

        def take(n: int) -> list[int]:
            nonlocal i
            i += n
            return v[i - n : i]

        (n,) = take(1)
        p.closes = [tuple(take(2)) for _ in range(n)]
        (n,) = take(1)
        p.drops = take(n)
        (kind,) = take(1)
        if kind == 1:
            pid, n = take(2)
            p.prefix = (pid, take(n))
        elif kind == 2:
            row, pid, keep, opening, n = take(5)
            p.join = (row, pid, keep, opening, take(n))
        (n,) = take(1)
        p.decode = [tuple(take(2)) for _ in range(n)]
        if i != len(v):
            raise ValueError(f"a step plan of {len(v)} values has {len(v) - i} left over")
        return p
