"""Single-device attention that also returns the log-sum-exp (an attention state)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ._finite import all_finite
from .alibi import Alibi, check_alibi
from .dispatch import Args, dispatch, scale_of

__all__ = ["attention_with_lse", "attention_state", "all_finite", "check_attention_inputs", "BACKENDS"]

Backend = Literal["auto", "torch", "flash_cpu", "decode_cpu", "fused_cuda", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "flash_cpu", "decode_cpu", "fused_cuda", "triton")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_lens: Tensor | None = None,
    *,
    scale: float | None = None,
    check_values: bool = True,
    kv_start: Tensor | None = None,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> None:
    """Raise ``ValueError`` (``TypeError`` for non-tensors) naming the argument, the
    expected and the actual value when the inputs do not follow the layout contract of
    :func:`attention_with_lse`. ``check_values`` also checks that q is finite and that
    ``kv_lens`` and ``kv_start`` lie in ``[0, S]`` (one host synchronisation)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, D], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
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
    if scale is not None and not (
        isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
    ):
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
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not (math.isfinite(softcap) and softcap > 0)
    ):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    check_alibi(alibi, B, Hq, q.shape[2], k.shape[2], q.device)
    if kv_start is not None:
        if not isinstance(kv_start, Tensor):
            raise TypeError(f"kv_start must be a torch.Tensor or None, got {type(kv_start).__name__}")
        Tq = q.shape[2]
        if (
            kv_start.shape not in ((B,), (B, Tq))
            or kv_start.is_floating_point()
            or kv_start.is_complex()
            or kv_start.dtype == torch.bool
        ):
            raise ValueError(
                f"kv_start must be an integer tensor of shape [B]=({B},) or [B, Tq]=({B}, {Tq}), got "
                f"{kv_start.dtype} {tuple(kv_start.shape)}"
            )
        if kv_start.device != q.device:
            raise ValueError(f"kv_start must be on q's device {q.device}, got {kv_start.device}")
    if check_values:
        if not all_finite(q):
            raise ValueError("q contains NaN or inf")
        if kv_lens is not None and B and not bool(((kv_lens >= 0) & (kv_lens <= k.shape[2])).all()):
            raise ValueError(f"kv_lens must lie in [0, S={k.shape[2]}], got {kv_lens.tolist()}")
        if kv_start is not None and kv_start.numel() and not bool(((kv_start >= 0) & (kv_start <= k.shape[2])).all()):
            raise ValueError(f"kv_start must lie in [0, S={k.shape[2]}], got {kv_start.tolist()}")


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    kv_lens: Tensor | None = None,
    causal: bool = False,
    kv_start: Tensor | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
    check: bool = True,
    alibi: Alibi | None = None,
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
        kv_start: optional integer ``[B]`` or ``[B, Tq]`` in ``[0, S]``, on q's device: the
            first key each sequence (or each query) sees; keys below it are invisible — the
            lower bound of a sliding window, as ``kv_lens``/``causal`` give the upper one.
            On the CPU the keys outside every row's ``[kv_start, end)`` are not computed.
        softcap: optional ``c > 0``: each scaled score ``s = scale * q.k`` becomes
            ``c * tanh(s / c)`` before the softmax and the lse (Gemma-2 attention-logit
            softcapping), so states of shards still merge exactly. The ``flash_cpu`` kernel
            has no softcap: a call with ``softcap`` always runs the torch path.
        alibi: optional :class:`treeattn.ops.Alibi` ``(slopes [Hq], q_pos [B] or [B, Tq],
            k_pos [B, S])``: ``slopes[h] * (k_pos[j] - q_pos[i])`` is added to each (softcapped)
            score (BLOOM's and MPT's position bias, on global positions so shards merge
            exactly). Only the torch path adds it: a call with ``alibi`` always runs there.
        backend: ``"torch"`` (pure torch, chunked over S so the float32 score block stays
            under 32 MiB, any device), ``"flash_cpu"`` (PyTorch's fused CPU flash kernel,
            a private aten op; CPU, equal q/v head dims, S > 0), ``"decode_cpu"`` (a
            streaming C kernel built with the system compiler on first use, one pass over
            each KV head for all its query heads, pure-PyTorch fallback without a compiler;
            CPU, float32/bfloat16/float16), ``"fused_cuda"`` (flash-attn / PyTorch's fused
            CUDA kernels that return the log-sum-exp; CUDA), or ``"auto"`` (the faster exact
            one for the call; the measurements are beside ``ops.kernels.pick`` and in docs/backends.md and docs/gpu.md),
            ``"triton"`` (split-KV flash attention in Triton: the G query heads of a KV
            head share every K/V load, per-row key bounds, softcap; CUDA, or CPU under
            ``TRITON_INTERPRET=1``; float16/bfloat16/float32; what ``auto`` picks on CUDA
            when triton is installed).
        check: validate values too (q finite, kv_lens/kv_start in range): one host sync.
            With ``check=False`` only shapes, dtypes and devices are checked, and on CUDA
            the call reads nothing from the device (CUDA-graph and decode-loop friendly).

    Returns:
        ``(out, lse)``: ``out [B, Hq, Tq, Dv]`` in q's dtype and ``lse [B, Hq, Tq]``
        float32 (float64 for float64 inputs), natural log of the softmax denominator of
        the *scaled* (and softcapped) scores. A row with no visible key has out 0 and lse -inf.
        A row with a NaN or +inf score (a NaN in a key it sees; an inf in one gives a +-inf
        or NaN score, or a finite one under softcap) gets out and lse NaN on every backend,
        and a NaN or inf value it weighs reaches the output dims it is in, as in plain
        PyTorch; rows that do not see such a key or value are unaffected, and keys outside
        every row's bounds (kv_lens, unused capacity) are never read.

    Raises:
        ValueError: bad shapes, dtypes, devices, kv_lens or kv_start out of range, a
            softcap that is not a finite positive float, an alibi of the wrong shapes, dtypes
            or device, non-finite q, unknown backend.
            TypeError: a non-tensor argument.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_attention_inputs(q, k, v, kv_lens, scale=scale, kv_start=kv_start, softcap=softcap, check_values=check,
                           alibi=alibi)  # fmt: skip
    return attention_state(q, k, v, scale=scale, kv_lens=kv_lens, causal=causal, kv_start=kv_start, softcap=softcap,
                      backend=backend, alibi=alibi)  # fmt: skip


def attention_state(
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
    kv_start: Tensor | None = None,
    kv_end: Tensor | None = None,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`attention_with_lse` without validation, for callers that validated (the
    distributed ops, once per call): the one entry to the local kernels, which
    :func:`treeattn.ops.dispatch.dispatch` chooses (``backend``) and runs.

    ``mask``: optional bool ``[B or 1, Tq, S]``, True = visible, AND-ed with the rest.
    ``kv_end``: optional integer ``[B]`` or ``[B, Tq]``, exclusive per-query upper bound
    AND-ed with kv_lens/causal (a prefill's causal bound for keys in position order).
    ``keep_fp32``: return ``out`` in the float32 accumulation dtype (for further merging)."""
    a = Args(q, k, v, scale_of(q, scale), kv_lens, causal, mask, keep_fp32, kv_start, kv_end, softcap, alibi)
    return dispatch(a, backend)
