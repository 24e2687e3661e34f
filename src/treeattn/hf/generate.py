"""Greedy or sampled generation with a transformers model whose KV cache is sharded across ranks."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EtaLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ..cache import ShardedKVCache
from ..comm.collectives import all_reduce, world
from ..comm.validate import agree, float_bits
from .attention import ATTN_NAME, StepContext, TreeAttnCache

ATTENTIONS = ("tree", "ring")


def _processors(temperature, top_k, top_p, typical_p, eta_cutoff, device) -> LogitsProcessorList:
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    if typical_p is not None and typical_p < 1.0:
        procs.append(TypicalLogitsWarper(typical_p))
    if eta_cutoff:
        procs.append(EtaLogitsWarper(eta_cutoff, device=device))
    return procs


def lm_logits(model: torch.nn.Module, hidden: Tensor) -> Tensor:
    """float32 logits of the LM head for hidden states ``[..., hidden]`` (the model's own
    final-logit softcapping, e.g. Gemma-2, applied as its ``forward`` does)."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _prompt_lens(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    B, L = input_ids.shape
    if attention_mask is None:
        return torch.full((B,), L, dtype=torch.int64)
    m = attention_mask.detach().cpu().to(torch.int64)
    if m.shape != (B, L):
        raise ValueError(f"attention_mask must be [B, L]={(B, L)}, got {tuple(m.shape)}")
    lens = m.sum(1)
    if not torch.equal(m, (torch.arange(L)[None, :] < lens[:, None]).to(torch.int64)):
        raise ValueError(
            "attention_mask must describe right padding (1...1 0...0 per row); left padding is not supported"
        )
    return lens


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    attention_mask: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    placement: str = "interleaved",
    block: int = 1,
    attention: str = "tree",
    strategy: str = "auto",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    typical_p: float | None = None,
    eta_cutoff: float | None = None,
    seed: int = 0,
    info: dict | None = None,
    progress: bool = False,
) -> Tensor:
    """Generate ``max_new_tokens`` tokens per sequence; call on every rank with the same arguments.

    The prompt's tokens are spread over the ranks by ``placement`` (each rank runs the model
    on its share; causal attention across shards by Ring Attention prefill); every decoded
    token is run on all ranks with attention over the sharded cache by Tree decoding
    (``attention="tree"``, reduction ``strategy``) or Ring decoding (``attention="ring"``).

    Args:
        model: a transformers causal LM of the Llama/Mistral/Qwen2 families (no sliding
            window), in eval mode; the same weights on every rank.
        input_ids: ``[B, L]`` int64, identical on every rank. Batches are **right-padded**:
            ``attention_mask [B, L]`` (1 for real tokens, then 0s) gives each prompt's length
            (every prompt at least 1 token).
        max_new_tokens: tokens to generate per sequence (no early stop at EOS).
        placement, block: KV placement (see :class:`treeattn.ShardedKVCache`).
        do_sample, temperature, top_k, top_p, typical_p, eta_cutoff: sampling through
            transformers' own logits warpers; one generator seeded with ``seed`` on every
            rank, so every rank draws the same token.
        info: if a dict, receives ``ttft`` (s, prefill + first token), ``decode`` (list of s
            per later token), measured on this rank, ``cache_bytes`` and ``last_logits``
            (``[B, V]`` float32 logits of the last step).
        progress: a progress bar on rank 0.

    Returns:
        ``[B, max_new_tokens]`` int64 new tokens, identical on every rank.
    """
    rank, p = world(group)
    err, lens = None, None
    try:  # local checks; the verdict is shared below so a bad argument on one rank fails all
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, L] with L >= 1, got {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        lens = _prompt_lens(input_ids, attention_mask)
        if bool((lens < 1).any()):
            raise ValueError(f"every prompt needs at least one token, got lengths {lens.tolist()}")
    except ValueError as e:
        err = str(e)
    ok = err is None
    B, L = tuple(input_ids.shape[:2]) if ok else (-1, -1)
    ids_cpu = input_ids.detach().cpu().to(torch.int64)
    fields = {
        "B": B,
        "L": L,
        "input_ids checksum": int(((ids_cpu + 1) * torch.arange(1, ids_cpu.numel() + 1).view(B, L)).sum() % (1 << 61))
        if ok
        else -1,
        "prompt lengths checksum": int((lens * torch.arange(1, B + 1)).sum()) if ok else -1,
        "max_new_tokens": max_new_tokens,
        "attention": ATTENTIONS.index(attention) if attention in ATTENTIONS else -1,
        "do_sample": int(do_sample),
        "seed": seed,
        "temperature": float_bits(temperature),
    }
    agree(fields, err, group=group, show={"temperature": "float", "attention": dict(enumerate(ATTENTIONS))})

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    device = input_ids.device
    dtype = next(model.parameters()).dtype
    sharded = ShardedKVCache(
        cfg.num_hidden_layers,
        B,
        cfg.num_key_value_heads,
        head_dim,
        dtype=dtype,
        device=device,
        group=group,
        placement=placement,
        block=block,
    )
    cache = TreeAttnCache(sharded)
    decoder = model.get_decoder()
    procs = _processors(temperature, top_k, top_p, typical_p, eta_cutoff, device) if do_sample else None
    gen = torch.Generator(device=device).manual_seed(seed)
    prev_impl = cfg._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc="tokens", unit="tok")
    out = torch.empty(B, max_new_tokens, dtype=torch.int64, device=device)
    seqs = input_ids.clone()

    def pick(logits: Tensor) -> Tensor:
        if not do_sample:
            return logits.argmax(-1)
        scores = procs(seqs, logits)
        return torch.multinomial(torch.softmax(scores, -1), 1, generator=gen).squeeze(1)

    try:
        t0 = time.perf_counter()
        mine = sharded.begin_prefill(lens, L)
        n = len(mine)
        positions = [sharded.placement.prompt_positions(r, L) for r in range(p)]
        ctx = StepContext(sharded, "prefill", attention, strategy, group, positions=positions, n_real=n)
        cache.ctx = ctx
        idx = mine if n else torch.zeros(1, dtype=torch.int64)  # a placeholder token keeps the model happy
        hidden = decoder(
            input_ids=input_ids[:, idx.to(device)],
            position_ids=idx[None, :].expand(B, -1).to(device),
            past_key_values=cache,
            use_cache=True,
            treeattn_ctx=ctx,
        ).last_hidden_state
        rows, cols = torch.nonzero(mine[None, :] == (lens - 1)[:, None], as_tuple=True)  # who holds each last token
        last = torch.zeros(B, hidden.shape[-1], dtype=torch.float32, device=device)
        last[rows.to(device)] = hidden[rows.to(device), cols.to(device)].float()
        last = all_reduce(last, dist.ReduceOp.SUM, group).to(hidden.dtype)
        logits = lm_logits(model, last)
        tok = pick(logits)
        out[:, 0] = tok
        t1 = time.perf_counter()
        steps = []
        if bar:
            bar.update(1)
        for t in range(1, max_new_tokens):
            ts = time.perf_counter()
            seqs = torch.cat([seqs, tok[:, None]], 1) if do_sample else seqs
            pos = sharded.seq_lens.clone()
            sharded.begin_decode_step()
            ctx = StepContext(sharded, "decode", attention, strategy, group, kv_lens=sharded.kv_lens.clone().to(device))
            cache.ctx = ctx
            hidden = decoder(
                input_ids=tok[:, None],
                position_ids=pos[:, None].to(device),
                past_key_values=cache,
                use_cache=True,
                treeattn_ctx=ctx,
            ).last_hidden_state
            logits = lm_logits(model, hidden[:, -1])
            tok = pick(logits)
            out[:, t] = tok
            steps.append(time.perf_counter() - ts)
            if bar:
                bar.update(1)
        if info is not None:
            info.update(ttft=t1 - t0, decode=steps, cache_bytes=sharded.memory_bytes(), last_logits=logits)
    finally:
        cache.ctx = None
        model.set_attn_implementation(prev_impl)
        if bar:
            bar.close()
    return out
