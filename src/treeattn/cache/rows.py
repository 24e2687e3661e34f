"""RowCache: the running sequences' own tokens (their suffixes), this rank's shard, per layer.

A batch of running sequences reads shared prefixes (each one a :class:`ShardedKVCache` of
one sequence, stored once) and appends its own tokens here: row ``r`` holds the tokens at
global positions ``start[r], start[r] + 1, ...`` of its sequence. Each token lives on the rank
its sequence's placement gives that position, continuing the layout of the prefix it reads
(``counts``: the prefix's tokens per rank), so a finished row's tokens can be appended to
its prefix by a rank-local copy. All metadata is host-side integers, the same on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .placement import Placement


class RowCache:
    """Per layer ``[rows, Hkv, cap, D]`` K and V buffers of this rank and each row's metadata.

    Args:
        num_layers, rows, kv_heads, head_dim: geometry (``v_head_dim`` defaults to ``head_dim``).
        rank, p: this rank and the group's size.
        dtype, device: of the buffers.
    """

    def __init__(self, num_layers: int, rows: int, kv_heads: int, head_dim: int, *, rank: int, p: int,
                 dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None) -> None:  # fmt: skip
        self.L, self.R, self.Hkv, self.D, self.Dv = num_layers, rows, kv_heads, head_dim, v_head_dim or head_dim
        self.rank, self.p, self.dtype, self.device = rank, p, dtype, torch.device(device)
        self.cap = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.placement: list[Placement | None] = [None] * rows
        self.start = torch.zeros(rows, dtype=torch.int64)  # global position of the row's first own token
        self.n = torch.zeros(rows, dtype=torch.int64)  # own tokens (all ranks)
        self.counts = torch.zeros(rows, p, dtype=torch.int64)  # tokens per rank of the whole sequence
        self.kv_len = torch.zeros(rows, dtype=torch.int64)  # own tokens on this rank
        self.positions = torch.zeros(rows, 0, dtype=torch.int64)  # global position of each local slot
        self.owners: list[list[int]] = [[] for _ in range(rows)]  # the rank of each own token
        self._grow(16)

    def _grow(self, need: int) -> None:
        if need <= self.cap:
            return
        cap = max(need, 2 * self.cap)
        for i in range(self.L):
            k = torch.zeros(self.R, self.Hkv, cap, self.D, dtype=self.dtype, device=self.device)
            v = torch.zeros(self.R, self.Hkv, cap, self.Dv, dtype=self.dtype, device=self.device)
            if self.cap:
                k[:, :, : self.cap], v[:, :, : self.cap] = self.k[i], self.v[i]
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)
        pos = torch.full((self.R, cap), -1, dtype=torch.int64)
        pos[:, : self.cap] = self.positions
        self.positions, self.cap = pos, cap

    @property
    def used(self) -> int:
        """Slots in use on this rank (the longest row's local tokens)."""
        return int(self.kv_len.max()) if self.R else 0

    def open(self, row: int, start: int, placement: Placement, counts: Tensor) -> None:
        """Start row ``row`` empty after a prefix of ``start`` tokens laid out by ``placement``
        with ``counts [p]`` of them per rank (zeros and 0 without a prefix)."""
        self.placement[row] = placement
        self.start[row], self.n[row], self.kv_len[row] = start, 0, 0
        self.counts[row] = counts
        self.positions[row] = -1
        self.owners[row] = []

    def close(self, row: int) -> None:
        """Forget row ``row``: its slots are free for the next sequence."""
        self.placement[row] = None
        self.start[row] = self.n[row] = self.kv_len[row] = 0
        self.counts[row] = 0
        self.positions[row] = -1
        self.owners[row] = []

    def truncate(self, row: int, n: int) -> None:
        """Keep the first ``n`` own tokens of ``row`` (rejected draft tokens go): the row is
        then as if the rest had never been placed."""
        have = int(self.n[row])
        if not 0 <= n <= have:
            raise ValueError(f"row {row} holds {have} own tokens, cannot keep {n}")
        gone = torch.tensor(self.owners[row][n:], dtype=torch.int64)
        mine = int((gone == self.rank).sum())
        self.counts[row] -= torch.bincount(gone, minlength=self.p)
        self.kv_len[row] -= mine
        self.positions[row, int(self.kv_len[row]) :] = -1
        self.n[row] = n
        del self.owners[row][n:]

    def place(self, rows: list[int], n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``n`` tokens to each of ``rows`` (each on the rank its placement gives,
        token by token). Returns this rank's share ``(i, j, slot)`` (host int64): token ``j``
        of ``rows[i]`` goes to local slot ``slot`` (store it with :meth:`store`)."""
        out_i, out_j, out_s = [], [], []
        for i, r in enumerate(rows):
            pl = self.placement[r]
            if pl is None:
                raise RuntimeError(f"row {r} is not open")
            pos = int(self.start[r] + self.n[r])
            own = pl.block_owners(self.counts[r], pos, n)
            mine = torch.nonzero(own == self.rank).flatten()
            slots = int(self.kv_len[r]) + torch.arange(len(mine))
            self._grow(int(self.kv_len[r]) + len(mine))
            self.positions[r, slots] = pos + mine
            self.counts[r] += torch.bincount(own, minlength=self.p)
            self.owners[r] += own.tolist()
            self.n[r] += n
            self.kv_len[r] += len(mine)
            out_i.append(torch.full((len(mine),), i, dtype=torch.int64))
            out_j.append(mine)
            out_s.append(slots)
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64))  # noqa: E731
        return cat(out_i), cat(out_j), cat(out_s)

    def store(self, layer: int, rows: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store K/V ``[N, Hkv, D]`` of ``layer`` at local ``slots [N]`` of ``rows [N]`` (device)."""
        if len(rows):
            self.k[layer][rows, :, slots] = k
            self.v[layer][rows, :, slots] = v

    def local(self, layer: int, rows: Tensor | slice) -> tuple[Tensor, Tensor]:
        """This rank's K/V of ``rows``, ``[n, Hkv, used, D]``: a view for a slice of rows, else
        a copy (``rows`` a device index tensor)."""
        u = max(self.used, 1)
        k, v = self.k[layer][:, :, :u], self.v[layer][:, :, :u]
        if isinstance(rows, slice):
            return k[rows], v[rows]
        return k.index_select(0, rows), v.index_select(0, rows)  # (advanced indexing: ~5x slower here)

    def slots_before(self, rows: list[int], bound: Tensor) -> Tensor:
        """Per query, how many of the row's local slots hold a position ``< bound`` (``bound
        [n, T]`` host int64, ``rows[i]`` for line ``i``): a sliding window's first slot."""
        pos = self.positions[rows, : max(self.used, 1)]
        valid = torch.arange(pos.shape[1])[None, :] < self.kv_len[rows][:, None]
        pos = torch.where(valid, pos, torch.iinfo(torch.int64).max)
        return torch.searchsorted(pos, bound.contiguous())
