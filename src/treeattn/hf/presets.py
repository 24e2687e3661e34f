"""Tiny model configs with random weights (tests, demos) and loading a model for the CLI."""

from __future__ import annotations

import torch

PRESETS: dict[str, tuple[str, dict]] = {
    # tiny configs with random weights (GQA everywhere); "small" is for latency measurements
    "tiny-llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)),
    "tiny-qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)),
    # sliding windows shorter than a test prompt: the window really masks keys
    "tiny-mistral": ("mistral", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, vocab_size=512, sliding_window=16)),
    "tiny-qwen2-swa": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    # Gemma-2: alternating sliding/full layers, attention-logit and final-logit softcapping
    # (scores large enough for the softcap to bite; Gemma's sqrt(hidden) embedding scale needs
    # small weights, else random models emit one token forever)
    "tiny-gemma2": ("gemma2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, sliding_window=16, query_pre_attn_scalar=1, attn_logit_softcapping=4.0, final_logit_softcapping=30.0, initializer_range=0.03)),
    # Gemma-3 (text): sliding and full layers alternating, local/global RoPE, q/k norms
    "tiny-gemma3": ("gemma3_text", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, sliding_window=16, query_pre_attn_scalar=32, sliding_window_pattern=2, initializer_range=0.02)),
    # ALiBi (hf.alibi): six heads, so the slopes include the non-power-of-two tail
    "tiny-bloom": ("bloom", dict(hidden_size=192, n_layer=2, n_head=6, vocab_size=512, initializer_range=0.3)),
    "tiny-mpt": ("mpt", dict(d_model=192, n_layers=2, n_heads=6, expansion_ratio=2, vocab_size=512, max_seq_len=4096, initializer_range=0.3)),
    "small-llama": ("llama", dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)),
}  # fmt: skip


def build_model(preset: str | None, model_dir: str | None, dtype: torch.dtype, seed: int = 0) -> tuple:
    """``(model, tokenizer or None)``: a preset with random weights (seeded: the same on every
    rank) or a local directory (safetensors only, nothing downloaded, no remote code)."""
    from transformers import AutoModelForCausalLM

    if model_dir:
        from .models import load_model

        return load_model(model_dir, dtype)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(preset_config(preset), dtype=dtype).eval(), None


def preset_config(preset: str):
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    kind, kw = PRESETS[preset]
    return AutoConfig.for_model(kind, **{"max_position_embeddings": 1 << 20, "initializer_range": 0.2, **kw})
