"""Where each token of each sequence lives.

``contiguous``: a prompt of padded length L is split into p contiguous chunks (the first
``L % p`` ranks hold one more token); each decoded token goes to the rank holding the
fewest valid tokens of that sequence (lowest rank on ties).

``interleaved``: token ``i`` (prompt or decoded) lives on rank ``(i // block) % p``
(``block = 1`` is striped attention's layout). Every rank holds a similar share of early
and late positions, which balances causal prefill.

Either way the valid tokens of a sequence differ by at most one block between ranks for an
unpadded prompt, and a decoded token never moves that gap beyond a block. All metadata
is plain host-side integers computed from prompt lengths: no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PLACEMENTS


@dataclass(frozen=True)
class Placement:
    kind: str
    p: int
    block: int = 1

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.kind!r}")
        if self.p < 1 or self.block < 1:
            raise ValueError(f"need p >= 1 and block >= 1, got p={self.p}, block={self.block}")

    def max_per_rank(self, n: int) -> int:
        """The most tokens one rank holds of an unpadded sequence of ``n`` tokens: exact for
        ``interleaved``; for ``contiguous`` one more than the even share (a rewind can leave a
        rank above it until later tokens even the ranks out)."""
        if self.kind == "interleaved":
            return -(-n // (self.p * self.block)) * self.block
        return -(-n // self.p) + 1

    def prompt_positions(self, rank: int, L: int) -> torch.Tensor:
        """Increasing int64 positions in ``[0, L)`` held by ``rank`` after prefill."""
        if self.kind == "contiguous":
            sizes = [L // self.p + (r < L % self.p) for r in range(self.p)]
            start = sum(sizes[:rank])
            return torch.arange(start, start + sizes[rank])
        i = torch.arange(L)
        return i[(i // self.block) % self.p == rank]

    def decode_owner(self, pos: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Owner rank ``[B]`` of the tokens at positions ``pos [B]`` given ``counts [B, p]``."""
        if self.kind == "interleaved":
            return (pos // self.block) % self.p
        return counts.argmin(1)  # first minimum: lowest rank on ties

    def block_owners(self, counts: torch.Tensor, start: int, n: int, prompt: bool = False) -> torch.Tensor:
        """Owner ranks ``[n]`` of the positions ``start .. start + n - 1`` appended to a sequence
        whose ranks hold ``counts [p]`` tokens: what :meth:`decode_owner` gives token by token
        (with ``prompt``, an empty sequence takes the prompt split of :meth:`prompt_positions`)."""
        if self.kind == "interleaved":
            return ((start + torch.arange(n)) // self.block) % self.p
        c = counts.to(torch.int64).clone()
        if prompt and int(c.sum()) == 0:
            return torch.cat([torch.full((len(self.prompt_positions(r, n)),), r) for r in range(self.p)])
        out, left = [], n
        while left > 0:  # water-filling: the least-loaded ranks (lowest first) take a token each, level by level
            m = int(c.min())
            low = torch.nonzero(c == m).flatten()
            if len(low) == self.p:  # all level: round robin from rank 0
                out.append(torch.arange(left) % self.p)
                break
            rounds = min(int(c[c > m].min()) - m, -(-left // len(low)))
            take = low.repeat(rounds)[:left]
            out.append(take)
            c += torch.bincount(take, minlength=self.p)
            left -= len(take)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def auto_block(T: int, p: int) -> int:
    """The interleaved placement's block for a cache whose first call has ``T`` tokens: the
    largest power of two up to 256 that gives every rank at least 4 blocks of the prompt
    (the ranks' shares differ by at most one block), 1 for short prompts and for p = 1."""
    n = max(1, T // (4 * p) if p > 1 else 1)
    return min(256, 1 << (n.bit_length() - 1))
