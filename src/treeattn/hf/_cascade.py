"""One layer's attention of a batched step over shared prefixes (cascade attention).

Each line of the batch reads the first ``keep`` tokens of one shared prefix (a
:class:`~treeattn.cache.ShardedKVCache` of one sequence), then its own earlier tokens (a row of
a :class:`~treeattn.cache.RowCache`), then its ``T`` new tokens (a causal chain). The lines that
read the same prefix up to the same ``keep`` attend to it together: their queries are folded
into one query block, so each rank reads its shard of the prefix once per step whatever the
number of lines. Tree: the local prefix and row states are merged on each rank and cross
the ranks in one reduction (the merge is associative: seed paper, §4); the new tokens,
identical on every rank, are merged after it. Ring: each part's K/V goes round the ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..cache import RowCache, ShardedKVCache
from ..comm.strategies import reduce_states
from ..ops.attention import _attention
from ..ops.state import merge_states
from ..parallel import ring_decode
from ..parallel.tree import new_token_state


@dataclass
class PrefixGroup:
    """Lines ``lines`` (device int64) of the batch read the first ``keep`` tokens of ``cache``."""

    cache: ShardedKVCache
    keep: int
    lines: Tensor
    local: int = 0  # this rank's slots below keep


@dataclass
class RowsStep:
    """What the ``treeattn`` attention needs for one batched forward (mode ``"rows"``)."""

    rows: RowCache
    row_ids: list[int]  # the RowCache row of each line
    q_pos: Tensor  # [n, T] global positions of the new tokens (host)
    groups: list[PrefixGroup]
    attention: str = "tree"
    strategy: str = "auto"
    group: dist.ProcessGroup | None = None
    mode: str = "rows"
    stash: dict = field(default_factory=dict)  # layer -> (k, v) [n, Hkv, T, D] of the new tokens
    _dev: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        dev = self.rows.device
        self._dev["rows"] = torch.tensor(self.row_ids, dtype=torch.int64, device=dev)
        self._dev["lens"] = self.rows.kv_len[self.row_ids].to(dev)
        for g in self.groups:
            g.local = int(g.cache.slots_before(g.keep)[0])

    def starts(self, window: int | None) -> tuple[list[Tensor | None], Tensor | None]:
        """Under a sliding window: each group's ``kv_start [1, m*T]`` and the rows' ``[n, T]``."""
        if window is None:
            return [None] * len(self.groups), None
        key = ("w", window)
        if key not in self._dev:
            dev, lo = self.rows.device, self.q_pos - window + 1
            gs = [g.cache.slots_before(lo[g.lines.cpu()].reshape(1, -1)).to(dev) for g in self.groups]
            self._dev[key] = (gs, self.rows.slots_before(self.row_ids, lo).to(dev))
        return self._dev[key]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale, window: int | None, softcap) -> Tensor:
        """``q [n, Hq, T, D]``, the new tokens' ``k, v [n, Hkv, T, D]``; returns ``[n, Hq, T, Dv]``."""
        n, Hq, T, _ = q.shape
        g_starts, r_start = self.starts(window)
        rows, lens = self._dev["rows"], self._dev["lens"]
        ks, vs = self.rows.local(layer, rows)
        if self.attention == "ring":
            kw = dict(group=self.group, scale=scale, softcap=softcap, return_lse=True, check=False)
            out, lse = ring_decode(q, ks, vs, kv_lens=lens, kv_start=r_start, new_k=k, new_v=v, window=window, **kw)
            out = out.to(lse.dtype)
            for g, st in zip(self.groups, g_starts, strict=True):
                qf = _fold(q[g.lines])
                kp, vp = _prefix(g, layer)
                o, l_ = ring_decode(qf, kp, vp, kv_lens=torch.full((1,), g.local, device=q.device), kv_start=st, **kw)
                o, l_ = _unfold(o.to(lse.dtype), l_, len(g.lines), T)
                out[g.lines], lse[g.lines] = merge_states(out[g.lines], lse[g.lines], o, l_)
            return out.to(q.dtype)
        out, lse = row_state(q, ks, vs, lens, r_start, scale, softcap)
        for g, st in zip(self.groups, g_starts, strict=True):
            if g.local:
                o, l_ = prefix_state(q, g, layer, st, scale, softcap)
                out[g.lines], lse[g.lines] = merge_states(out[g.lines], lse[g.lines], o, l_)
        out, lse = reduce_states(out, lse, group=self.group, strategy=self.strategy)
        out, lse = merge_states(out, lse, *new_token_state(q, k, v, None, scale, softcap=softcap, window=window))
        return out.to(q.dtype)


def row_state(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, start, scale, softcap) -> tuple[Tensor, Tensor]:
    """This rank's state of the lines over their rows' own earlier tokens."""
    return _attention(q, k, v, scale=scale, kv_lens=lens, kv_start=start, softcap=softcap, keep_fp32=True)


def prefix_state(q: Tensor, g: PrefixGroup, layer: int, start, scale, softcap) -> tuple[Tensor, Tensor]:
    """This rank's state of group ``g``'s lines over its shard of their prefix: one pass over
    the shard for all of them (their queries folded into one block)."""
    kp, vp = _prefix(g, layer)
    o, lse = _attention(_fold(q[g.lines]), kp, vp, scale=scale, kv_start=start, softcap=softcap, keep_fp32=True)
    return _unfold(o, lse, len(g.lines), q.shape[2])


def _prefix(g: PrefixGroup, layer: int) -> tuple[Tensor, Tensor]:
    return g.cache.k[layer][:, :, : g.local], g.cache.v[layer][:, :, : g.local]


def _fold(q: Tensor) -> Tensor:
    """``[m, Hq, T, D]`` -> ``[1, Hq, m*T, D]`` (query ``j*T + t`` is line j's token t)."""
    m, Hq, T, D = q.shape
    return q.transpose(0, 1).reshape(1, Hq, m * T, D)


def _unfold(out: Tensor, lse: Tensor, m: int, T: int) -> tuple[Tensor, Tensor]:
    Hq, Dv = out.shape[1], out.shape[3]
    return out.reshape(Hq, m, T, Dv).transpose(0, 1), lse.reshape(Hq, m, T).transpose(0, 1)


