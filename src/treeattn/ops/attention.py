"""Single-device attention that also returns the log-sum-exp (an attention state)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ._blocks import _chunked
from ._bounds import _backend, _decode_call, _row_bounds, _trim, one_length
from .alibi import Alibi, check_alibi, row_bias
from .state import empty_state

__all__ = ["attention_with_lse", "attention_state", "check_attention_inputs", "BACKENDS"]

Backend = Literal["auto", "torch", "flash_cpu", "decode_cpu", "fused_cuda", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "flash_cpu", "decode_cpu", "fused_cuda", "triton")


def all_finite(*ts: Tensor) -> bool:
    """Whether every element of ``ts`` is finite, in one host sync: a NaN or inf element makes
    the sum of sums non-finite; only when it is (or finite values overflow it) are the tensors
    scanned element by element (one pass per tensor, against ~4 for ``isfinite(t).all()``)."""
    ts = [t for t in ts if t.numel()]
    if not ts or bool(torch.isfinite(sum(t.sum() for t in ts))):
        return True
    return all(bool(torch.isfinite(t).all()) for t in ts)


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
    distributed ops, once per call): the one entry to the local kernels, which it chooses
    (``backend``) and runs.

    ``mask``: optional bool ``[B or 1, Tq, S]``, True = visible, AND-ed with the rest.
    ``kv_end``: optional integer ``[B]`` or ``[B, Tq]``, exclusive per-query upper bound
    AND-ed with kv_lens/causal (a prefill's causal bound for keys in position order).
    ``keep_fp32``: return ``out`` in the float32 accumulation dtype (for further merging)."""
    B, Hq, Tq, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = D**-0.5 if scale is None else float(scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # ALiBi: the torch path alone adds the bias
    backend = "torch" if alibi is not None else _backend(q, k, v, backend, mask, kv_lens, causal, kv_start, kv_end, softcap)
    if backend == "decode_cpu" and mask is None:  # it reads only each row's [lo, hi): nothing to trim or zero
        return _decode_call(q, k, kv_lens, causal, kv_start, kv_end, softcap)(q, k, v, scale, keep_fp32)
    G = Hq // Hkv
    n = one_length(q, S, kv_lens, causal, kv_start, kv_end)
    if n is not None:  # a slice of the keys, no per-row bounds to build and trim
        k, v, S, kv_lens = k[:, :, :n], v[:, :, :n], n, None
        mask = None if mask is None else mask[..., :n]
        alibi = None if alibi is None else alibi._replace(k_pos=alibi.k_pos[:, :n])
    # every row's visible keys are [lo, hi) (AND the optional dense mask), computed here only
    lo, hi = _row_bounds(B, Tq, G, S, kv_lens, causal, kv_start, kv_end, q.device)
    if backend == "triton":  # straight to the kernel: it reads each row's bounds itself (no trim, no sync)
        rows_differ = (causal and Tq > 1) or kv_end is not None or (kv_start is not None and kv_start.ndim == 2)
        return _triton(q, k, v, scale, lo, hi, softcap, rows_differ, keep_fp32)
    lo, hi, span, seq = _trim(lo, hi, S, B)
    if span is not None:
        k, v = k[:, :, span[0] : span[1]], v[:, :, span[0] : span[1]]
        S = k.shape[2]
        if mask is not None:
            mask = mask[..., span[0] : span[1]]
        if alibi is not None:
            alibi = alibi._replace(k_pos=alibi.k_pos[:, span[0] : span[1]])
    if S == 0 or B * Hq * Tq == 0:
        out, lse = empty_state((B, Hq, Tq, Dv), q.device)
        return out.to(acc if keep_fp32 else q.dtype), lse.to(acc)
    qg = q.reshape(B, Hkv, G * Tq, D)  # row r = g * Tq + i, g the group member
    vis = None
    if mask is not None:  # rows r = g * Tq + i take mask row i
        vis = mask.to(q.device).index_select(1, torch.arange(qg.shape[2], device=q.device) % Tq).unsqueeze(1)
    if backend == "fused_cuda":
        from ._fused_cuda import fused_cuda

        if seq is not None and kv_lens is not None:  # masked keys weigh 0 there: 0 x NaN of unused slots would leak
            j = torch.arange(S, device=q.device).view(1, 1, S, 1)
            bad = (j < seq[0].view(B, 1, 1, 1)) | (j >= seq[1].view(B, 1, 1, 1))
            k, v = k.masked_fill(bad, 0.0), v.masked_fill(bad, 0.0)
        hi_r = None if hi is None else hi.reshape(B, qg.shape[2])
        out, lse = fused_cuda(qg, k, v, scale, kv_lens, hi_r, causal, softcap, Tq)
    elif backend == "flash_cpu":
        if seq is not None:  # a skipped key holding NaN/inf would still poison the fused kernel's sums
            j = torch.arange(S, device=q.device).view(1, 1, S, 1)
            bad = (j < seq[0].view(B, 1, 1, 1)) | (j >= seq[1].view(B, 1, 1, 1))
            k, v = k.masked_fill(bad, 0.0), v.masked_fill(bad, 0.0)
        # rows of one sequence with different bounds: the kernel's additive -inf mask cannot
        # hide a NaN/inf key or value from the rows that do not see it; the torch path can
        per_row = lo is not None or vis is not None or (hi is not None and bool((hi != hi[:, :, :1]).any()))
        redo = per_row and not all_finite(k, v)
        if not redo:
            out, lse = _flash_cpu(qg, k, v, scale, lo, hi, vis)
            # the kernel reports a row whose scores are all NaN as fully masked (lse 0, out 0);
            # its empty rows are -inf by now, so such a row is redone (exactly) on the torch path
            zero = lse == 0  # (the row check only where some lse is 0: it reads all of out)
            redo = bool(zero.any()) and bool((zero & (out == 0).all(-1)).any())
        if redo:
            out, lse = _chunked(qg, k, v, scale, lo, hi, vis, None, softcap)
    else:
        bias = None if alibi is None else row_bias(alibi, B, Hkv, Tq, acc)
        out, lse = _chunked(qg, k, v, scale, lo, hi, vis, seq, softcap, bias)
    return out.to(acc if keep_fp32 else q.dtype).reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


def _triton(q, k, v, scale, lo, hi, softcap, row_bounds: bool, keep_fp32: bool) -> tuple[Tensor, Tensor]:
    from ._triton_attn import triton_attention

    B, Hq, Tq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    R = Hq // Hkv * Tq
    qg = q.reshape(B, Hkv, R, D)
    lo = None if lo is None else lo.reshape(B, R)
    hi = None if hi is None else hi.reshape(B, R)
    out, lse = triton_attention(qg, k, v, scale, lo, hi, softcap, row_bounds, keep_fp32)
    return out.reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


def _flash_cpu(
    qg: Tensor, k: Tensor, v: Tensor, scale: float, lo: Tensor | None, hi: Tensor | None, vis: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    mask = empty = None
    if lo is not None or hi is not None or vis is not None:
        j = torch.arange(k.shape[2], device=qg.device)
        hide = torch.zeros(1, 1, 1, k.shape[2], dtype=torch.bool, device=qg.device)
        if hi is not None:
            hide = hide | (j >= hi)
        if lo is not None:
            hide = hide | (j < lo)
        if vis is not None:
            hide = hide | ~vis
        mask = torch.zeros((), dtype=qg.dtype, device=qg.device).masked_fill(hide, float("-inf"))
        empty = hide.all(-1)  # [B or 1, 1, R]
    # PyTorch's CPU flash kernel returns garbage for rows whose last dim is strided (torch 2.13)
    qg, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (qg, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, attn_mask=mask, scale=scale)
    if empty is not None:  # the kernel reports a fully masked row as lse 0 / out 0
        empty = empty.expand_as(lse)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    # an inf score: lse +inf (which a merge would read as empty), out NaN in float32 but 0 in
    # bfloat16; undefined either way
    bad = (lse == float("inf")) | lse.isnan()
    if bool(bad.any()):
        out, lse = out.masked_fill(bad.unsqueeze(-1), float("nan")), lse.masked_fill(bad, float("nan"))
    return out, lse.to(torch.float64 if qg.dtype == torch.float64 else torch.float32)
