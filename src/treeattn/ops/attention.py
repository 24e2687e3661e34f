"""Single-device attention that also returns the log-sum-exp (an attention state)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .state import empty_state, merge_states

__all__ = ["attention_with_lse", "check_attention_inputs", "BACKENDS"]

Backend = Literal["auto", "torch", "flash_cpu", "decode_cpu", "fused_cuda"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "flash_cpu", "decode_cpu", "fused_cuda")

# Largest score block the chunked path materialises, in elements (float32: 32 MiB).
_SCORE_BUDGET = 1 << 23


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_lens: Tensor | None = None,
    *,
    scale: float | None = None,
    check_values: bool = True,
) -> None:
    """Raise ``ValueError`` (``TypeError`` for non-tensors) naming the argument, the
    expected and the actual value when the inputs do not follow the layout contract of
    :func:`attention_with_lse`. ``check_values`` also checks that q is finite and that
    ``kv_lens`` lies in ``[0, S]`` (one host synchronisation)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, D], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating dtype, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    B, Hq, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch size: q has B={B}, k has {k.shape[0]}, v has {v.shape[0]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must agree in [H, S]: k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq must be a multiple of Hkv: Hq={Hq}, Hkv={Hkv}")
    if k.shape[3] != D:
        raise ValueError(f"head dim: q has D={D}, k has D={k.shape[3]}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if kv_lens is not None:
        if not isinstance(kv_lens, Tensor):
            raise TypeError(f"kv_lens must be a torch.Tensor or None, got {type(kv_lens).__name__}")
        if kv_lens.shape != (B,) or kv_lens.is_floating_point() or kv_lens.dtype == torch.bool:
            raise ValueError(
                f"kv_lens must be an integer tensor of shape [B]=({B},), got {kv_lens.dtype} {tuple(kv_lens.shape)}"
            )
        if kv_lens.device != q.device:
            raise ValueError(f"kv_lens must be on q's device {q.device}, got {kv_lens.device}")
    if check_values:
        if not bool(torch.isfinite(q).all()):
            raise ValueError("q contains NaN or inf")
        if kv_lens is not None and B and not bool(((kv_lens >= 0) & (kv_lens <= k.shape[2])).all()):
            raise ValueError(f"kv_lens must lie in [0, S={k.shape[2]}], got {kv_lens.tolist()}")


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    kv_lens: Tensor | None = None,
    causal: bool = False,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:
    """Exact attention of ``q`` over ``k``/``v`` that also returns the log-sum-exp.

    Args:
        q: ``[B, Hq, Tq, D]`` queries, float16/bfloat16/float32/float64.
        k: ``[B, Hkv, S, D]`` keys, same dtype and device; ``Hq % Hkv == 0`` (GQA/MQA:
            query head ``h`` reads kv head ``h // (Hq // Hkv)``; K/V are never repeated).
        v: ``[B, Hkv, S, Dv]`` values.
        scale: softmax scale; default ``1 / sqrt(D)``.
        kv_lens: optional integer ``[B]``: only keys ``0 .. kv_lens[b] - 1`` of sequence
            ``b`` are valid (ragged batches; 0 allowed). Default: all ``S``.
        causal: align the queries to the *end* of each sequence's valid keys (bottom-right,
            as flash-attn for Tq > 1): query ``i`` sees keys ``0 .. L - Tq + i``.
        backend: ``"torch"`` (pure torch, chunked over S so the float32 score block stays
            under 32 MiB, any device), ``"flash_cpu"`` (PyTorch's fused CPU flash kernel,
            a private aten op; CPU, equal q/v head dims, S > 0), ``"decode_cpu"`` (a
            streaming C kernel built with the system compiler on first use, one pass over
            each KV head for all its query heads, pure-PyTorch fallback without a compiler;
            CPU, float32/bfloat16/float16), ``"fused_cuda"`` (flash-attn / PyTorch's fused
            CUDA kernels that return the log-sum-exp; CUDA), or ``"auto"`` (the faster exact
            one for the call; measurements next to ``_pick_backend`` and in the README).

    Returns:
        ``(out, lse)``: ``out [B, Hq, Tq, Dv]`` in q's dtype and ``lse [B, Hq, Tq]``
        float32 (float64 for float64 inputs), natural log of the softmax denominator of
        the *scaled* scores. A row with no visible key has out 0 and lse -inf.

    Raises:
        ValueError: bad shapes, dtypes, devices, kv_lens out of range, non-finite q,
            unknown backend. TypeError: a non-tensor argument.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_attention_inputs(q, k, v, kv_lens, scale=scale)
    return _attention(q, k, v, scale=scale, kv_lens=kv_lens, causal=causal, backend=backend)


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    kv_lens: Tensor | None = None,
    causal: bool = False,
    backend: str = "auto",
    mask: Tensor | None = None,
    keep_fp32: bool = False,
) -> tuple[Tensor, Tensor]:
    """:func:`attention_with_lse` without validation (callers have validated).

    ``mask``: optional bool ``[B or 1, Tq, S]``, True = visible, AND-ed with the rest.
    ``keep_fp32``: return ``out`` in the float32 accumulation dtype (for further merging)."""
    B, Hq, Tq, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = D**-0.5 if scale is None else float(scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if backend == "auto":
        backend = _pick_backend(q, k, v)
        if backend in ("decode_cpu", "fused_cuda") and mask is not None:
            backend = "flash_cpu" if backend == "decode_cpu" and Dv == D else "torch"
    ragged = False  # some sequence has keys masked by kv_lens: they must not even be read
    if kv_lens is not None and B:
        if kv_lens.device.type == "cpu":  # bounds without a device sync
            hi, lo = int(kv_lens.max()), int(kv_lens.min())
            if hi < S:  # keys past every sequence's length (e.g. unused cache capacity)
                k, v, S = k[:, :, :hi], v[:, :, :hi], hi
            ragged = lo < hi
        else:
            ragged = True
    if S == 0 or B * Hq * Tq == 0:
        out, lse = empty_state((B, Hq, Tq, Dv), q.device)
        return out.to(acc if keep_fp32 else q.dtype), lse.to(acc)
    qg = q.reshape(B, Hkv, (Hq // Hkv) * Tq, D)  # row r = g * Tq + i, g the group member
    lim = _visible_limit(B, Tq, Hq // Hkv, S, kv_lens, causal, q.device)
    vis = None
    if mask is not None:  # rows r = g * Tq + i take mask row i
        vis = mask.to(q.device).index_select(1, torch.arange(qg.shape[2], device=q.device) % Tq).unsqueeze(1)
    if backend in ("decode_cpu", "fused_cuda") and mask is not None:
        raise ValueError(f"backend {backend!r} takes no dense mask; use 'torch' or 'flash_cpu'")
    if backend == "decode_cpu":
        if q.device.type != "cpu":
            raise ValueError(f"backend 'decode_cpu' needs CPU tensors, got {q.device}")
        from ._decode_cpu import decode_cpu

        hi = None if lim is None else lim.reshape(B, qg.shape[2])
        out, lse = decode_cpu(qg, k, v, scale, None, hi, None)
        if acc == torch.float64:
            out, lse = out.double(), lse.double()
    elif backend == "fused_cuda":
        from ._fused_cuda import fused_cuda

        hi = None if lim is None else lim.reshape(B, qg.shape[2])
        out, lse = fused_cuda(qg, k, v, scale, kv_lens if ragged else None, hi, causal, None)
    elif backend == "flash_cpu":
        if q.device.type != "cpu" or Dv != D:
            raise ValueError(f"backend 'flash_cpu' needs CPU tensors with Dv == D, got {q.device}, D={D}, Dv={Dv}")
        if ragged:  # a masked key holding NaN/inf would still poison the fused kernel's sums
            bad = (torch.arange(S, device=q.device) >= kv_lens.view(B, 1, 1, 1).to(q.device)).transpose(-1, -2)
            k, v = k.masked_fill(bad, 0.0), v.masked_fill(bad, 0.0)
        out, lse = _flash_cpu(qg, k, v, scale, lim, vis)
    else:
        vlim = kv_lens.view(B, 1, 1, 1).to(q.device) if ragged else None
        out, lse = _chunked(qg, k, v, scale, lim, vis, vlim)
    return out.to(acc if keep_fp32 else q.dtype).reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


# Largest rows per KV head (G * Tq) for which auto picks decode_cpu, per dtype (measured,
# see _pick_backend): past these flash_cpu's GEMM blocking wins.
_DECODE_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 128}


def _pick_backend(q: Tensor, k: Tensor, v: Tensor) -> str:
    # CPU, 1 thread, B=1, D=128, Tq=1 on a shared 2-core EPYC VM (loadavg 4-8), `treeattn bench
    # kernel` (docs/benchmarks.md, "Decode kernel"): decode_cpu beats flash_cpu and torch in
    # every measured row (fp32 16/16 and 32/8, bf16 16/16 and 32/8, S = 16k..256k).
    # Rows per KV head sweep (S=16k, 8 KV heads, no mask), flash_cpu time / decode_cpu time:
    #   rows   1      4     8     16    32    64    128
    #   fp32   4.01   2.53  1.74  1.57  1.07  0.83  0.90
    #   bf16   8.98   1.93  1.80  1.20  0.95  1.00  1.04   (after the 2-key bf16 4-row path)
    #   fp16   5.40   5.50  2.46  2.50  1.90  1.87  1.96   (flash_cpu is slow in fp16)
    # flash_cpu: at least as fast as the grouped matmul path in float32/float64 and much
    # faster in half precision, where the matmul path upcasts K/V chunks to float32.
    # CUDA: the fused kernels (flash-attn / aten flash / mem-efficient) when available.
    if q.device.type == "cpu":
        rows = (q.shape[1] // k.shape[1]) * q.shape[2]
        if rows <= _DECODE_MAX_ROWS.get(q.dtype, 0):
            return "decode_cpu"
        if v.shape[3] == q.shape[3]:
            return "flash_cpu"
        return "torch"
    if q.device.type == "cuda":
        from ._fused_cuda import fused_cuda_supported

        if fused_cuda_supported(q, k, v):
            return "fused_cuda"
    return "torch"


def _visible_limit(
    B: int, Tq: int, G: int, S: int, kv_lens: Tensor | None, causal: bool, device: torch.device
) -> Tensor | None:
    """Per (batch, row) exclusive upper bound of the visible key index, ``[B, 1, G*Tq, 1]``
    int64, or None when every key is visible to every row."""
    if kv_lens is None and not (causal and Tq > 1):
        return None
    L = torch.full((B,), S, device=device) if kv_lens is None else kv_lens.to(device=device, dtype=torch.int64)
    lim = L.view(B, 1, 1, 1).expand(B, 1, G * Tq, 1)
    if causal:
        i = torch.arange(G * Tq, device=device) % Tq
        lim = lim - (Tq - 1) + i.view(1, 1, G * Tq, 1)
    return lim


def _chunked(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    lim: Tensor | None,
    vis: Tensor | None = None,
    vlim: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked online-softmax attention. ``vlim [B, 1, 1, 1]``: zero the values at or past
    each sequence's length (0 x NaN would otherwise leak masked garbage into the sum)."""
    B, Hkv, R, _ = qg.shape
    S, Dv = k.shape[2], v.shape[3]
    acc = torch.float64 if qg.dtype == torch.float64 else torch.float32
    chunk = max(256, _SCORE_BUDGET // max(1, B * Hkv * R))
    qs = qg.to(acc) * scale
    out, lse = empty_state((B, Hkv, R, Dv), qg.device)
    for s0 in range(0, S, chunk):
        kc, vc = k[:, :, s0 : s0 + chunk], v[:, :, s0 : s0 + chunk]
        s = torch.matmul(qs, kc.to(acc).transpose(-1, -2))  # [B, Hkv, R, C]
        if lim is not None:
            j = torch.arange(s0, s0 + kc.shape[2], device=qg.device)
            s = s.masked_fill(j >= lim, float("-inf"))
        if vis is not None:
            s = s.masked_fill(~vis[..., s0 : s0 + kc.shape[2]], float("-inf"))
        if vlim is not None:
            jv = torch.arange(s0, s0 + kc.shape[2], device=qg.device).view(1, 1, -1, 1)
            vc = vc.masked_fill(jv >= vlim, 0.0)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(s - m)
        den = p.sum(-1)
        o = torch.matmul(p.to(vc.dtype) if vc.dtype != acc else p, vc).to(acc)
        o = o / torch.where(den > 0, den, 1.0).unsqueeze(-1)
        c_lse = m.squeeze(-1) + torch.log(den)
        if s0 == 0:
            out, lse = o, c_lse
        else:
            out, lse = merge_states(out, lse, o, c_lse)
    return out, lse


def _flash_cpu(
    qg: Tensor, k: Tensor, v: Tensor, scale: float, lim: Tensor | None, vis: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    mask = empty = None
    if lim is not None or vis is not None:
        j = torch.arange(k.shape[2], device=qg.device)
        hide = (j >= lim) if lim is not None else torch.zeros(1, 1, 1, k.shape[2], dtype=torch.bool, device=qg.device)
        if vis is not None:
            hide = hide | ~vis
        mask = torch.zeros((), dtype=qg.dtype, device=qg.device).masked_fill(hide, float("-inf"))
        empty = hide.all(-1)  # [B or 1, 1, R]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, attn_mask=mask, scale=scale)
    if empty is not None:  # the kernel reports a fully masked row as lse 0 / out 0
        empty = empty.expand_as(lse)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    lse = lse.to(torch.float64 if qg.dtype == torch.float64 else torch.float32)
    return out, torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
