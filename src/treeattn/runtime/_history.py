"""A Session's committed token history: the ids of each sequence on the host (-1 beyond a
row's length) and the row lengths. Nothing here touches the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class History:
    def __init__(self, B: int = 1) -> None:
        self.ids = torch.zeros(B, 0, dtype=torch.int64)
        self.lens = torch.zeros(B, dtype=torch.int64)

    def __len__(self) -> int:
        return int(self.lens.max())

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    def tokens(self) -> Tensor:
        return self.ids[:, : len(self)].clone()

    def common_prefix(self, ids: Tensor | Sequence[int]) -> int:
        ids = torch.as_tensor(ids).detach().cpu().to(torch.int64)
        if not len(self):
            return 0
        ids = ids.expand(self.batch, -1) if ids.ndim == 1 else ids
        if ids.ndim != 2 or ids.shape[0] != self.batch:
            raise ValueError(f"ids must be [L] or [B, L] with B={self.batch}, got {tuple(ids.shape)}")
        n = min(ids.shape[1], len(self))
        same = (ids[:, :n] == self.ids[:, :n]).all(0)
        return int(same.to(torch.int64).cumprod(0).sum())

    def commit(self, ids: Tensor, before: Tensor, lens: Tensor) -> None:
        """Sequence b's first ``lens[b]`` tokens of ``ids [B, T]`` (host) follow ``before[b]``."""
        T = ids.shape[1]
        self._grow(int((before + lens).max()))
        real = torch.arange(T)[None, :] < lens[:, None]
        rows = torch.arange(self.batch)[:, None].expand(-1, T)
        self.ids[rows[real], (before[:, None] + torch.arange(T)[None, :])[real]] = ids[real]
        self.lens = before + lens

    def truncate(self, lens: Tensor) -> None:
        """Back to ``lens [B]`` tokens per sequence."""
        cols = torch.arange(self.ids.shape[1])[None, :]
        self.ids[cols >= lens[:, None]] = -1
        self.lens = lens.clone()

    def _grow(self, need: int) -> None:
        if need > self.ids.shape[1]:
            ids = torch.full((self.batch, max(need, 2 * self.ids.shape[1], 64)), -1, dtype=torch.int64)
            ids[:, : self.ids.shape[1]] = self.ids
            self.ids = ids
