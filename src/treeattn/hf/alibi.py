"""ALiBi families (BLOOM, MPT), whose attention does not go through transformers' attention
interface: their attention layers get a forward, installed from outside (the model keeps no
treeattn code), that computes Q/K/V as the layer does, stores K/V in the sharded cache and
attends through :func:`~treeattn.hf.attention.treeattn_attention` with the layer's ALiBi
slopes. The bias is added from each key's global position on every shard
(:class:`treeattn.ops.Alibi`), so the result is exact like a softcap. Outside a treeattn step
(a plain transformers call) the layer runs its own forward."""

from __future__ import annotations

import math
import types

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..ops.alibi import alibi_slopes
from .attention import treeattn_attention
from .tensor_parallel import heads_here

__all__ = ["alibi_layers", "install", "mpt_slopes", "prepare"]


def mpt_slopes(n_heads: int, bias_max: float = 8.0) -> Tensor:
    """MPT's ALiBi slopes (float32 ``[n_heads]``: ``2^(-bias_max i / n)`` for ``n`` the next
    power of two, interleaved when ``n_heads`` is not one), as ``build_mpt_alibi_tensor``."""
    n = 2 ** math.ceil(math.log2(n_heads))
    base = torch.arange(1, n + 1, dtype=torch.int64).float() * (bias_max / n)
    s = 1.0 / torch.pow(2, base)
    if n != n_heads:
        s = torch.cat([s[1::2], s[::2]])[:n_heads]
    return s


def alibi_layers(model: nn.Module) -> list[nn.Module]:
    """The attention layers of ``model`` that add ALiBi biases (empty for other families)."""
    mt = getattr(model.config, "model_type", "")
    name = {"bloom": "BloomAttention", "mpt": "MptAttention"}.get(mt)
    return [] if name is None else [m for m in model.modules() if type(m).__name__ == name]


def install(model: nn.Module) -> bool:
    """Give every ALiBi attention layer of ``model`` treeattn's forward (once; idempotent).
    Returns whether ``model`` is an ALiBi model."""
    layers = alibi_layers(model)
    for m in layers:
        if "forward" not in vars(m):
            m.forward = types.MethodType(_FORWARDS[type(m).__name__], m)
    return bool(layers)


def _slopes(layer: nn.Module, make, device) -> Tensor:
    """The layer's heads' slopes on ``device`` (``make()``: every head's), kept on the layer."""
    key = (*heads_here(layer, layer.config_heads), device)
    hit = getattr(layer, "_treeattn_slopes", None)
    if hit is None or hit[0] != key:
        hit = layer._treeattn_slopes = (key, make()[key[0] : key[1]].to(device))
    return hit[1]


def _bloom(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
           output_attentions=False, **kwargs):  # fmt: skip
    ctx = getattr(layer_past, "ctx", None)
    if ctx is None:  # not a treeattn step: the layer's own forward
        return type(self).forward(self, hidden_states, residual, alibi, attention_mask, layer_past, use_cache,
                                  output_attentions, **kwargs)  # fmt: skip
    B, T, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # [B, H, T, D] each (this rank's heads)
    k, v = layer_past.update(k, v, self.layer_idx)
    slopes = _slopes(self, lambda: alibi_slopes(self.config_heads), q.device)  # (beta is 1: prepare)
    out, _ = treeattn_attention(self, q, k, v, None, scaling=self.inv_norm_factor, treeattn_ctx=ctx, alibi=slopes)
    out = out.reshape(B, T, -1)
    if self.pretraining_tp > 1 and self.slow_but_exact:  # as the layer sums its output projection (no bias)
        w, step = self.dense.weight, self.hidden_size / self.pretraining_tp
        y = torch.zeros_like(out)
        for i in range(self.pretraining_tp):
            a, b = int(i * step), int((i + 1) * step)
            y = y + F.linear(out[:, :, a:b], w[:, a:b])
        out = y
    else:
        out = self.dense(out)
    return residual + F.dropout(out, p=self.hidden_dropout, training=self.training), None


def _mpt(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    cache = kwargs.pop("past_key_values", cache)
    ctx = getattr(cache, "ctx", None)
    if ctx is None:
        return type(self).forward(self, hidden_states, position_bias, cache=cache, attention_mask=attention_mask,
                                  **kwargs)  # fmt: skip
    B, T = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (x.reshape(B, T, -1, self.head_dim).transpose(1, 2) for x in qkv.chunk(3, dim=2))
    k, v = cache.update(k, v, self.layer_idx)
    slopes = _slopes(self, lambda: mpt_slopes(self.config_heads, self.alibi_bias_max), q.device)
    out, _ = treeattn_attention(self, q, k, v, None, scaling=self.softmax_scale, treeattn_ctx=ctx, alibi=slopes)
    return self.out_proj(out.reshape(B, T, -1)), None


_FORWARDS = {"BloomAttention": _bloom, "MptAttention": _mpt}


def prepare(model: nn.Module) -> str | None:
    """Install treeattn's forward on ``model``'s ALiBi layers, with what it reads of the config;
    a reason when a layer cannot run exactly (None: it can, or no ALiBi layer)."""
    cfg = model.config
    for m in alibi_layers(model):
        if cfg.model_type == "bloom":
            m.config_heads = cfg.n_head
            if m.beta != 1.0:
                return f"BLOOM: attention beta {m.beta} (not 1.0) is not supported"
        else:
            a = cfg.attn_config
            if not getattr(a, "alibi", True):
                return "MPT without ALiBi (attn_config.alibi=False) is not supported"
            if getattr(a, "prefix_lm", False) or getattr(a, "qk_ln", False):
                return "MPT with prefix_lm or qk_ln is not supported"
            m.config_heads, m.alibi_bias_max = cfg.n_heads, float(a.alibi_bias_max)
    install(model)
    return None
