"""Greedy or sampled generation with a transformers model whose KV cache is sharded across ranks."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import world
from ..comm.validate import agree
from ..config import Layout, Sampling, Speculation
from ..hf.families import max_positions
from ..hf.model import model_problem
from ..runtime.inputs import checksum, right_padded
from ..runtime.session import Session
from .decoders import Contrastive, Decoder, GenerationStats, Plain, Speculative
from .prompt_lookup import PromptLookup
from .sampler import Sampler
from .speculative import DraftModel, Speculator


def _prompt_lens(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    B, L = input_ids.shape
    if attention_mask is None:
        return torch.full((B,), L, dtype=torch.int64)
    return right_padded(attention_mask, B, L, "[B, L]")


def eos_ids(model: torch.nn.Module, eos_token_id, stop_at_eos: bool) -> list[int]:
    """The token ids that end a sequence: ``eos_token_id`` (an id or a list), else the model's
    ``generation_config.eos_token_id``, else its config's; none without ``stop_at_eos``."""
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


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    attention_mask: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    placement: str = "interleaved",
    block: int | None = None,
    attention: str = "tree",
    strategy: str = "auto",
    prefill: str = "auto",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
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
    speculate: str | None = None,
    draft_model: torch.nn.Module | None = None,
    num_draft_tokens: int = 5,
    tree_width: int = 1,
    penalty_alpha: float | None = None,
    adaptive_draft: bool = True,
    cuda_graph: bool = False,
) -> Tensor:
    """Generate up to ``max_new_tokens`` tokens per sequence; call on every rank with the same
    arguments. Stops where ``model.generate`` stops: at the EOS ids of the model's generation
    config (or ``eos_token_id``).

    The prompt's tokens are spread over the ranks by ``placement``; each rank runs the model
    on its share in chunks of ``prefill_chunk`` tokens, with exact causal attention across
    the shards (``prefill="tree"``: the chunk's queries gathered and their states sent back,
    traffic independent of the context; ``"ring"``: Ring Attention, the K/V passed around;
    ``"auto"``: per chunk, the one moving fewer bytes). Every decoded token is then run on
    all ranks with attention over the sharded cache by Tree decoding (``attention="tree"``,
    reduction ``strategy``) or Ring decoding (``"ring"``). It is a loop over a
    :class:`treeattn.runtime.Session` (``extend`` of the prompt, then of each token) whose cache
    is dropped on return: keep a Session yourself to ask several questions of one document.

    Args:
        model: a transformers causal LM (Llama, Mistral, Qwen2, Gemma-2/3 families; see the
            README's table), in eval mode; the same weights on every rank.
        input_ids: ``[B, L]`` int64, identical on every rank. Batches are **right-padded**:
            ``attention_mask [B, L]`` (1 for real tokens, then 0s) gives each prompt's length
            (every prompt at least 1 token). ``L + max_new_tokens`` must not exceed the
            model's ``max_position_embeddings``.
        max_new_tokens: the most tokens to generate per sequence.
        placement, block: KV placement (see :class:`treeattn.cache.ShardedKVCache`; block None: as
            :class:`treeattn.runtime.Session`).
        do_sample, temperature, top_k, top_p, min_p, typical_p, eta_cutoff: sampling through
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
        speculate: None, ``"prompt-lookup"`` (drafts copied from earlier n-grams of the prompt
            and the output) or ``"draft"`` (``draft_model`` drafts): each target forward
            verifies up to ``num_draft_tokens`` drafted tokens deep, ``tree_width``
            branches (1: a chain; more: a token tree in one :meth:`Session.step`; the shapes:
            :class:`treeattn.decoding.prompt_lookup.PromptLookup`, ``DraftModel``). Greedy output is
            that of non-speculative greedy decoding (up to float rounding at exact near-ties);
            sampling stays lossless (see :mod:`treeattn.decoding.speculative`). One sequence (B = 1).
            ``info`` gets ``mean_accepted_length`` (tokens committed per target forward),
            ``acceptance_rates`` (per draft position) and ``target_forwards``; with
            ``adaptive_draft``, ``step_costs`` (tokens per step -> measured cost, plain = 1).
        adaptive_draft: with ``speculate``, draft only as deep as the measured step costs and
            acceptance make worth it (:mod:`treeattn.decoding.draft_policy`; none when no draft
            promises a gain, so speculation does not cost more than it saves); False: always
            ``num_draft_tokens`` deep where a draft exists.
        draft_model: a causal LM with the target's vocabulary; it drafts on rank 0 of
            ``group`` only (the other ranks may pass None).
        penalty_alpha: with ``top_k >= 2`` (and greedy, one sequence): contrastive search, the
            ``top_k`` candidates scored in one step as a depth-1 token tree, ``(1 - alpha) * p -
            alpha * (max cosine similarity of the candidate's last hidden state with every
            earlier token's)`` (see :mod:`treeattn.decoding.contrastive`). None or 0: off.
        cuda_graph: on a CUDA model at p = 1, each plain decode step as a replayed CUDA graph
            (:class:`treeattn.runtime.Session`'s ``cuda_graph``); the same tokens. Each call
            captures its own graphs in its first decode step (~35 ms on an H200): keep a
            Session to ask many questions.

    Returns:
        ``[B, n]`` int64 new tokens, ``n <= max_new_tokens``, identical on every rank.

    Raises:
        ValueError: on every rank, when any rank's arguments are invalid or differ, or the
            model cannot be run exactly (:func:`treeattn.hf.unsupported_reason`: the message
            names the family and why; also a model whose attention bypasses transformers'
            attention interface).
    """
    rank, p = world(group)
    err, lens, eos, pad, contrast, sampler, layout, sampling, spec_set = None, None, [], 0, False, None, None, None, None
    try:  # local checks; the verdict is shared below so a bad argument on one rank fails all
        layout = Layout(placement=placement, block=block, attention=attention, strategy=strategy, prefill=prefill,
                        prefill_chunk=prefill_chunk, cuda_graph=cuda_graph)  # fmt: skip
        sampling = Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            typical_p=typical_p, eta_cutoff=eta_cutoff, seed=seed)  # fmt: skip
        spec_set = Speculation(speculate=speculate, num_draft_tokens=num_draft_tokens, tree_width=tree_width,
                               adaptive_draft=adaptive_draft)  # fmt: skip
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, L] with L >= 1, got {tuple(input_ids.shape)}")
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
        lens = _prompt_lens(input_ids, attention_mask)
        if bool((lens < 1).any()):
            raise ValueError(f"every prompt needs at least one token, got lengths {lens.tolist()}")
        why = model_problem(model)
        if why is not None:
            raise ValueError(why)
        max_pos = max_positions(model.config)
        if max_pos and input_ids.shape[1] + max_new_tokens > max_pos:
            L0 = input_ids.shape[1]
            room = f"at most {max_pos - L0} new tokens" if L0 < max_pos else "a prompt shorter than that"
            raise ValueError(
                f"the prompt has {L0} tokens and max_new_tokens is {max_new_tokens}, but the model supports "
                f"{max_pos} positions (max_position_embeddings): ask for {room}"
            )
        eos = eos_ids(model, eos_token_id, stop_at_eos)
        pad = _pad_id(model, pad_token_id, eos)
        _check_speculate(model, input_ids, speculate, draft_model, rank, max_new_tokens)
        contrast = _check_contrastive(penalty_alpha, top_k, do_sample, speculate, input_ids.shape[0],
                                      model.config.vocab_size)  # fmt: skip
        sampler = Sampler(do_sample, temperature=sampling.temperature, top_k=top_k, top_p=sampling.top_p,
                          typical_p=sampling.typical_p, eta_cutoff=sampling.eta_cutoff, seed=seed, min_p=sampling.min_p,
                          device=input_ids.device)  # fmt: skip
    except ValueError as e:
        err = str(e)
    ok = err is None
    B, L = tuple(input_ids.shape[:2]) if ok else (-1, -1)
    fields = {  # every field of the three settings, and the call's own values
        "layout": layout,
        "sampling": sampling,
        "speculation": spec_set,
        "B": B,
        "L": L,
        "input_ids checksum": checksum(input_ids) if ok else -1,
        "prompt lengths checksum": int((lens * torch.arange(1, B + 1)).sum()) if ok else -1,
        "max_new_tokens": max_new_tokens if ok else -1,
        "stop_at_eos": bool(stop_at_eos),
        "eos_token_id": tuple(eos),
        "pad_token_id": pad,
        "penalty_alpha": float(penalty_alpha or 0.0) if ok else -1,
    }
    agree(fields, err, group=group)

    device = input_ids.device
    session = Session(model, group, placement, attention, strategy, prefill_chunk, block=block, prefill=prefill,
                      cuda_graph=cuda_graph)  # fmt: skip
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, desc="tokens", unit="tok")
    out = torch.full((B, max_new_tokens), pad, dtype=torch.int64, device=device)
    eos_t = torch.tensor(eos, dtype=torch.int64, device=device)
    live = torch.ones(B, dtype=torch.bool, device=device)  # sequences that have not emitted EOS

    def pick(logits: Tensor) -> Tensor:
        tok = sampler.pick(logits)
        return torch.where(live, tok, pad) if len(eos) else tok

    if contrast:
        dec: Decoder = Contrastive(session, penalty_alpha, top_k, device)
    elif speculate:
        drafter = None
        if rank == 0:  # drafts are made on rank 0 and broadcast
            drafter = PromptLookup() if speculate == "prompt-lookup" else DraftModel(draft_model, sampler)
        dec = Speculative(session, Speculator(drafter, num_draft_tokens, tree_width, sampler, group=group,
                                              adaptive=adaptive_draft), pick)  # fmt: skip
    else:
        dec = Plain(session, pick)
    n_out = 0

    def emit(tok: Tensor) -> bool:
        """Output one token per sequence; True when generation is over."""
        nonlocal n_out, live
        out[:, n_out] = tok
        n_out += 1
        if streamer is not None:
            streamer.put(tok.cpu())
        if bar:
            bar.update(1)
        if len(eos):
            live &= ~torch.isin(tok, eos_t)
            if not bool(live.any()):  # tokens are identical on every rank: so is this exit
                return True
        return n_out == max_new_tokens

    try:
        if streamer is not None:
            streamer.put(input_ids.cpu())
        t0 = time.perf_counter()
        # the arguments were agreed above; the ids of every later call come from identical computation
        logits = session.extend(input_ids, attention_mask, check=False)
        c = session.cache  # decoding grows the cache to what this call can commit, not twice the prompt's
        c.slot_limit = c.placement.max_per_rank(input_ids.shape[1] + max_new_tokens + (num_draft_tokens or 0))
        t_pre = session.last_call["seconds"]
        tok = dec.first(logits)
        t1 = time.perf_counter()
        steps = []
        done = emit(tok)
        while not done:
            ts = time.perf_counter()
            new = dec.next(tok, max_new_tokens - n_out)
            dt = (time.perf_counter() - ts) / len(new)
            for tok in new:
                steps.append(dt)
                if done := emit(tok):
                    break
        if info is not None:
            st = session.stats()
            info.update(vars(GenerationStats(t1 - t0, t_pre, steps, st["cache_bytes"], st["peak_bytes"], dec.logits)))
            info.update(dec.stats())
    finally:
        if bar:
            bar.close()
        if streamer is not None:
            streamer.end()
    return out[:, :n_out]


def _check_speculate(model, input_ids, speculate, draft_model, rank, new) -> None:
    if speculate is None:
        if draft_model is not None:
            raise ValueError('draft_model is given but speculate is not "draft"')
        return
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding runs one sequence (B = 1), got a batch of {input_ids.shape[0]}")
    if speculate == "draft":
        if draft_model is None:
            if rank:
                return
            raise ValueError('speculate="draft" needs a draft_model (on rank 0 of the group)')
        v_t, v_d = model.config.vocab_size, getattr(getattr(draft_model, "config", None), "vocab_size", None)
        if v_d != v_t:
            raise ValueError(f"the draft model's vocabulary ({v_d} tokens) differs from the target's ({v_t})")
        pos = getattr(draft_model.config, "max_position_embeddings", None)
        if pos and input_ids.shape[1] + new > pos:
            raise ValueError(
                f"the draft model supports {pos} positions, fewer than the prompt ({input_ids.shape[1]}) plus "
                f"max_new_tokens ({new})"
            )
    elif draft_model is not None:
        raise ValueError('draft_model is given but speculate is not "draft"')


def _check_contrastive(alpha, top_k, do_sample, speculate, B, V) -> bool:
    if alpha is None or alpha == 0:
        return False
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        raise ValueError(f"penalty_alpha must be a number in (0, 1] or None, got {alpha!r}")
    if not top_k or not 2 <= top_k <= V:
        raise ValueError(
            f"contrastive search (penalty_alpha) needs 2 <= top_k <= {V} (the vocabulary) candidates, got {top_k!r}"
        )
    if do_sample or speculate:
        raise ValueError("contrastive search (penalty_alpha) is a greedy method: drop do_sample and speculate")
    if B != 1:
        raise ValueError(f"contrastive search runs one sequence (B = 1), got a batch of {B}")
    return True
