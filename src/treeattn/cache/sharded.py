"""ShardedKVCache: this rank's K/V shard of every sequence, per layer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._host import empty_huge
from ..comm.collectives import world
from ..comm.validate import agree
from ..dtypes import code
from .placement import PLACEMENTS, Placement


class ShardedKVCache:
    """Per layer, this rank's K/V of every sequence of a batch, with global positions.

    Slots ``0 .. kv_lens[b] - 1`` of sequence ``b`` hold its valid local tokens in increasing
    position order (``positions[b, slot]``). Capacity grows geometrically (amortised O(1)
    per token, never a full copy per step) but not past ``slot_limit`` (when set: the most
    slots this rank is expected to need; a soft cap, a larger need still grows to it).
    Metadata (counts per rank, positions) lives on the host and is derived from prompt
    lengths, so the per-step path does no host sync.

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
            if code(dtype) is None:
                raise ValueError(f"dtype must be a float dtype, got {dtype}")
        except ValueError as e:
            err = str(e)
        fields = {
            "num_layers": num_layers,
            "batch": batch,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "v_head_dim": v_head_dim or head_dim,
            "dtype": str(dtype).removeprefix("torch."),
            "placement": placement if isinstance(placement, str) else None,
            "block": block,
        }
        agree(fields, err, group=group)
        self.placement = Placement(placement, self.p, block)
        self.num_layers, self.B, self.Hkv, self.D = num_layers, batch, kv_heads, head_dim
        self.Dv = v_head_dim or head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.cap = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.counts = torch.zeros(batch, self.p, dtype=torch.int64)  # valid tokens per rank, host
        self.positions = torch.zeros(batch, 0, dtype=torch.int64)  # global position of each local slot, host
        self.owner = torch.full((batch, 0), -1, dtype=torch.int16)  # rank of every global position, host
        self.used = 0  # slots in use on this rank (max over the batch), host int
        self._uniform = True  # every sequence has the same length and layout
        self._step_rows: Tensor | None = None
        self._step_slots: Tensor | None = None
        self._step_slot: int | None = None  # every sequence's step token here, at this one slot
        self.slot_limit: int | None = None
        self.version = 0  # bumped whenever the K/V buffers are reallocated (a CUDA graph holds their addresses)
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
        cap = max(2 * self.cap, 16)
        cap = max(need, min(cap, self.slot_limit) if self.slot_limit else cap)
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
        self.version += 1

    def reserve(self, slots: int) -> None:
        """Capacity for at least ``slots`` slots per sequence (grown as :meth:`place` grows it)."""
        self._grow(slots)

    def _grow_global(self, need: int) -> None:
        if need > self.owner.shape[1]:
            own = torch.full((self.B, max(need, 2 * self.owner.shape[1], 16)), -1, dtype=torch.int16)
            own[:, : self.owner.shape[1]] = self.owner
            self.owner = own

    def rank_positions(self, rank: int, b: int = 0) -> Tensor:
        """Global positions ``[n]`` (int64, host, increasing) of sequence ``b``'s valid tokens
        on ``rank`` (every rank knows the whole layout)."""
        return torch.nonzero(self.owner[b, : int(self.seq_lens[b])] == rank).flatten()

    def uniform(self) -> bool:
        """Whether every sequence has the same length and the same layout (a batch that was
        never ragged, or rewound to where it was not): then one list of positions per rank
        describes all of them."""
        return self._uniform

    def _check_uniform(self) -> bool:
        L = self.seq_lens
        n = int(L[0]) if self.B else 0
        return bool((L == n).all()) and bool((self.owner[:, :n] == self.owner[:1, :n]).all())

    # -- appending -------------------------------------------------------------------
    def begin_extend(self, lens: Tensor, padded_len: int) -> tuple[list[Tensor], int]:
        """Append a right-padded block of ``padded_len`` tokens to every sequence (``lens [B]``
        of them real) after its valid tokens; the cache must be :meth:`uniform`. Positions
        go by :meth:`Placement.block_owners` (an empty cache: the prompt split). Returns every
        rank's new global positions (``[n_r]`` int64 each, the same for every sequence) and
        this rank's first slot for them; store the block with :meth:`store_prefill`."""
        lens = lens.detach().to("cpu", torch.int64)
        if lens.shape != (self.B,) or bool((lens < 0).any()) or bool((lens > padded_len).any()):
            raise ValueError(f"prompt_lens must be [B]={self.B} ints in [0, {padded_len}], got {lens.tolist()}")
        if not self.uniform():
            raise ValueError("a block of tokens needs every sequence at the same length and layout (uniform cache)")
        L0, base = int(self.seq_lens[0]), int(self.kv_lens[0])
        own = self.placement.block_owners(self.counts[0], L0, padded_len, prompt=True)
        new = [torch.nonzero(own == r).flatten() + L0 for r in range(self.p)]
        mine = new[self.rank]
        self._grow(base + len(mine))
        self._grow_global(L0 + padded_len)
        self.positions[:, base : base + len(mine)] = mine
        real = torch.arange(padded_len)[None, :] < lens[:, None]  # [B, padded]
        self.owner[:, L0 : L0 + padded_len] = torch.where(real, own[None, :].to(torch.int16), -1)
        self.counts += torch.stack([(real & (own == r)[None, :]).sum(1) for r in range(self.p)], 1)
        self.used = max(self.used, base + len(mine))
        self._uniform = bool((lens == lens[0]).all()) if self.B else True
        return new, base

    def begin_prefill(self, prompt_lens: Tensor, padded_len: int) -> Tensor:
        """Start a batch of right-padded prompts (lengths ``prompt_lens [B]``, padded to
        ``padded_len``) on an empty cache. Returns the positions (``[n]`` int64, same for every
        sequence) this rank must run through the model and store with :meth:`store_prefill`;
        the slots beyond a sequence's length hold padding and are not counted as valid."""
        if self.used:
            raise RuntimeError("begin_prefill on a cache that already holds tokens")
        return self.begin_extend(prompt_lens, padded_len)[0][self.rank]

    def store_prefill(self, layer: int, k: Tensor, v: Tensor, start: int = 0) -> None:
        """Store K/V ``[B, Hkv, n, D]`` of ``layer`` for this rank's slots ``start .. start + n - 1``
        (the positions returned by :meth:`begin_prefill` / :meth:`begin_extend`; a chunked
        prefill stores one chunk at a time)."""
        n = k.shape[2]
        if start < 0 or start + n > self.used:
            raise ValueError(f"prefill slots {start}..{start + n - 1} outside this rank's {self.used} prompt slots")
        self.k[layer][:, :, start : start + n] = k
        self.v[layer][:, :, start : start + n] = v

    def place(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Append ``n`` tokens to every sequence (positions ``seq_lens[b] + j``), each on the
        rank :meth:`Placement.decode_owner` gives it, one after another. Returns this rank's
        share as host index tensors ``(b, j, slot)``: token ``j`` of sequence ``b`` goes to
        local slot ``slot`` (store it with :meth:`store_slots`)."""
        L = self.seq_lens.clone()
        if self._uniform:
            own = self.placement.block_owners(self.counts[0], int(L[0]), n).expand(self.B, n)
        else:
            c, cols = self.counts.clone(), []
            for j in range(n):
                cols.append(self.placement.decode_owner(L + j, c))
                c[torch.arange(self.B), cols[-1]] += 1
            own = torch.stack(cols, 1) if cols else torch.zeros(self.B, 0, dtype=torch.int64)
        mine = own == self.rank  # [B, n]
        b_idx, j_idx = torch.nonzero(mine, as_tuple=True)
        slots = self.kv_lens[b_idx] + (mine.cumsum(1) - 1)[b_idx, j_idx]
        if len(b_idx):
            self._grow(int(slots.max()) + 1)
            self.positions[b_idx, slots] = L[b_idx] + j_idx
        self._grow_global(int(L.max()) + n)
        rows = torch.arange(self.B)[:, None]
        self.owner[rows, L[:, None] + torch.arange(n)[None, :]] = own.to(torch.int16)
        self.counts += torch.stack([(own == r).sum(1) for r in range(self.p)], 1)
        self.used = max(self.used, int(self.kv_lens.max()) if self.B else 0)
        return b_idx, j_idx, slots

    def store_slots(self, layer: int, b: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store K/V ``[N, Hkv, D]`` of ``layer`` at local ``slots [N]`` of sequences ``b [N]``."""
        if len(b) and self.B == 1:  # one sequence: a copy along the slots (~25 % faster than two indices)
            self.k[layer][0].index_copy_(1, slots, k.transpose(0, 1))
            self.v[layer][0].index_copy_(1, slots, v.transpose(0, 1))
        elif len(b):
            self.k[layer][b, :, slots] = k
            self.v[layer][b, :, slots] = v

    def store_span(self, layer: int, slot: int, k: Tensor, v: Tensor) -> None:
        """Store K/V ``[B, Hkv, m, D]`` of ``layer`` at local slots ``slot .. slot + m - 1`` of
        every sequence (one copy each: a kept chain's run of slots)."""
        m = k.shape[2]
        self.k[layer][:, :, slot : slot + m].copy_(k)
        self.v[layer][:, :, slot : slot + m].copy_(v)

    def rewind(self, n: int | Tensor) -> None:
        """Forget every token at global position ``>= n`` (an int, or ``[B]`` per sequence):
        they are no longer valid on any rank, and later tokens take their slots."""
        n = torch.as_tensor(n, dtype=torch.int64).expand(self.B)
        if bool((n < 0).any()):
            raise ValueError(f"rewind positions must be >= 0, got {n.tolist()}")
        self.owner[torch.arange(self.owner.shape[1])[None, :] >= n[:, None]] = -1
        own = self.owner.to(torch.int64)
        self.counts = torch.stack([(own == r).sum(1) for r in range(self.p)], 1)
        keep = torch.arange(self.cap)[None, :] < self.kv_lens[:, None]
        self.positions = torch.where(keep, self.positions, -1)
        self.used = int(self.kv_lens.max()) if self.B else 0
        self._uniform = self._check_uniform()
        self._step_rows = self._step_slots = self._step_slot = None

    # -- decode ----------------------------------------------------------------------
    def begin_decode_step(self) -> Tensor:
        """Place one new token per sequence (at position ``seq_lens[b]``). Returns the owner
        rank of each ``[B]``. Call once per step, before the layers' :meth:`store_decode`."""
        rows, _, slots = self.place(1)
        self._step_rows = rows.to(self.device, non_blocking=True)
        self._step_slots = slots.to(self.device, non_blocking=True)
        # (host tensors: no sync) one slot for all: each layer stores with one copy, no index kernels
        one = len(rows) == self.B > 0 and bool((slots == slots[0]).all())
        self._step_slot = int(slots[0]) if one else None
        return self.owner[torch.arange(self.B), self.seq_lens - 1].to(torch.int64)

    @property
    def step_targets(self) -> tuple[Tensor, Tensor]:
        """The decode step's ``(sequences, local slots)`` this rank stores (device int64), set by
        :meth:`begin_decode_step`."""
        if self._step_rows is None:
            raise RuntimeError("step_targets before begin_decode_step")
        return self._step_rows, self._step_slots

    def store_decode(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store the new token's K/V ``[B, Hkv, 1, D]`` of ``layer`` for the sequences this
        rank owns this step."""
        if self._step_rows is None:
            raise RuntimeError("store_decode before begin_decode_step")
        if self._step_slot is not None:
            i = self._step_slot
            self.k[layer][:, :, i : i + 1].copy_(k)
            self.v[layer][:, :, i : i + 1].copy_(v)
            return
        r, s = self._step_rows, self._step_slots
        if len(r):
            self.k[layer][r, :, s] = k[r, :, 0]
            self.v[layer][r, :, s] = v[r, :, 0]

    def store_at(self, layer: int, k: Tensor, v: Tensor, slot: Tensor) -> None:
        """Store K/V ``[B, Hkv, 1, D]`` of ``layer`` at the local slot ``slot`` (``[1]`` int64 on the
        cache's device, the same for every sequence): a store whose slot the host does not pass
        (a captured decode step, :mod:`treeattn.runtime._graph`). The host metadata is
        :meth:`begin_decode_step`'s."""
        # the slot is read on the device when the kernel runs (a replayed graph reads it anew)
        self.k[layer].scatter_(2, slot.view(1, 1, 1, 1).expand(k.shape), k)
        self.v[layer].scatter_(2, slot.view(1, 1, 1, 1).expand(v.shape), v)

    def slots_before(self, bound: Tensor | int) -> Tensor:
        """Per sequence (or per query), how many of this rank's valid slots hold a global
        position ``< bound`` (``bound``: int, ``[B]`` or ``[B, T]`` integer). Local slots are in
        increasing position order (both placements), so this is the first slot at or after
        the bound: the ``kv_start`` of a sliding window. Same shape as ``bound`` (an int:
        ``[B]``), int64 on the host (no device sync)."""
        bound = torch.as_tensor(bound, dtype=torch.int64)
        bound = bound.expand(self.B) if bound.ndim < 2 else bound
        pos = self.positions[:, : self.used]
        valid = torch.arange(pos.shape[1])[None, :] < self.kv_lens[:, None]
        pos = torch.where(valid, pos, torch.iinfo(torch.int64).max)  # sorted rows: valid prefix, then the max
        return torch.searchsorted(pos, bound.reshape(self.B, -1).contiguous()).reshape(bound.shape)

    def window_start(self, window: int | None, q_pos: Tensor) -> Tensor | None:
        """``kv_start`` (``[B]`` or ``[B, T]`` int64, on the cache's device) of queries at global
        positions ``q_pos [B]`` or ``[B, T]`` (host) under a sliding window: a query at ``P`` sees the keys at
        ``P - window < pos <= P`` (transformers' ``sliding_window``); None without a window
        (the same on every rank, as the collective decode functions need)."""
        if window is None:
            return None
        return self.slots_before(q_pos.to(torch.int64) - window + 1).to(self.device, non_blocking=True)

    def lens_on_device(self) -> Tensor | None:
        """The valid length per sequence ``[B]`` on the cache's device, or None when every
        sequence's is :attr:`used` (then :meth:`shard`'s slots are all valid: no bound to pass,
        no copy to the device, no per-row bounds in the kernels). Decided on the host."""
        if self.B and bool((self.kv_lens == self.used).all()):
            return None
        return self.kv_lens.clone().to(self.device, non_blocking=True)

    def shard(self, layer: int, stop: int | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`local`'s ``(k, v)`` views alone (no copy of the lengths to the device)."""
        stop = self.used if stop is None else min(stop, self.used)
        return self.k[layer][:, :, :stop], self.v[layer][:, :, :stop]

    def span(self, layer: int, n: int) -> tuple[Tensor, Tensor]:
        """The first ``n <= cap`` slots of ``layer``'s K/V, valid or not (views): the caller bounds
        every row by its valid length on the device."""
        if n > self.cap:
            raise ValueError(f"span of {n} slots beyond the capacity {self.cap}; reserve() first")
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

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
