"""Causal prefill blocks in as few kernel calls as the kernels allow: per-row key bounds in one
call (the C prefill kernel on AVX-512 CPUs, the Triton kernel on CUDA), a square causal block
through PyTorch's causal flash kernel; otherwise :func:`~treeattn.ops.attention_with_lse`'s
dispatch. ``parallel.prefill`` calls these and knows no kernel itself."""

from __future__ import annotations

import torch
from torch import Tensor

from ._prefill_cpu import prefill_states
from ._triton_attn import triton_available
from .attention import all_finite, attention_state

__all__ = ["causal_block_states", "causal_square_states"]

# A square causal block in half precision on CUDA through aten's flash kernel (is_causal, grouped
# K/V heads natively, with the lse) instead of the Triton kernel's per-row bounds. Off until
# measured: `python benchmarks/gpu_kernel.py --sections prefill` times both. Why it may pay: at
# an 8,192-token prompt treeattn's bf16 time to first token was 2.2x a transformers forward's
# (SDPA's flash kernel) on an H200, 2026-11-27, with the same linear layers.
SQUARE_FLASH = False


def causal_block_states(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Tensor | None,
    end: Tensor | None,
    scale: float | None,
    softcap: float | None,
    backend: str,
) -> tuple[Tensor, Tensor] | None:
    """A causal prefill block in one kernel call: query ``i`` of ``q [B, Hq, T, D]`` sees the
    keys ``start[i] <= j < end[i]`` (host int64 ``[T]``; None: 0 and S) of ``k/v``. Float32
    states, or None when no fused kernel takes the block (the caller then splits it): the C
    prefill kernel on AVX-512 CPUs (float32), the Triton kernel on CUDA (half precision; in
    float32 aten's efficient kernel on whole blocks measured faster, see ``kernels.pick``)."""
    st = prefill_states(q, k, v, start, end, scale, softcap, backend)
    if st is not None:
        return st
    if SQUARE_FLASH and backend == "auto" and _square_flash(q, k, v, start, end, softcap):
        s = q.shape[3] ** -0.5 if scale is None else float(scale)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True, scale=s)[:2]
        return out.float(), lse.float()
    if end is not None and q.device.type == "cuda" and triton_available(q) and (
        backend == "triton" or (backend == "auto" and q.dtype != torch.float32)
    ):
        B = q.shape[0]
        kw = dict(kv_end=end.to(q.device).expand(B, -1))
        if start is not None:
            kw["kv_start"] = start.to(q.device).expand(B, -1)
        return attention_state(q, k, v, scale=scale, softcap=softcap, backend="triton", keep_fp32=True, **kw)
    return None


def _square_flash(q: Tensor, k: Tensor, v: Tensor, start, end, softcap) -> bool:
    """Whether aten's flash kernel takes the block whole: query ``i`` sees keys ``0..i`` of as
    many keys as queries (a square, where its causal alignment is unambiguous), half precision
    on CUDA, no window or softcap, head dims it supports. Host checks only."""
    T, D, Dv = q.shape[2], q.shape[3], v.shape[3]
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and start is None
            and softcap is None and end is not None and k.shape[2] == T and D == Dv and D % 8 == 0
            and D <= 256 and q.shape[1] % k.shape[1] == 0 and torch.equal(end, torch.arange(1, T + 1)))  # fmt: skip


def causal_square_states(q: Tensor, k: Tensor, v: Tensor, scale, softcap, backend: str) -> tuple[Tensor, Tensor]:
    """Square causal block (query row i sees keys 0..i), float32 states: PyTorch's fused CPU
    flash kernel with ``is_causal`` (it skips the blocks above the diagonal; grouped K/V heads
    natively, no copy) where it applies, else :func:`attention_with_lse`'s dispatch."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    fused = (q.device.type == "cpu" and backend in ("auto", "flash_cpu") and softcap is None
             and k.shape[3] == v.shape[3] and all_finite(k, v))  # fmt: skip
    if not fused:
        return attention_state(q, k, v, scale=scale, softcap=softcap, backend=backend, causal=True, keep_fp32=True)
    s = q.shape[3] ** -0.5 if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernel misreads strided rows
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True, scale=s)
    return out.to(acc), lse.to(acc)
