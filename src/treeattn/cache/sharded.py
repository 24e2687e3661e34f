"""ShardedKVCache: this rank's K/V shard of every sequence, per layer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._host import empty_huge
from ..comm.collectives import world
from ..comm.validate import agree
from .placement import PLACEMENTS, Placement

_DT = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


class ShardedKVCache:
    """Per layer, this rank's K/V of every sequence of a batch, with global positions.

    Slots ``0 .. kv_lens[b] - 1`` of sequence ``b`` hold its valid local tokens in increasing
    position order (``positions[b, slot]``). Capacity grows geometrically (amortised O(1)
    per token, never a full copy per step). Metadata (counts per rank, positions) lives on
    the host and is derived from prompt lengths, so the per-step path does no host sync.

    Created collectively by every rank of ``group``; the ranks agree on its metadata once
    (one small all-gather), so later steps need no validation.

    Args:
        num_layers, batch, kv_heads, head_dim: cache geometry (``v_head_dim`` defaults to
            ``head_dim``).
        dtype, device: of the K/V buffers.
        group: the sequence-parallel process group (default world).
        placement: ``"contiguous"`` or ``"interleaved"`` (see :mod:`treeattn.cache.placement`).
        block: block size of ``"interleaved"``.
        capacity: initial slots per rank (grown on demand).
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        placement: str = "interleaved",
        block: int = 1,
        capacity: int = 0,
        v_head_dim: int | None = None,
    ) -> None:
        self.rank, self.p = world(group)
        self.group = group
        err = None
        try:
            if placement not in PLACEMENTS:
                raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
            if min(num_layers, batch, kv_heads, head_dim, block) < 1 or capacity < 0:
                raise ValueError(
                    f"num_layers, batch, kv_heads, head_dim, block must be >= 1 and capacity >= 0, got "
                    f"{num_layers}, {batch}, {kv_heads}, {head_dim}, {block}, {capacity}"
                )
            if dtype not in _DT:
                raise ValueError(f"dtype must be a float dtype, got {dtype}")
        except ValueError as e:
            err = str(e)
        fields = {
            "num_layers": num_layers,
            "batch": batch,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "v_head_dim": v_head_dim or head_dim,
            "dtype": _DT.get(dtype, 0),
            "placement": PLACEMENTS.index(placement) if placement in PLACEMENTS else -1,
            "block": block,
        }
        agree(fields, err, group=group, show={"placement": dict(enumerate(PLACEMENTS))})
        self.placement = Placement(placement, self.p, block)
        self.num_layers, self.B, self.Hkv, self.D = num_layers, batch, kv_heads, head_dim
        self.Dv = v_head_dim or head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.cap = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.counts = torch.zeros(batch, self.p, dtype=torch.int64)  # valid tokens per rank, host
        self.positions = torch.zeros(batch, 0, dtype=torch.int64)  # global position of each local slot, host
        self.used = 0  # slots in use on this rank (max over the batch), host int
        self._step_rows: Tensor | None = None
        self._step_slots: Tensor | None = None
        self._grow(max(capacity, 1))

    # -- metadata --------------------------------------------------------------------
    @property
    def kv_lens(self) -> Tensor:
        """Valid local tokens per sequence, ``[B]`` int64 on the host."""
        return self.counts[:, self.rank]

    @property
    def seq_lens(self) -> Tensor:
        """Global length of every sequence, ``[B]`` int64 on the host."""
        return self.counts.sum(1)

    def memory_bytes(self) -> dict[str, int]:
        """Allocated and used bytes of this rank's K/V buffers (all layers)."""
        per_slot = self.num_layers * self.B * self.Hkv * (self.D + self.Dv) * torch.finfo(self.dtype).bits // 8
        return {"allocated": per_slot * self.cap, "used": per_slot * self.used}

    def _grow(self, need: int) -> None:
        if need <= self.cap:
            return
        cap = max(need, 2 * self.cap, 16)
        shape = (self.B, self.Hkv, cap)
        for i in range(self.num_layers):
            k = empty_huge(*shape, self.D, dtype=self.dtype, device=self.device)  # streamed every step
            v = empty_huge(*shape, self.Dv, dtype=self.dtype, device=self.device)
            if self.cap:
                k[:, :, : self.cap] = self.k[i]
                v[:, :, : self.cap] = self.v[i]
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)
        pos = torch.full((self.B, cap), -1, dtype=torch.int64)
        pos[:, : self.cap] = self.positions
        self.positions, self.cap = pos, cap

    # -- prefill ---------------------------------------------------------------------
    def begin_prefill(self, prompt_lens: Tensor, padded_len: int) -> Tensor:
        """Start a batch of right-padded prompts (lengths ``prompt_lens [B]``, padded to
        ``padded_len``). Returns the positions (``[n]`` int64, same for every sequence)
        this rank must run through the model and store with :meth:`store_prefill`; the
        slots beyond a sequence's length hold padding and are not counted as valid."""
        prompt_lens = prompt_lens.detach().to("cpu", torch.int64)
        if prompt_lens.shape != (self.B,) or bool((prompt_lens < 0).any()) or bool((prompt_lens > padded_len).any()):
            raise ValueError(f"prompt_lens must be [B]={self.B} ints in [0, {padded_len}], got {prompt_lens.tolist()}")
        if self.used:
            raise RuntimeError("begin_prefill on a cache that already holds tokens")
        mine = self.placement.prompt_positions(self.rank, padded_len)
        self._grow(len(mine))
        self.positions[:, : len(mine)] = mine
        self.counts = self.placement.prompt_counts(prompt_lens, padded_len)
        self.used = len(mine)
        return mine

    def store_prefill(self, layer: int, k: Tensor, v: Tensor, start: int = 0) -> None:
        """Store K/V ``[B, Hkv, n, D]`` of ``layer`` for this rank's prompt slots
        ``start .. start + n - 1`` (the positions returned by :meth:`begin_prefill`; a
        chunked prefill stores one chunk at a time)."""
        n = k.shape[2]
        if start < 0 or start + n > self.used:
            raise ValueError(f"prefill slots {start}..{start + n - 1} outside this rank's {self.used} prompt slots")
        self.k[layer][:, :, start : start + n] = k
        self.v[layer][:, :, start : start + n] = v

    # -- decode ----------------------------------------------------------------------
    def begin_decode_step(self) -> Tensor:
        """Place one new token per sequence (at position ``seq_lens[b]``). Returns the owner
        rank of each ``[B]``. Call once per step, before the layers' :meth:`store_decode`."""
        pos = self.seq_lens
        owner = self.placement.decode_owner(pos, self.counts)
        rows = torch.nonzero(owner == self.rank).flatten()
        slots = self.kv_lens[rows].clone()
        if len(rows):
            self._grow(int(slots.max()) + 1)
            self.positions[rows, slots] = pos[rows]
        self.counts[torch.arange(self.B), owner] += 1
        self.used = max(self.used, int(self.kv_lens.max()) if self.B else 0)
        self._step_rows = rows.to(self.device, non_blocking=True)
        self._step_slots = slots.to(self.device, non_blocking=True)
        return owner

    def store_decode(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store the new token's K/V ``[B, Hkv, 1, D]`` of ``layer`` for the sequences this
        rank owns this step."""
        if self._step_rows is None:
            raise RuntimeError("store_decode before begin_decode_step")
        r, s = self._step_rows, self._step_slots
        if len(r):
            self.k[layer][r, :, s] = k[r, :, 0]
            self.v[layer][r, :, s] = v[r, :, 0]

    def slots_before(self, bound: Tensor | int) -> Tensor:
        """Per sequence, how many of this rank's valid slots hold a global position
        ``< bound[b]`` (``bound``: int or ``[B]`` integer). Local slots are in increasing
        position order (both placements), so this is the first slot at or after the bound:
        the ``kv_start`` of a sliding window. ``[B]`` int64 on the host (no device sync)."""
        bound = torch.as_tensor(bound, dtype=torch.int64).expand(self.B)
        pos = self.positions[:, : self.used]
        valid = torch.arange(pos.shape[1])[None, :] < self.kv_lens[:, None]
        return ((pos < bound[:, None]) & valid).sum(1)

    def window_start(self, window: int | None, q_pos: Tensor) -> Tensor | None:
        """``kv_start`` (``[B]`` int64, on the cache's device) of queries at global positions
        ``q_pos [B]`` (host) under a sliding window: a query at ``P`` sees the keys at
        ``P - window < pos <= P`` (transformers' ``sliding_window``); None without a window
        (the same on every rank, as the collective decode functions need)."""
        if window is None:
            return None
        return self.slots_before(q_pos.to(torch.int64) - window + 1).to(self.device, non_blocking=True)

    def local(self, layer: int, stop: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(k, v, kv_lens)``: this rank's shard ``[B, Hkv, used, D]`` (views, no copy) and
        the valid length per sequence ``[B]`` on the cache's device — what
        :func:`treeattn.tree_decode` / :func:`treeattn.ring_decode` take. ``stop``: only the
        first ``stop`` slots (a chunked prefill's keys so far)."""
        stop = self.used if stop is None else min(stop, self.used)
        return (
            self.k[layer][:, :, :stop],
            self.v[layer][:, :, :stop],
            self.kv_lens.clone().to(self.device, non_blocking=True),
        )
