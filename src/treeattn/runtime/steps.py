"""The kinds of step a :class:`~treeattn.runtime.runner.ModelRunner` runs, each one forward of the
transformers model with the ``"treeattn"`` attention implementation. A step is a value the
layers read (passed as the model kwarg ``treeattn_ctx``): :meth:`Step.store` is what a layer
does with its new K/V (through the transformers Cache), :meth:`Step.attend` how it attends.

- :class:`Prefill`: a chunk of prompt tokens, each rank its own; stored at once; Tree or Ring.
- :class:`Decode`: one token per sequence, stored on its owner first, then attended over the cache.
- :class:`TokenTree`: tentative tokens (a chain or a token tree) after the cache, kept aside.
- :class:`Static`: a decode step whose slot, position and length sit on the device (a CUDA graph).
- :class:`~treeattn.runtime._cascade.RowsStep`: a batched step of many rows over shared prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..cache import ShardedKVCache
from ..hf.attention import Step
from ..ops.alibi import Alibi
from ..parallel import ring_decode, ring_prefill, tree_decode, tree_prefill


def no_alibi(step: Step, alibi: Tensor | None) -> None:
    if alibi is not None:
        raise ValueError(f"ALiBi biases in a {type(step).__name__} step are not implemented")


@dataclass
class Prefill(Step):
    """A chunk of prompt tokens: this rank runs ``n_real`` of them (the rest is a placeholder of a
    rank that holds none), stores them at slot ``start``, and attends by ``how`` ("tree" or "ring")."""

    cache: ShardedKVCache
    how: str
    strategy: str
    group: dist.ProcessGroup | None
    positions: list[Tensor]  # every rank's stored positions after this chunk
    q_positions: list[Tensor]  # every rank's positions in this chunk
    n_real: int
    start: int

    def store(self, layer: int, k: Tensor, v: Tensor) -> None:
        n = self.n_real
        self.cache.store_prefill(layer, k[:, :, :n], v[:, :, :n], self.start)

    def attend(self, layer, q, k, v, scale, window, softcap, alibi):
        n, rank = self.n_real, self.cache.rank
        ks, vs = self.cache.shard(layer, len(self.positions[rank]))  # up to and including this chunk
        kw = dict(group=self.group, scale=scale, window=window, softcap=softcap, alibi=alibi)
        if self.how == "ring":
            out = ring_prefill(q[:, :, :n], ks, vs, self.positions, q_positions=self.q_positions[rank], **kw)
        else:
            out = tree_prefill(q[:, :, :n], ks, vs, self.q_positions, self.positions[rank], strategy=self.strategy, **kw)
        if n < q.shape[2]:  # the placeholder's output: zeros
            out = torch.cat([out, out.new_zeros(*out.shape[:2], q.shape[2] - n, out.shape[3])], 2)
        return out


@dataclass
class Decode(Step):
    """One token per sequence at ``q_pos [B]`` (host), stored on its owner (the cache's
    :meth:`~treeattn.cache.ShardedKVCache.begin_decode_step`), then attended over the cache."""

    cache: ShardedKVCache
    attention: str  # "tree" | "ring"
    strategy: str
    group: dist.ProcessGroup | None
    kv_lens: Tensor  # local valid lengths on the device
    q_pos: Tensor
    heads: list[int] | None = None  # cut points of the query heads the Tree reduction scatters over the
    # ranks (a mesh's KVP ranks split their slice's heads; the output projection takes them)
    starts: dict = field(default_factory=dict)  # kv_start per sliding window (once per step)
    positions_here: tuple[Tensor, Tensor] | None = None  # (q_pos, k_pos) on the device (ALiBi)

    def store(self, layer, k, v):
        self.cache.store_decode(layer, k, v)

    def window_start(self, window: int | None) -> Tensor | None:
        """This rank's first visible slot per query under ``window`` (None: no window)."""
        if window is None:
            return None
        if window not in self.starts:
            self.starts[window] = self.cache.window_start(window, self.q_pos)
        return self.starts[window]

    def alibi(self, slopes: Tensor, S: int) -> Alibi:
        """The ALiBi bias of this step's queries over the first ``S`` local slots."""
        if self.positions_here is None:  # once per step: the layers share it
            c = self.cache
            self.positions_here = (self.q_pos.clone().to(c.device, non_blocking=True),
                                   c.positions[:, : c.used].clone().to(c.device, non_blocking=True))  # fmt: skip
        qp, kp = self.positions_here
        return Alibi(slopes, qp, kp[:, :S])

    def _keys(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.cache.shard(layer)

    def _new(self, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> dict:
        return {}

    def attend(self, layer, q, k, v, scale, window, softcap, alibi):
        ks, vs = self._keys(layer)
        kw = dict(kv_lens=self.kv_lens, kv_start=self.window_start(window), softcap=softcap, group=self.group,
                  alibi=None if alibi is None else self.alibi(alibi, ks.shape[2]), **self._new(q, k, v, window))  # fmt: skip
        if self.attention == "ring":
            return ring_decode(q, ks, vs, scale=scale, check=False, **kw)
        return tree_decode(q, ks, vs, scale=scale, strategy=self.strategy, check=False, heads=self.heads, **kw)


@dataclass
class TokenTree(Decode):
    """Tentative tokens ``[B, T]`` at ``q_pos [B, T]`` after the cache, in a token tree (a chain is
    one): each sees the cache and its ancestors in the block. Their K/V wait in ``stash``."""

    tree: Tensor | None = None  # [T, T] bool, token i sees token j (j is i or an ancestor of i)
    depth: Tensor | None = None  # [T] depth of each token in the block (0 = hangs off the history)
    masks: dict = field(default_factory=dict)  # the block's mask per sliding window
    stash: dict = field(default_factory=dict)  # layer -> (k, v) [B, Hkv, T, D] of the block

    def store(self, layer, k, v):
        self.stash[layer] = (k, v)

    def chain(self) -> bool:
        """The block is a chain (token i at depth i: each sees the tokens before it)."""
        if "chain" not in self.masks:  # depth is host metadata (runtime.inputs.tree_of)
            self.masks["chain"] = bool(torch.equal(self.depth, torch.arange(len(self.depth))))
        return self.masks["chain"]

    def block_mask(self, window: int | None) -> Tensor:
        """Which tokens of the block each token sees (its ancestors and itself, within ``window``
        positions), ``[T, T]`` bool on the cache's device."""
        if window not in self.masks:
            m = self.tree
            if window is not None:
                m = m & ((self.depth[:, None] - self.depth[None, :]) < window)
            self.masks[window] = m.to(self.cache.device)
        return self.masks[window]

    def _new(self, q, k, v, window):
        # a chain on the CPU: causal bounds in the compiled kernel (elsewhere the cached mask, built once)
        chain = q.device.type == "cpu" and self.chain()
        return dict(new_k=k, new_v=v, new_mask=None if chain else self.block_mask(window), window=window)


@dataclass
class Static(Decode):
    """A decode step at p = 1 whose new token's ``slot [1]``, position ``pos [B]`` (its slot) and
    ``kv_lens`` are on the device, reading ``span`` slots (:mod:`treeattn.runtime._graph`): nothing the
    host passes changes between replays of a captured graph."""

    span: int = 0
    slot: Tensor | None = None
    pos: Tensor | None = None

    def store(self, layer, k, v):
        self.cache.store_at(layer, k, v, self.slot)

    def window_start(self, window):
        return None if window is None else (self.pos - (window - 1)).clamp_min(0)

    def _keys(self, layer):
        return self.cache.span(layer, self.span)

    def attend(self, layer, q, k, v, scale, window, softcap, alibi):
        no_alibi(self, alibi)
        return super().attend(layer, q, k, v, scale, window, softcap, None)
