"""The ``treeattn`` attention implementation and a transformers Cache over ShardedKVCache."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache import ShardedKVCache
from ..ops.alibi import Alibi
from ..parallel import ring_decode, ring_prefill, tree_decode, tree_prefill
from .families import layer_window

ATTN_NAME = "treeattn"


@dataclass
class StepContext:
    """What the attention function needs for one forward pass (passed as the model kwarg
    ``treeattn_ctx``, which transformers forwards to the attention function)."""

    cache: ShardedKVCache
    mode: str  # "prefill" | "decode" (one token per sequence, stored first) | "step" (tentative tokens, not stored)
    # | "static" (a decode step whose slot, position and length are on the device: hf._graph)
    attention: str = "tree"  # "tree" | "ring"
    strategy: str = "auto"
    group: dist.ProcessGroup | None = None
    positions: list[Tensor] = field(default_factory=list)  # prefill: every rank's stored positions after this chunk
    q_positions: list[Tensor] = field(default_factory=list)  # prefill: every rank's positions in this chunk
    n_real: int = 0  # prefill: real tokens of this rank in this chunk (the rest is a placeholder)
    start: int = 0  # prefill: this rank's first slot of this chunk
    kv_lens: Tensor | None = None  # decode, step: local valid lengths on the device
    q_pos: Tensor | None = None  # decode: global position of each new token [B]; step: [B, T] (host)
    starts: dict = field(default_factory=dict)  # decode, step: kv_start per sliding window (once per step)
    tree: Tensor | None = None  # step: [T, T] bool, token i sees token j (j is i or an ancestor of i)
    depth: Tensor | None = None  # step: [T] depth of each token in the block (0 = hangs off the history)
    masks: dict = field(default_factory=dict)  # step: the block's mask per sliding window
    stash: dict = field(default_factory=dict)  # step: layer -> (k, v) [B, Hkv, T, D] of the block
    span: int = 0  # static: slots the attention reads (rows bounded by kv_lens)
    slot: Tensor | None = None  # static: [1] the new token's local slot, on the device
    pos: Tensor | None = None  # static: [B] the new token's position, on the device (at p = 1, its slot)
    heads: list[int] | None = None  # decode, step: cut points of the query heads the Tree reduction scatters
    # over the ranks (a mesh's KVP ranks split their slice's heads; the output projection takes them)
    positions_here: tuple[Tensor, Tensor] | None = None  # decode, step: (q_pos, k_pos) on the device (ALiBi)

    def alibi(self, slopes: Tensor, S: int) -> Alibi:
        """Decode, step: the ALiBi bias of this step's queries over the first ``S`` local slots."""
        if self.positions_here is None:  # once per step: the layers share it
            c = self.cache
            self.positions_here = (self.q_pos.clone().to(c.device, non_blocking=True),
                                   c.positions[:, : c.used].clone().to(c.device, non_blocking=True))  # fmt: skip
        qp, kp = self.positions_here
        return Alibi(slopes, qp, kp[:, :S])

    def window_start(self, window: int | None) -> Tensor | None:
        """Decode, step: this rank's first visible slot per query under ``window`` (None: no window)."""
        if window is None:
            return None
        if self.mode == "static":  # p = 1: a slot is its position
            return (self.pos - (window - 1)).clamp_min(0)
        if window not in self.starts:
            self.starts[window] = self.cache.window_start(window, self.q_pos)
        return self.starts[window]

    def chain(self) -> bool:
        """Step: the block is a chain (token i at depth i: each sees the tokens before it)."""
        if "chain" not in self.masks:  # depth is host metadata (hf._model.tree_of)
            self.masks["chain"] = bool(torch.equal(self.depth, torch.arange(len(self.depth))))
        return self.masks["chain"]

    def block_mask(self, window: int | None) -> Tensor:
        """Step: which tokens of the block each token sees (its ancestors and itself, within
        ``window`` positions), ``[T, T]`` bool on the cache's device."""
        if window not in self.masks:
            m = self.tree
            if window is not None:
                m = m & ((self.depth[:, None] - self.depth[None, :]) < window)
            self.masks[window] = m.to(self.cache.device)
        return self.masks[window]


class _Layer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, owner: TreeAttnCache, idx: int) -> None:
        super().__init__()
        self.owner, self.idx = owner, idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        ctx = self.owner.ctx
        if ctx is None:
            raise RuntimeError("TreeAttnCache is driven by a treeattn.hf.Session (no step context set)")
        if ctx.mode == "prefill":
            n = ctx.n_real
            self.owner.sharded.store_prefill(self.idx, key_states[:, :, :n], value_states[:, :, :n], ctx.start)
        elif ctx.mode in ("step", "rows"):  # kept aside: stored by keep() / the batch runner
            ctx.stash[self.idx] = (key_states, value_states)
        elif ctx.mode == "static":  # at the slot on the device (a replayed graph's host passes nothing)
            self.owner.sharded.store_at(self.idx, key_states, value_states, ctx.slot)
        else:
            self.owner.sharded.store_decode(self.idx, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        s = self.owner.sharded.seq_lens
        return int(s.max()) if len(s) else 0  # host metadata: global length, not the shard's

    def get_max_length(self) -> int:
        return -1


class TreeAttnCache(Cache):
    """A transformers ``Cache`` whose layers store into a :class:`ShardedKVCache`. It reports
    the *global* sequence length (the longest sequence of the batch), so positions and RoPE
    stay right even though this rank holds only a shard."""

    def __init__(self, sharded: ShardedKVCache) -> None:
        self.sharded = sharded
        self.ctx: StepContext | None = None
        super().__init__(layers=[_Layer(self, i) for i in range(sharded.num_layers)])


def treeattn_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: Tree (or Ring) prefill, then Tree (or Ring) decoding
    over the sharded cache, honouring the layer's ``sliding_window`` (on global positions)
    and ``softcap``. ``query [B, Hq, T, D]``; returns ``[B, T, Hq, D]``."""
    ctx: StepContext | None = kwargs.get("treeattn_ctx")
    if ctx is None:
        raise RuntimeError("the 'treeattn' attention implementation runs inside a treeattn.hf.Session")
    _refuse(module, dropout, kwargs)
    window = layer_window(module, kwargs)
    softcap = kwargs.get("softcap")
    slopes = kwargs.get("alibi")  # ALiBi slopes of this rank's query heads (hf.alibi's layers pass them)
    if slopes is not None and ctx.mode in ("rows", "static"):
        raise ValueError(f"{type(module).__name__}: ALiBi biases in a {ctx.mode!r} step are not implemented")
    if ctx.mode == "rows":  # a batched step over shared prefixes (hf._cascade)
        out = ctx.attend(module.layer_idx, query, key, value, scaling, window, softcap)
    elif ctx.mode == "prefill":
        n, rank = ctx.n_real, ctx.cache.rank
        stop = len(ctx.positions[rank])  # this rank's keys up to and including this chunk (stored above)
        k, v = ctx.cache.shard(module.layer_idx, stop)
        if ctx.attention == "ring":
            out = ring_prefill(
                query[:, :, :n],
                k,
                v,
                ctx.positions,
                group=ctx.group,
                scale=scaling,
                q_positions=ctx.q_positions[rank],
                window=window,
                softcap=softcap,
                alibi=slopes,
            )
        else:
            out = tree_prefill(
                query[:, :, :n],
                k,
                v,
                ctx.q_positions,
                ctx.positions[rank],
                group=ctx.group,
                scale=scaling,
                strategy=ctx.strategy,
                window=window,
                softcap=softcap,
                alibi=slopes,
            )
        if n < query.shape[2]:  # placeholder token of a rank that holds no prompt token
            out = torch.cat([out, out.new_zeros(*out.shape[:2], query.shape[2] - n, out.shape[3])], 2)
    else:
        c = ctx.cache
        k, v = c.span(module.layer_idx, ctx.span) if ctx.mode == "static" else c.shard(module.layer_idx)
        kw = dict(kv_lens=ctx.kv_lens, kv_start=ctx.window_start(window), softcap=softcap, group=ctx.group,
                  alibi=None if slopes is None else ctx.alibi(slopes, k.shape[2]))  # fmt: skip
        if ctx.mode == "step":  # the block's own tokens: new_k/new_v under the tree mask; a chain on the
            # CPU: causal bounds in the compiled kernel (elsewhere the step's cached mask, built once)
            chain = query.device.type == "cpu" and ctx.chain()
            kw.update(new_k=key, new_v=value, new_mask=None if chain else ctx.block_mask(window), window=window)
        if ctx.attention == "ring":
            out = ring_decode(query, k, v, scale=scaling, check=False, **kw)
        else:
            out = tree_decode(query, k, v, scale=scaling, strategy=ctx.strategy, check=False, heads=ctx.heads, **kw)
    return out.transpose(1, 2).contiguous(), None


def _refuse(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """What the layer asks for that treeattn cannot do exactly (the config was checked by
    :func:`treeattn.hf.unsupported_reason`; this catches what only the layer knows)."""
    name = type(module).__name__
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"{name}: attention sinks are not supported by treeattn")
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{name}: non-causal (bidirectional) attention is not supported by treeattn")
    if dropout:
        raise ValueError(f"{name}: attention dropout {dropout} (training mode) is not supported; call model.eval()")


AttentionInterface.register(ATTN_NAME, treeattn_attention)


class AttnSwitch:
    """``with switch():`` runs the model with treeattn's attention, and puts back what it had.
    The first switch goes through transformers' ``set_attn_implementation`` (it validates, and
    walks every module); later ones set the same configs directly: a decode step switches
    once per call, and the walk cost milliseconds per token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.configs = model, None

    @contextlib.contextmanager
    def __call__(self):
        m = self.model
        if m.config._attn_implementation == ATTN_NAME:  # nested, or the user's own choice
            yield
            return
        if self.configs is None:
            cfgs = {id(c): c for c in [m.config] + [x.config for x in m.modules() if hasattr(x, "config")]}
            before = {i: c._attn_implementation_internal for i, c in cfgs.items()}
            if getattr(m.config, "model_type", "") == "bloom":  # its layers take treeattn's forward (hf.alibi):
                for c in cfgs.values():  # the name only skips the dense causal mask (MPT's forward needs one)
                    c._attn_implementation_internal = ATTN_NAME
            elif getattr(m.config, "model_type", "") != "mpt":
                m.set_attn_implementation(ATTN_NAME)
            self.configs = [c for i, c in cfgs.items() if c._attn_implementation_internal != before[i]]
            saved = [(c, before[id(c)]) for c in self.configs]
        else:
            saved = [(c, c._attn_implementation_internal) for c in self.configs]
            for c, _ in saved:
                c._attn_implementation_internal = ATTN_NAME
        try:
            yield
        finally:
            for c, v in saved:
                c._attn_implementation_internal = v
