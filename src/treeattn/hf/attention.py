"""The ``treeattn`` attention implementation and a transformers Cache over ShardedKVCache."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache import ShardedKVCache
from .families import layer_window

ATTN_NAME = "treeattn"


class Step:
    """One forward's kind: how its layers store their new K/V and attend. ``q [B, Hq, T, D]``,
    the new tokens' ``k, v [B, Hkv, T, D]``; :meth:`attend` returns ``[B, Hq, T, Dv]``."""

    def store(self, layer: int, k: Tensor, v: Tensor) -> None:
        raise NotImplementedError

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float | None, window: int | None,
               softcap: float | None, alibi: Tensor | None) -> Tensor:  # fmt: skip
        raise NotImplementedError


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
            raise RuntimeError("TreeAttnCache is driven by a treeattn.runtime.Session (no step context set)")
        ctx.store(self.idx, key_states, value_states)
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
        self.ctx: Step | None = None
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
    ctx: Step | None = kwargs.get("treeattn_ctx")
    if ctx is None:
        raise RuntimeError("the 'treeattn' attention implementation runs inside a treeattn.runtime.Session")
    _refuse(module, dropout, kwargs)
    slopes = kwargs.get("alibi")  # ALiBi slopes of this rank's query heads (hf.alibi's layers pass them)
    out = ctx.attend(module.layer_idx, query, key, value, scaling, layer_window(module, kwargs), kwargs.get("softcap"),
                     slopes)  # fmt: skip
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
