"""Greedy or sampled generation with a transformers model whose KV cache is sharded across ranks."""

from __future__ import annotations

import functools
import inspect
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

from .._host import peak_memory_bytes
from ..cache import ShardedKVCache
from ..comm.collectives import all_reduce, world
from ..comm.validate import agree, float_bits
from .attention import ATTN_NAME, StepContext, TreeAttnCache
from .families import unsupported_reason

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


def _eos_ids(model: torch.nn.Module, eos_token_id, stop_at_eos: bool) -> list[int]:
    if not stop_at_eos:
        return []
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a non-negative int or a list of them, got {eos_token_id!r}")
    return ids


def _pad_id(model: torch.nn.Module, pad_token_id: int | None, eos: list[int]) -> int:
    if pad_token_id is None:
        gc = getattr(model, "generation_config", None)
        pad_token_id = getattr(gc, "pad_token_id", None) if gc is not None else None
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0  # as transformers: pad with the (first) EOS id
    return int(pad_token_id)


@functools.cache
def _cache_name(forward_cls: type) -> str:
    names = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def _cache_kw(decoder: torch.nn.Module, cache) -> dict:
    """The cache keyword of the decoder's forward: ``cache`` (transformers >= 5.24, where
    ``past_key_values`` is deprecated) or ``past_key_values``."""
    return {_cache_name(type(decoder)): cache}


def _checksum(t: Tensor) -> int:
    t = t.detach().cpu().to(torch.int64).reshape(-1)
    return int(((t + 1) * torch.arange(1, t.numel() + 1)).sum() % (1 << 61)) if t.numel() else 0


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
    stop_at_eos: bool = True,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    prefill_chunk: int | None = 1024,
    streamer=None,
    info: dict | None = None,
    progress: bool = False,
) -> Tensor:
    """Generate up to ``max_new_tokens`` tokens per sequence; call on every rank with the same
    arguments. Stops where ``model.generate`` stops: at the EOS ids of the model's generation
    config (or ``eos_token_id``).

    The prompt's tokens are spread over the ranks by ``placement``; each rank runs the model
    on its share in chunks of ``prefill_chunk`` tokens, with exact causal attention across
    the shards (``attention="tree"``: Tree prefill, the chunk's queries gathered and the
    states reduced, traffic independent of the context; ``"ring"``: Ring Attention prefill).
    Every decoded token is then run on all ranks with attention over the sharded cache by
    Tree decoding (reduction ``strategy``) or Ring decoding.

    Args:
        model: a transformers causal LM (Llama, Mistral, Qwen2, Gemma-2/3 families; see the
            README's table), in eval mode; the same weights on every rank.
        input_ids: ``[B, L]`` int64, identical on every rank. Batches are **right-padded**:
            ``attention_mask [B, L]`` (1 for real tokens, then 0s) gives each prompt's length
            (every prompt at least 1 token). ``L + max_new_tokens`` must not exceed the
            model's ``max_position_embeddings``.
        max_new_tokens: the most tokens to generate per sequence.
        placement, block: KV placement (see :class:`treeattn.ShardedKVCache`).
        do_sample, temperature, top_k, top_p, typical_p, eta_cutoff: sampling through
            transformers' own logits warpers; one generator seeded with ``seed`` on every
            rank, so every rank draws the same token.
        stop_at_eos: stop a sequence at its first EOS token (as ``model.generate``): later
            positions hold ``pad_token_id`` and generation ends when every sequence has
            stopped. False: always ``max_new_tokens`` tokens.
        eos_token_id: int or list of ints; default the model's ``generation_config`` (then
            ``config``) EOS ids. pad_token_id: default the generation config's, else the
            first EOS id.
        prefill_chunk: prompt tokens per rank run through the model at a time (bounds the
            prefill's activations); None: the whole share at once.
        streamer: an object with ``put(ids)`` / ``end()`` (e.g. ``transformers.TextStreamer``
            with ``skip_prompt=True``), called on the ranks that pass one: first with the
            prompt ``[B, L]``, then with each step's tokens ``[B]``, then ``end()``.
        info: if a dict, receives ``ttft`` (s, prefill + first token), ``prefill`` (s),
            ``decode`` (list of s per later token), measured on this rank, ``cache_bytes``,
            ``peak_bytes`` (this process's peak memory, see :func:`peak_memory_bytes`) and
            ``last_logits`` (``[B, V]`` float32 logits of the last step).
        progress: a progress bar on rank 0.

    Returns:
        ``[B, n]`` int64 new tokens, ``n <= max_new_tokens``, identical on every rank.

    Raises:
        ValueError: on every rank, when any rank's arguments are invalid or differ, or the
            model cannot be run exactly (:func:`treeattn.hf.unsupported_reason`: the message
            names the family and why; also a model whose attention bypasses transformers'
            attention interface).
    """
    rank, p = world(group)
    err, lens, eos, pad = None, None, [], 0
    try:  # local checks; the verdict is shared below so a bad argument on one rank fails all
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, L] with L >= 1, got {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 or None, got {prefill_chunk}")
        lens = _prompt_lens(input_ids, attention_mask)
        if bool((lens < 1).any()):
            raise ValueError(f"every prompt needs at least one token, got lengths {lens.tolist()}")
        if getattr(model, "config", None) is None:
            raise ValueError(f"model must be a transformers model with a .config, got {type(model).__name__}")
        why = unsupported_reason(model.config, training=model.training)
        if why is None and not getattr(model, "_supports_attention_backend", False):
            why = (
                f"{type(model).__name__}: its attention does not go through transformers' attention interface, "
                "so treeattn cannot run it"
            )
        if why is not None:
            raise ValueError(why)
        max_pos = getattr(model.config, "max_position_embeddings", None)
        if max_pos and input_ids.shape[1] + max_new_tokens > max_pos:
            L0 = input_ids.shape[1]
            room = f"at most {max_pos - L0} new tokens" if L0 < max_pos else "a prompt shorter than that"
            raise ValueError(
                f"the prompt has {L0} tokens and max_new_tokens is {max_new_tokens}, but the model supports "
                f"{max_pos} positions (max_position_embeddings): ask for {room}"
            )
        eos = _eos_ids(model, eos_token_id, stop_at_eos)
        pad = _pad_id(model, pad_token_id, eos)
    except ValueError as e:
        err = str(e)
    ok = err is None
    B, L = tuple(input_ids.shape[:2]) if ok else (-1, -1)
    fields = {
        "B": B,
        "L": L,
        "input_ids checksum": _checksum(input_ids) if ok else -1,
        "prompt lengths checksum": int((lens * torch.arange(1, B + 1)).sum()) if ok else -1,
        "max_new_tokens": max_new_tokens,
        "attention": ATTENTIONS.index(attention) if attention in ATTENTIONS else -1,
        "do_sample": int(do_sample),
        "seed": seed,
        "temperature": float_bits(temperature),
        "eos ids checksum": _checksum(torch.tensor(eos, dtype=torch.int64)) if ok else -1,
        "pad_token_id": pad,
        "prefill_chunk": prefill_chunk or 0,
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
    out = torch.full((B, max_new_tokens), pad, dtype=torch.int64, device=device)
    seqs = input_ids.clone()
    eos_t = torch.tensor(eos, dtype=torch.int64, device=device)
    live = torch.ones(B, dtype=torch.bool, device=device)  # sequences that have not emitted EOS

    def pick(logits: Tensor) -> Tensor:
        if not do_sample:
            tok = logits.argmax(-1)
        else:
            scores = procs(seqs, logits)
            tok = torch.multinomial(torch.softmax(scores, -1), 1, generator=gen).squeeze(1)
        return torch.where(live, tok, pad) if len(eos) else tok

    n_out = 0
    try:
        if streamer is not None:
            streamer.put(input_ids.cpu())
        t0 = time.perf_counter()
        last = _prefill(decoder, cache, sharded, input_ids, lens, attention, strategy, group, prefill_chunk)
        t_pre = time.perf_counter() - t0
        logits = lm_logits(model, last.to(dtype))
        tok = pick(logits)
        steps = []
        for t in range(max_new_tokens):
            if t:
                ts = time.perf_counter()
                seqs = torch.cat([seqs, tok[:, None]], 1) if do_sample else seqs
                pos = sharded.seq_lens.clone()
                sharded.begin_decode_step()
                ctx = StepContext(
                    sharded,
                    "decode",
                    attention,
                    strategy,
                    group,
                    kv_lens=sharded.kv_lens.clone().to(device),
                    q_pos=pos,
                )
                cache.ctx = ctx
                hidden = decoder(
                    input_ids=tok[:, None],
                    position_ids=pos[:, None].to(device),
                    **_cache_kw(decoder, cache),
                    use_cache=True,
                    treeattn_ctx=ctx,
                ).last_hidden_state
                logits = lm_logits(model, hidden[:, -1])
                tok = pick(logits)
                steps.append(time.perf_counter() - ts)
            else:
                t1 = time.perf_counter()
            out[:, t] = tok
            n_out = t + 1
            if streamer is not None:
                streamer.put(tok.cpu())
            if bar:
                bar.update(1)
            if len(eos):
                live &= ~torch.isin(tok, eos_t)
                if not bool(live.any()):  # tokens are identical on every rank: so is this exit
                    break
        if info is not None:
            info.update(
                ttft=t1 - t0,
                prefill=t_pre,
                decode=steps,
                cache_bytes=sharded.memory_bytes(),
                peak_bytes=peak_memory_bytes(device),
                last_logits=logits,
            )
    finally:
        cache.ctx = None
        model.set_attn_implementation(prev_impl)
        if bar:
            bar.close()
        if streamer is not None:
            streamer.end()
    return out[:, :n_out]


def prefill_windows(positions: list[Tensor], L: int, chunk: int | None) -> list[tuple[int, int]]:
    """Split the prompt's global positions ``[0, L)`` into consecutive windows ``[lo, hi)`` in
    which no rank holds more than ``chunk`` tokens (``positions[r]``: rank r's sorted
    positions; None: one window). Causal attention needs the windows in position order: a
    query may only run once every earlier key exists. Interleaved placement gives every rank
    ``chunk`` tokens per window; contiguous placement runs the ranks' chunks one after another."""
    if not chunk:
        return [(0, L)]
    out, lo = [], 0
    while lo < L:
        hi = L
        for x in positions:
            i = int(torch.searchsorted(x, lo))
            if i + chunk < len(x):
                hi = min(hi, int(x[i + chunk]))
        out.append((lo, hi))
        lo = hi
    return out


def _prefill(decoder, cache, sharded, input_ids, lens, attention, strategy, group, chunk) -> Tensor:
    """Run this rank's prompt share through ``decoder`` chunk by chunk; returns the float32
    last hidden state of every sequence ``[B, hidden]`` (identical on every rank)."""
    rank, p = world(group)
    B, L = input_ids.shape
    device = input_ids.device
    sharded.begin_prefill(lens, L)
    positions = [sharded.placement.prompt_positions(r, L) for r in range(p)]
    last = None
    for lo, hi in prefill_windows(positions, L, chunk):
        # every rank's tokens at global positions [lo, hi): every key a query of this step
        # can see is then stored (layer by layer) before the query's attention runs
        a = [int(torch.searchsorted(x, lo)) for x in positions]
        b = [int(torch.searchsorted(x, hi)) for x in positions]
        q_pos = [x[i:j] for x, i, j in zip(positions, a, b, strict=True)]
        n = len(q_pos[rank])
        ctx = StepContext(
            sharded,
            "prefill",
            attention,
            strategy,
            group,
            positions=[x[:j] for x, j in zip(positions, b, strict=True)],
            q_positions=q_pos,
            n_real=n,
            start=a[rank],
        )
        cache.ctx = ctx
        idx = q_pos[rank] if n else torch.zeros(1, dtype=torch.int64)  # a placeholder keeps the model happy
        hidden = decoder(
            input_ids=input_ids[:, idx.to(device)],
            position_ids=idx[None, :].expand(B, -1).to(device),
            **_cache_kw(decoder, cache),
            use_cache=True,
            treeattn_ctx=ctx,
        ).last_hidden_state
        if last is None:
            last = torch.zeros(B, hidden.shape[-1], dtype=torch.float32, device=device)
        if n:  # who holds each sequence's last prompt token in this chunk
            rows, cols = torch.nonzero(q_pos[rank][None, :] == (lens - 1)[:, None], as_tuple=True)
            last[rows.to(device)] = hidden[rows.to(device), cols.to(device)].float()
    return all_reduce(last, dist.ReduceOp.SUM, group)
