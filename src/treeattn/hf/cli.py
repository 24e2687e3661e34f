"""``treeattn generate``: end-to-end generation across local ranks or under torchrun."""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

PRESETS: dict[str, tuple[str, dict]] = {
    # tiny configs with random weights (GQA everywhere); "small" is for latency measurements
    "tiny-llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)),
    "tiny-qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)),
    "tiny-mistral": ("mistral", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, vocab_size=512, sliding_window=None)),
    "small-llama": ("llama", dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)),
}  # fmt: skip


def build_model(preset: str | None, model_dir: str | None, dtype: torch.dtype, seed: int = 0) -> tuple:
    """``(model, tokenizer or None)``: a preset with random weights (seeded: the same on every
    rank) or a local directory (safetensors only, nothing downloaded, no remote code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_dir:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, use_safetensors=True, trust_remote_code=False, dtype=dtype
        )
        tok = None
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
        except Exception:
            tok = None
        return model.eval(), tok
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    kind, kw = PRESETS[preset]
    cfg = AutoConfig.for_model(kind, max_position_embeddings=1 << 20, initializer_range=0.2, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval(), None


def _prompt(a, tok, vocab: int) -> torch.Tensor:
    if a.prompt is not None:
        if tok is None:
            raise ValueError("--prompt needs a tokenizer in --model; use --prompt-ids or --prompt-len")
        return tok(a.prompt, return_tensors="pt").input_ids
    if a.prompt_ids:
        return torch.tensor([[int(x) for x in a.prompt_ids.split(",")]])
    g = torch.Generator().manual_seed(a.seed + 1)
    return torch.randint(0, vocab, (a.batch, a.prompt_len), generator=g)


def worker(a: argparse.Namespace) -> None:
    from .generate import generate

    rank = dist.get_rank()
    dtype = getattr(torch, a.dtype)
    model, tok = build_model(a.preset, a.model, dtype, a.seed)
    ids = _prompt(a, tok, model.config.vocab_size)
    if a.device == "cuda":  # one GPU per rank (untested here: CI has no GPU)
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        model, ids = model.to(dev), ids.to(dev)
    timings: dict = {}
    out = generate(
        model,
        ids,
        max_new_tokens=a.max_new_tokens,
        placement=a.placement,
        block=a.block,
        attention=a.attention,
        strategy=a.strategy,
        do_sample=a.sample,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        info=timings,
        progress=a.progress,
    )
    t = torch.tensor([timings["ttft"], statistics.median(timings["decode"]) if timings["decode"] else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    same = torch.tensor([1 if a.compare_single else 0])
    if a.compare_single and rank == 0:
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # else generate infers padding from pad_token_id
            max_new_tokens=a.max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[:, ids.shape[1] :]
        same[0] = int(torch.equal(ref, out))
    if rank != 0:
        return
    p = dist.get_world_size()
    what = a.model or a.preset
    print(
        f"model {what}, {a.dtype}, p={p}, prompt {tuple(ids.shape)}, attention={a.attention}, placement={a.placement}"
    )
    for b in range(out.shape[0]):
        text = f"  {tok.decode(out[b])!r}" if tok is not None else ""
        print(f"tokens[{b}]: {out[b].tolist()}{text}")
    print(
        f"time to first token {t[0] * 1e3:.1f} ms; decode {t[1] * 1e3:.2f} ms/token (median over {len(timings['decode'])} steps, max over ranks)"
    )
    mem = timings["cache_bytes"]
    print(f"KV cache on rank 0: {mem['used'] / 2**20:.1f} MiB used of {mem['allocated'] / 2**20:.1f} MiB allocated")
    if a.compare_single:
        if same[0]:
            print("compare-single: identical to single-process model.generate")
        else:
            print("compare-single: MISMATCH against single-process model.generate")
            raise SystemExit(2)


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate with a transformers model whose KV cache is sharded across ranks")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", help="local model directory (safetensors weights; nothing is downloaded)")
    src.add_argument(
        "--preset", default="tiny-llama", choices=list(PRESETS), help="random-weight config (default tiny-llama)"
    )
    pr = g.add_mutually_exclusive_group()
    pr.add_argument("--prompt", help="text (needs the model's tokenizer)")
    pr.add_argument("--prompt-ids", help="comma-separated token ids")
    pr.add_argument("--prompt-len", type=int, default=64, help="random prompt of this length (default 64)")
    g.add_argument("--batch", type=int, default=1, help="random prompts in the batch (with --prompt-len)")
    g.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    g.add_argument("--max-new-tokens", type=int, default=24)
    g.add_argument("--attention", choices=["tree", "ring"], default="tree")
    g.add_argument("--strategy", default="auto")
    g.add_argument("--placement", choices=["interleaved", "contiguous"], default="interleaved")
    g.add_argument("--block", type=int, default=1)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL (torchrun)")
    g.add_argument("--timeout", type=float, default=3600.0)
    g.add_argument("--compare-single", action="store_true", help="check tokens against single-process model.generate")
    g.add_argument("--progress", action="store_true", help="progress bar on rank 0")
    g.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():  # under torchrun
        torch.set_num_threads(a.threads)
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
        try:
            worker(a)
        finally:
            dist.destroy_process_group()
        return 0
    from ..launch import LaunchError, launch

    try:
        launch(
            worker,
            a.nproc,
            (a,),
            threads=a.threads,
            timeout=a.timeout,
            backend="nccl" if a.device == "cuda" else "gloo",
        )
    except LaunchError as e:
        print(f"treeattn generate failed: {e}", file=sys.stderr)
        return 1
    return 0
