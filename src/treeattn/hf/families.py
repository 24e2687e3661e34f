"""Which transformers model families treeattn runs exactly, and why the others are refused."""

from __future__ import annotations

__all__ = ["unsupported_reason", "layer_window", "max_positions"]

# families whose softmax has a learned per-head "sink" logit (passed as ``s_aux``/``sinks``)
_SINKS = {
    "gpt_oss": "GPT-OSS",
    "granite_swa": "Granite SWA",
    "granitemoe_swa": "GraniteMoE SWA",
    "mimo_v2_flash": "MiMo-V2-Flash",
    "flint": "Flint",
    "inkling2": "Inkling-2",
    "deepseek_v4": "DeepSeek-V4",
}
_NAMES = {
    "llama": "Llama",
    "llama4": "Llama-4",
    "llama4_text": "Llama-4",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "gemma2": "Gemma-2",
    "gemma3": "Gemma-3",
    "gemma3_text": "Gemma-3",
    "bloom": "BLOOM",
    "mpt": "MPT",
    **_SINKS,
}


def _family(cfg) -> str:
    mt = getattr(cfg, "model_type", "") or type(cfg).__name__
    name = _NAMES.get(mt)
    return f"{name} ({mt})" if name else mt


def unsupported_reason(config, *, training: bool = False) -> str | None:
    """Why treeattn cannot generate *exactly* (tokens identical to single-process
    transformers) with a model of this config, or None when it can.

    Supported: causal decoder-only attention through transformers' attention interface
    with full or sliding-window layers (Mistral, Qwen2 ``use_sliding_window``, Gemma-2/3
    alternating layers, any ``sliding_window``/``layer_types``), attention-logit
    softcapping (Gemma-2) and final-logit softcapping, and ALiBi biases of BLOOM and MPT
    (their layers take treeattn's forward: :mod:`treeattn.hf.alibi`). Refused, with the
    family named: attention sinks (GPT-OSS and others), chunked attention (Llama-4),
    bidirectional or encoder-decoder attention, ALiBi of other families, and attention
    dropout in training mode.

    Args:
        config: a transformers ``PretrainedConfig`` (a multimodal config is judged by its
            text config).
        training: the model is in training mode (attention dropout would then apply).

    Returns:
        One sentence naming the family and the reason, or None.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    fam = _family(cfg)
    mt = getattr(cfg, "model_type", "")
    why = None
    if mt in _SINKS:
        why = "its attention has learned sink logits in every softmax (attention sinks)"
    elif getattr(cfg, "attention_chunk_size", None):
        why = (
            f"its chunked attention (attention_chunk_size={cfg.attention_chunk_size}: a token sees only its own "
            "chunk) is not implemented"
        )
    elif getattr(config, "is_encoder_decoder", False) or getattr(cfg, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model; treeattn shards a decoder's causal self-attention"
    elif getattr(cfg, "use_bidirectional_attention", False):
        why = "its attention is bidirectional (use_bidirectional_attention=True), not causal"
    elif getattr(cfg, "alibi", False) and mt not in ("bloom", "mpt"):
        why = "its ALiBi position biases are added through the attention mask, which treeattn does not read"
    elif training and (getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        why = (
            f"the model is in training mode with attention_dropout={cfg.attention_dropout}: dropout makes the "
            "attention random (call model.eval())"
        )
    if why is None:
        return None
    return f"{fam}: {why}, so treeattn cannot run it exactly"


def layer_window(module, kwargs: dict) -> int | None:
    """The sliding window of one attention layer as transformers applies it: the
    ``sliding_window`` the layer passes to its attention function (Mistral, Qwen2,
    Gemma-2/3, ...), else the module's ``sliding_window``, else the config's (for
    families that apply it through the mask only, per ``layer_types`` when present)."""
    if "sliding_window" in kwargs:
        w = kwargs["sliding_window"]
    elif hasattr(module, "sliding_window"):
        w = module.sliding_window
    else:
        cfg = getattr(module, "config", None)
        w = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if w is not None and types is not None and getattr(module, "layer_idx", None) is not None:
            w = w if types[module.layer_idx] == "sliding_attention" else None
    return None if w is None else int(w)


def max_positions(config) -> int | None:
    """The positions a model of this config takes (its text config's ``max_position_embeddings``;
    MPT's ``max_seq_len``, where its ALiBi table ends), or None when it names none."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(cfg, "model_type", "") == "mpt":
        return getattr(cfg, "max_seq_len", None)
    return getattr(cfg, "max_position_embeddings", None)
