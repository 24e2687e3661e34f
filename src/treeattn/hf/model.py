"""What treeattn needs of a transformers model, with no state of its own: the model check,
the LM head's logits and the cache keyword of its forward."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from ._head import split_head
from .alibi import alibi_layers, prepare
from .families import unsupported_reason


def lm_logits(model: torch.nn.Module, hidden: Tensor, group=None, split: bool = False) -> Tensor:
    """float32 logits (float64 for a float64 model) of the LM head for hidden states
    ``[..., hidden]`` (the model's own final-logit softcapping, e.g. Gemma-2, applied as its
    ``forward`` does). ``split``: every rank of ``group`` holds the same ``hidden`` and calls
    this alike; on CPUs each computes a slice of the vocabulary (:mod:`treeattn.hf._head`)."""
    logits = split_head(model, hidden, group) if split else None
    if logits is None:
        logits = model.get_output_embeddings()(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@functools.cache
def _cache_name(forward_cls: type) -> str:
    names = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def cache_kw(decoder: torch.nn.Module, cache) -> dict:
    """The cache keyword of the decoder's forward: ``cache`` (transformers >= 5.24, where
    ``past_key_values`` is deprecated) or ``past_key_values``."""
    return {_cache_name(type(decoder)): cache}


def model_problem(model: torch.nn.Module) -> str | None:
    """Why treeattn cannot run ``model`` exactly, or None. An ALiBi family's attention layers
    (BLOOM, MPT) get treeattn's forward here (:func:`treeattn.hf.alibi.prepare`)."""
    if getattr(model, "config", None) is None:
        return f"model must be a transformers model with a .config, got {type(model).__name__}"
    why = unsupported_reason(model.config, training=model.training)
    if why is None and alibi_layers(model):  # their layers take treeattn's forward
        return prepare(model)
    if why is None and not getattr(model, "_supports_attention_backend", False):
        why = (
            f"{type(model).__name__}: its attention does not go through transformers' attention interface, "
            "so treeattn cannot run it"
        )
    return why
