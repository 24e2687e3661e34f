"""``treeattn generate``: end-to-end generation across local ranks or under torchrun."""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._argtypes import at_least, positive_float
from ..config import Sampling, Speculation, add_arguments, from_args
from .memory import check_fit
from .model import (
    UsageError,
    add_model_args,
    check_draft_args,
    check_draft_model,
    check_model,
    rank_model,
    ranks_of,
    resolve_tp,
    run_ranks,
    say,
    session_kwargs,
)


@dataclass
class Prepared:
    """What every rank needs, prepared once (in the launcher, or on each rank under torchrun)."""

    model_dir: str | None
    ids: torch.Tensor
    max_new_tokens: int
    has_tokenizer: bool
    notes: list[str] = field(default_factory=list)
    draft_dir: str | None = None


def _read_prompt_file(path: str) -> str:
    if path == "-":
        text = sys.stdin.read()
        where = "standard input"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError as e:
            raise UsageError(f"--prompt-file {path}: no such file") from e
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {path}: cannot read it as UTF-8 text ({e})") from e
        where = path
    if not text.strip():
        raise UsageError(f"--prompt-file: {where} is empty")
    return text


def _tokenize(a, tok) -> torch.Tensor:
    text = _read_prompt_file(a.prompt_file) if a.prompt_file is not None else a.prompt
    if tok is None:
        raise UsageError("--prompt/--prompt-file need the model's tokenizer (none found); use --prompt-ids")
    if a.chat:
        if not getattr(tok, "chat_template", None):
            raise UsageError("--chat: the model's tokenizer has no chat template")
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": text}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tok(text, return_tensors="pt").input_ids


def prepare(a: argparse.Namespace) -> Prepared:
    """Resolve the model, build the prompt and check that it fits, before any rank starts work
    (under torchrun: on every rank)."""
    if a.system is not None and not a.chat:
        raise UsageError("--system needs --chat")
    if a.chat and a.prompt is None and a.prompt_file is None:
        raise UsageError("--chat needs --prompt or --prompt-file")
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    a.do_sample = a.do_sample and a.temperature > 0  # temperature 0: greedy, as in OpenAI's API
    if a.compare_single and a.do_sample:
        raise UsageError("--compare-single checks greedy decoding against model.generate; drop --sample or it")
    if a.penalty_alpha is not None:
        if not 0 < a.penalty_alpha <= 1:
            raise UsageError(f"--penalty-alpha must lie in (0, 1], got {a.penalty_alpha}")
        if not a.top_k or a.top_k < 2:
            raise UsageError("--penalty-alpha (contrastive search) needs --top-k >= 2 candidates")
        if a.do_sample or a.speculate or a.compare_single:
            raise UsageError(
                "--penalty-alpha (contrastive search) is its own method: drop --sample, --speculate, --compare-single"
            )
    check_draft_args(a)
    model_dir, cfg = check_model(a)
    tok = None
    if model_dir is not None and (a.prompt is not None or a.prompt_file is not None):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
        except Exception:
            tok = None
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if a.prompt is not None or a.prompt_file is not None:
        ids = _tokenize(a, tok)
    elif a.prompt_ids is not None:
        try:
            ids = torch.tensor([[int(x) for x in a.prompt_ids.split(",")]])
        except ValueError as e:
            raise UsageError(f"--prompt-ids must be comma-separated integers, got {a.prompt_ids!r}") from e
    else:
        g = torch.Generator().manual_seed(a.seed + 1)
        ids = torch.randint(0, text_cfg.vocab_size, (a.batch, a.prompt_len), generator=g)
    if ids.numel() == 0:
        raise UsageError("the prompt is empty")
    if int(ids.max()) >= text_cfg.vocab_size or int(ids.min()) < 0:
        raise UsageError(f"prompt token ids must lie in [0, {text_cfg.vocab_size}) (the model's vocabulary)")
    notes, new = [], a.max_new_tokens
    L = ids.shape[1]
    from ..hf.families import max_positions

    max_pos = max_positions(text_cfg)
    if max_pos:
        if L >= max_pos:
            raise UsageError(
                f"the prompt has {L:,} tokens but the model supports {max_pos:,} positions (max_position_embeddings): "
                "shorten the prompt"
            )
        if L + new > max_pos:
            new = max_pos - L
            notes.append(f"max_new_tokens lowered to {new} (the model supports {max_pos:,} positions)")
    resolve_tp(a, cfg, L + new)
    _check_fit(a, cfg, L, new, ids.shape[0])
    if (a.speculate or a.penalty_alpha) and ids.shape[0] > 1:
        what = "--speculate" if a.speculate else "--penalty-alpha"
        raise UsageError(f"{what} decodes one sequence (batch 1), got a batch of {ids.shape[0]}")
    draft_dir = check_draft_model(a, text_cfg, model_dir) if a.speculate == "draft" else None
    return Prepared(model_dir, ids, new, tok is not None, notes, draft_dir)


def _check_fit(a, cfg, L: int, new: int, batch: int) -> None:
    from ..hf.models import memory_plan

    plan = memory_plan(cfg, prompt_len=L, max_new_tokens=new, nproc=ranks_of(a)[0], batch=batch,
                       dtype=getattr(torch, a.dtype), prefill_chunk=a.prefill_chunk or None, tp=getattr(a, "tp", 1),
                       tpa=getattr(a, "tpa", 1))  # fmt: skip
    check_fit(a, plan, "Spread the ranks over more hosts/devices, shorten the prompt, or use --dtype bfloat16")


def worker(a: argparse.Namespace, job: Prepared, local: bool) -> None:
    from ..cache import auto_block
    from ..decoding.generate import generate

    rank, p = dist.get_rank(), dist.get_world_size()
    model, tok = rank_model(a, job.model_dir)
    ids = job.ids.to(next(model.parameters()).device)
    if rank == 0:
        say(f"model {a.model or a.preset}, {a.dtype}, p={p}, prompt {tuple(ids.shape)}, attention={a.attention}, "
            f"prefill={a.prefill}, placement={a.placement}"
            + (f", block={a.block or auto_block(ids.shape[1], p)}" if a.placement == "interleaved" else ""))  # fmt: skip
        for n in job.notes:
            say(f"note: {n}")
    stream = rank == 0 and tok is not None and job.has_tokenizer and ids.shape[0] == 1 and not a.no_stream
    streamer = None
    if stream:
        from transformers import TextStreamer

        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    draft = None
    if a.speculate == "draft" and rank == 0:  # it drafts on rank 0 only
        draft = rank_model(a, job.draft_dir, a.draft_model)[0]
    timings: dict = {}
    out = generate(
        model,
        ids,
        max_new_tokens=job.max_new_tokens,
        **session_kwargs(a),
        **vars(from_args(Sampling, a, seed=a.seed, temperature=a.temperature if a.do_sample else 1.0)),
        **vars(from_args(Speculation, a)),
        stop_at_eos=not a.ignore_eos,
        streamer=streamer,
        info=timings,
        progress=a.progress,
        draft_model=draft,
        penalty_alpha=a.penalty_alpha,
    )
    dec = timings["decode"]
    t = torch.tensor([timings["ttft"], timings["prefill"], sum(dec), statistics.median(dec) if dec else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    mem = torch.tensor([timings["cache_bytes"]["used"], timings["cache_bytes"]["allocated"], timings["peak_bytes"]])
    mems = [torch.zeros_like(mem) for _ in range(p)]
    dist.all_gather(mems, mem)
    same = torch.tensor([1 if a.compare_single else 0])
    if a.compare_single and rank == 0:
        kw = {} if not a.ignore_eos else {"eos_token_id": None}
        whole = model if a.tp == 1 else rank_model(a, job.model_dir, split=False)[0]  # split: collective
        ref = whole.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # else generate infers padding from pad_token_id
            max_new_tokens=job.max_new_tokens,
            do_sample=False,
            **kw,
        )[:, ids.shape[1] :]
        same[0] = int(torch.equal(ref, out))
    if rank != 0:
        return
    if not stream:  # the text as it would have streamed (token ids without a tokenizer)
        for b in range(out.shape[0]):
            if tok is not None and job.has_tokenizer:
                head = f"--- sequence {b} ---\n" if out.shape[0] > 1 else ""
                print(head + tok.decode(out[b], skip_special_tokens=True), flush=True)
            else:
                print(f"tokens[{b}]: {out[b].tolist()}", flush=True)
    n_new = out.shape[1]
    rate = f"{(n_new - 1) / float(t[2]):.1f} tok/s" if n_new > 1 and float(t[2]) > 0 else "- tok/s"
    mib = 2.0**20
    per = "tokens" if a.speculate else "steps"
    say(
        f"prompt {ids.shape[1]:,} tokens, {n_new} new tokens; time to first token {t[0] * 1e3:.1f} ms (prefill "
        f"{t[1] * 1e3:.1f} ms); decode {rate}, {t[3] * 1e3:.2f} ms/token (median over {len(dec)} {per}, max over ranks)"
    )
    say("per rank: KV cache " + ", ".join(f"{int(m[0]) / mib:.1f}" for m in mems) + " MiB used (allocated "
        + ", ".join(f"{int(m[1]) / mib:.1f}" for m in mems) + " MiB); peak memory "
        + ", ".join(f"{int(m[2]) / mib:.0f}" for m in mems) + " MiB")  # fmt: skip
    if a.speculate:
        rates = " ".join(f"{r:.2f}" for r in timings["acceptance_rates"]) or "-"
        say(f"speculative ({a.speculate}, {a.num_draft_tokens} draft tokens, tree width {a.tree_width}): mean accepted "
            f"length {timings['mean_accepted_length']:.2f} (tokens per target forward, {timings['target_forwards']} "
            f"forwards); acceptance per draft position {rates}")  # fmt: skip
    if a.compare_single:
        if same[0]:
            say("compare-single: identical to single-process model.generate")
        else:
            say("compare-single: MISMATCH against single-process model.generate")
            raise SystemExit(2)


def add_parser(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="generate with a transformers model whose KV cache is sharded across ranks",
        description="Generate with a transformers model whose KV cache is sharded across ranks. The generated "
        "text streams to stdout (rank 0); status and statistics go to stderr.",
    )
    add_model_args(g, cuda_graph=True)
    pr = g.add_mutually_exclusive_group()
    pr.add_argument("--prompt", help="text (needs the model's tokenizer)")
    pr.add_argument("--prompt-file", help="a text file to use as the prompt (a long document); - reads stdin")
    pr.add_argument("--prompt-ids", help="comma-separated token ids")
    pr.add_argument("--prompt-len", type=at_least(1), default=64, help="random prompt of this length (default 64)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (user turn)")
    g.add_argument("--system", help="system message for --chat")
    g.add_argument("--batch", type=at_least(1), default=1, help="random prompts in the batch (with --prompt-len)")
    g.add_argument(
        "--max-new-tokens", type=at_least(1), default=128, help="at most this many (stops at EOS; default 128)"
    )
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    add_arguments(g, Sampling)
    g.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds the whole run may take (default 3600)")
    g.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming it")
    g.add_argument("--compare-single", action="store_true", help="check tokens against single-process model.generate")
    g.add_argument("--progress", action="store_true", help="progress bar on rank 0")
    add_arguments(g, Speculation)
    g.add_argument(
        "--draft-model",
        help="the draft model for --speculate draft (same kinds of path as --model, or "
        "a preset); it needs the model's tokenizer",
    )
    g.add_argument(
        "--penalty-alpha",
        type=float,
        default=None,
        help="contrastive search with --top-k candidates: degeneration penalty weight in (0, 1]",
    )
    g.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..launch import under_torchrun

    if under_torchrun() and a.prompt_file == "-":
        print("treeattn generate: --prompt-file - (stdin) needs the local launcher, not torchrun", file=sys.stderr)
        return 2
    return run_ranks("generate", a, worker, prepare, timeout=a.timeout)
