"""Fused CUDA attention kernels that return the log-sum-exp, behind the ``(out, lse)``
contract of :func:`treeattn.ops.attention_with_lse` (backend ``"fused_cuda"``).

Kernels, in order of preference (:func:`plan` picks one per call):

* ``flash_attn``: ``flash_attn.flash_attn_with_kvcache(..., return_softmax_lse=True)`` when
  the package is installed: native GQA, ragged ``cache_seqlens``, bottom-right causal, softcap.
  fp16/bf16, D == Dv <= 256.
* ``aten_efficient``: ``torch.ops.aten._efficient_attention_forward`` (memory-efficient
  kernel, fp16/bf16/fp32), dense keys (it ignored ``seqlen_k`` on an H200: ragged calls take
  the torch path); GQA by folding the G query heads
  of a KV head into its query rows (one pass over K/V), which is exact whenever all rows of a
  head see the same keys (no causal mask or Tq == 1); causal Tq > 1 with G > 1 runs one
  bottom-right causal call per group member.
* ``aten_flash``: ``torch.ops.aten._scaled_dot_product_flash_attention`` for dense
  (non-ragged) fp16/bf16 calls without a causal mask, rows folded as above.

All three return the natural-log log-sum-exp of the *scaled* scores (flash-attn's
``softmax_lse``; PyTorch's kernels compute ``max + log(sum)`` in natural-log units of
``scale * q.k``). Anything else (softcap without flash-attn, unusual head dims) uses the
chunked pure-PyTorch path (``_blocks._chunked``) on the GPU, which reads nothing from the device. Nothing CUDA-only
is imported at module import.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from ._blocks import _chunked

__all__ = ["fused_cuda", "fused_cuda_supported", "plan"]

_HALF = (torch.float16, torch.bfloat16)


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def fused_cuda_supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """True when ``q``/``k``/``v`` are CUDA tensors of a dtype some fused kernel takes."""
    return q.device.type == "cuda" and q.dtype in (*_HALF, torch.float32)


def plan(
    dtype: torch.dtype,
    D: int,
    Dv: int,
    G: int,
    Tq: int,
    causal: bool,
    ragged: bool,
    softcap: float | None,
    has_flash_attn: bool,
) -> str:
    """Which kernel serves a call: ``"flash_attn"``, ``"aten_efficient"``, ``"aten_flash"``
    or ``"torch"`` (pure PyTorch). Pure function of the call's shape, usable on CPU."""
    if has_flash_attn and dtype in _HALF and D == Dv and D <= 256 and D % 8 == 0:
        return "flash_attn"
    if softcap:
        return "torch"
    if ragged:  # aten's efficient kernel ignores seqlen_k without cu_seqlens (seen on an H200): exact torch path
        return "torch"
    if D % 8 == 0 and Dv % 8 == 0 and max(D, Dv) <= 256 and dtype in (*_HALF, torch.float32):
        if dtype in _HALF and D == Dv and not ragged and not (causal and Tq > 1):
            return "aten_flash"
        return "aten_efficient"
    return "torch"


def fused_cuda(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    kv_lens: Tensor | None,
    hi: Tensor | None,
    causal: bool,
    softcap: float | None = None,
    Tq: int = 1,
) -> tuple[Tensor, Tensor]:
    """Grouped-row attention on CUDA. ``qg [B, Hkv, R, D]`` (row ``g*Tq + i``), ``k``/``v``
    ``[B, Hkv, S, D|Dv]``, ``kv_lens`` int ``[B]`` or None, ``hi`` int ``[B, R]`` the
    per-row exclusive key bound (None: all S), ``causal`` bottom-right, ``Tq`` the queries per
    group member. Keys beyond ``kv_lens`` must hold finite
    values (the kernels weigh masked keys by 0). Returns
    ``(out [B, Hkv, R, Dv], lse float32 [B, Hkv, R])``; rows with no key give (0, -inf)."""
    if qg.device.type != "cuda":
        raise ValueError(f"backend 'fused_cuda' needs CUDA tensors, got {qg.device}")
    B, H, R, D = qg.shape
    S, Dv = k.shape[2], v.shape[3]
    Tq = Tq if causal else R  # without a causal mask every row is independent: one group of R rows
    G = R // Tq
    kind = plan(qg.dtype, D, Dv, G, Tq, causal, kv_lens is not None, softcap, _has_flash_attn())
    if kind == "torch":  # the chunked torch path: exact, and it reads nothing from the device
        return _chunked(qg, k, v, scale, None, None if hi is None else hi.reshape(B, 1, R, 1), None, None, softcap)
    if kind == "flash_attn":
        from flash_attn import flash_attn_with_kvcache

        q = qg.reshape(B, H * G, Tq, D).transpose(1, 2)  # [B, Tq, Hq, D]
        seqlens = torch.full((B,), S, dtype=torch.int32, device=qg.device) if kv_lens is None else kv_lens.int()
        out, lse = flash_attn_with_kvcache(
            q, k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=seqlens, softmax_scale=scale,
            causal=causal, softcap=float(softcap or 0.0), return_softmax_lse=True,
        )  # fmt: skip
        out = out.transpose(1, 2).reshape(B, H, R, Dv)
        lse = lse.reshape(B, H, R)
    elif kind == "aten_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qg, k, v, scale=scale)[:2]
    else:
        out, lse = _efficient(qg, k, v, scale, kv_lens, causal, G, Tq)
    return _fix_empty(out, lse.float(), hi)


def _efficient(qg, k, v, scale, kv_lens, causal, G, Tq):
    B, H, R, D = qg.shape
    seqlen_k = None if kv_lens is None else kv_lens.to(torch.int32)
    kk, vv = k.transpose(1, 2), v.transpose(1, 2)  # [B, S, H, D]
    if not (causal and Tq > 1):
        q = qg.transpose(1, 2)  # [B, R, H, D]: every row of a head sees the same keys
        out, lse = torch.ops.aten._efficient_attention_forward(
            q, kk, vv, None, None, None, None, None, 0.0, 0, True, scale=scale, seqlen_k=seqlen_k
        )[:2]
        return out.transpose(1, 2), lse[:, :, :R]
    outs, lses = [], []
    for g in range(G):  # bottom-right causal per group member (custom_mask_type 2)
        q = qg[:, :, g * Tq : (g + 1) * Tq].transpose(1, 2)
        o, l = torch.ops.aten._efficient_attention_forward(
            q, kk, vv, None, None, None, None, None, 0.0, 2, True, scale=scale, seqlen_k=seqlen_k
        )[:2]
        outs.append(o.transpose(1, 2))
        lses.append(l[:, :, :Tq])
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _fix_empty(out: Tensor, lse: Tensor, hi: Tensor | None) -> tuple[Tensor, Tensor]:
    """Rows without a visible key (``hi <= 0``; ``hi`` ``[B, R]`` or None: every row sees
    keys) become ``(0, -inf)``, whatever the kernel marked them with (+inf, NaN, -inf). A
    non-finite lse on any other row comes from a NaN or inf score: ``(NaN, NaN)``, as the CPU
    backends give (flash-attn marks both cases +inf)."""
    bad = torch.isnan(lse) | (lse == float("inf"))
    if hi is not None:
        empty = (hi <= 0).unsqueeze(1).expand_as(lse)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
        bad = bad & ~empty
    return out.masked_fill(bad.unsqueeze(-1), float("nan")), lse.masked_fill(bad, float("nan"))
