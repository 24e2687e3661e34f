"""Whether a run fits this host or device, checked before any rank starts: ``generate``'s
prompt, and ``serve``'s K/V budget (``--kv-cache-memory`` turned into ``--cache-tokens``)."""

from __future__ import annotations

import argparse
import os

import torch

from ..config import Serving
from .model import UsageError, ranks_of, say

_GIB = 2.0**30


def _free(a: argparse.Namespace) -> tuple[int | None, str, int]:
    """(bytes free, where, the ranks sharing them)."""
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but torch sees no CUDA device")
        return int(torch.cuda.mem_get_info()[0]), "this GPU", 1
    from ..hf.models import available_memory  # (where tests give a host another size)

    local = ranks_of(a)[1]
    return available_memory(), f"this host ({local} ranks)", local


def check_fit(a: argparse.Namespace, plan: dict[str, int], hint: str) -> None:
    """UsageError when ``plan`` (bytes per rank: ``weights``, ``kv_cache``, ``activations``,
    ``total``) times the ranks sharing the memory exceeds 90 % of what is free."""
    free, where, sharing = _free(a)
    need = plan["total"] * sharing
    if free is not None and need > 0.9 * free:
        raise UsageError(
            f"does not fit: ~{plan['total'] / _GIB:.1f} GiB per rank (weights {plan['weights'] / _GIB:.1f}, KV cache "
            f"{plan['kv_cache'] / _GIB:.1f}, activations {plan['activations'] / _GIB:.1f}) = {need / _GIB:.1f} GiB on "
            f"{where}, {free / _GIB:.1f} GiB available. {hint}"
        )


def serve_budget(a: argparse.Namespace, cfg) -> None:
    """``serve``: ``--kv-cache-memory`` into ``a.cache_tokens`` (K/V tokens per rank), then the
    weights, that K/V and a step's activations checked against the memory free at start."""
    from ..hf.models import kv_token_bytes, memory_plan

    p, _ = ranks_of(a)
    dtype, tpa = getattr(torch, a.dtype), a.tpa
    plan = memory_plan(cfg, prompt_len=(a.prefill_chunk or 1024) * p, max_new_tokens=0, nproc=p, dtype=dtype,
                       prefill_chunk=a.prefill_chunk or None, tp=a.tp, tpa=tpa)  # fmt: skip
    per = kv_token_bytes(cfg, dtype, tpa)
    if a.kv_cache_memory is not None:
        if a.cache_tokens != Serving.cache_tokens:
            raise UsageError("give --kv-cache-memory or --cache-tokens, not both")
        kind, x, text = a.kv_cache_memory
        if kind == "fraction":
            free, where, sharing = _free(a)
            if free is None:
                raise UsageError(f"--kv-cache-memory {text}: the memory available is unknown here; "
                                 "give a size (e.g. 4GiB)")  # fmt: skip
            x = x * (free / sharing - plan["weights"] - plan["activations"])
            if x < per:
                raise UsageError(f"--kv-cache-memory {text}: {where} has {free / _GIB:.1f} GiB "
                                 f"available, nothing left for the K/V after the weights")  # fmt: skip
        a.cache_tokens = int(x // per)
        if a.cache_tokens < 1:
            raise UsageError(f"--kv-cache-memory {text}: less than one token's K/V ({per:,} bytes a token)")
        if int(os.environ.get("RANK", "0")) == 0:
            say(f"--kv-cache-memory {text}: {a.cache_tokens:,} K/V tokens per rank "
                f"({a.cache_tokens * per / _GIB:.2f} GiB, {per:,} bytes a token)")  # fmt: skip
    kv = a.cache_tokens * per
    plan = dict(plan, kv_cache=kv, total=plan["weights"] + kv + plan["activations"])
    check_fit(a, plan, "Lower --cache-tokens or --kv-cache-memory, spread the ranks over more hosts/devices, "
              "split the weights (--tp), or use --dtype bfloat16")  # fmt: skip
