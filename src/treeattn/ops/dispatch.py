"""The one dispatch of a local attention call: :func:`dispatch` chooses the kernel
(:mod:`.kernels`: what each takes, what ``auto`` picks) and runs it: each kernel's run is
below, registered in the registry's ``RUNS`` (what :meth:`~treeattn.ops.kernels.Kernel.run` calls). What every kernel but
``decode_cpu`` starts from is worked out here once: the keys each query row reads (``[lo,
hi)``, :mod:`._bounds`), the keys no row reads trimmed off, the rows that read nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._blocks import _chunked
from ._bounds import _backend, _decode_call, _row_bounds, _trim, one_length
from ._finite import all_finite
from .alibi import Alibi, row_bias
from .kernels import RUNS
from .state import empty_state

__all__ = ["Args", "RUNS", "dispatch", "scale_of"]


@dataclass
class Args:
    """One call of :func:`~treeattn.ops.attention_state` (validated), ``scale`` resolved."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    kv_lens: Tensor | None = None
    causal: bool = False
    mask: Tensor | None = None
    keep_fp32: bool = False
    kv_start: Tensor | None = None
    kv_end: Tensor | None = None
    softcap: float | None = None
    alibi: Alibi | None = None

    @property
    def acc(self) -> torch.dtype:
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32


def scale_of(q: Tensor, scale: float | None) -> float:
    return q.shape[3] ** -0.5 if scale is None else float(scale)


def dispatch(a: Args, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Choose the kernel for ``a`` (``backend``: a name, or ``"auto"``) and run it. ALiBi calls
    run on the torch path (the only kernel that adds the bias)."""
    name = "torch" if a.alibi is not None else _backend(
        a.q, a.k, a.v, backend, a.mask, a.kv_lens, a.causal, a.kv_start, a.kv_end, a.softcap
    )
    return RUNS[name](a)  # = KERNELS[name].run(a)


@dataclass
class _Rows:
    """The keys a call's rows read: ``k``/``v`` (and the mask, the ALiBi key positions) cut to
    them, ``lo``/``hi`` ``[B, 1, G*Tq, 1]`` per row (None: no bound), ``seq`` the per-sequence
    ranges where some sequence reads only part of the keys kept."""

    k: Tensor
    v: Tensor
    mask: Tensor | None
    alibi: Alibi | None
    lo: Tensor | None
    hi: Tensor | None
    kv_lens: Tensor | None  # None where one length for all was cut already
    seq: tuple | None = None


def _bounds(a: Args) -> _Rows:
    q, k, v, kv_lens, mask, alibi = a.q, a.k, a.v, a.kv_lens, a.mask, a.alibi
    B, Hq, Tq, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    n = one_length(q, S, kv_lens, a.causal, a.kv_start, a.kv_end)
    if n is not None:  # a slice of the keys, no per-row bounds to build and trim
        k, v, S, kv_lens = k[:, :, :n], v[:, :, :n], n, None
        mask = None if mask is None else mask[..., :n]
        alibi = None if alibi is None else alibi._replace(k_pos=alibi.k_pos[:, :n])
    lo, hi = _row_bounds(B, Tq, Hq // Hkv, S, kv_lens, a.causal, a.kv_start, a.kv_end, q.device)
    return _Rows(k, v, mask, alibi, lo, hi, kv_lens)


def _trimmed(a: Args) -> _Rows | None:
    """:func:`_bounds` with the keys no row reads cut off; None when no row reads a key."""
    r = _bounds(a)
    B, Hq, Tq, _ = a.q.shape
    lo, hi, span, r.seq = _trim(r.lo, r.hi, r.k.shape[2], B)
    r.lo, r.hi = lo, hi
    if span is not None:
        r.k, r.v = r.k[:, :, span[0] : span[1]], r.v[:, :, span[0] : span[1]]
        if r.mask is not None:
            r.mask = r.mask[..., span[0] : span[1]]
        if r.alibi is not None:
            r.alibi = r.alibi._replace(k_pos=r.alibi.k_pos[:, span[0] : span[1]])
    if r.k.shape[2] == 0 or B * Hq * Tq == 0:
        return None
    return r


def _grouped(a: Args, body) -> tuple[Tensor, Tensor]:
    """Run ``body(a, r, qg, vis)`` on the trimmed rows, the queries folded per KV head ``qg [B,
    Hkv, G*Tq, D]`` (row ``g * Tq + i``) and the dense mask per row ``vis``; shape the result."""
    q, acc = a.q, a.acc
    B, Hq, Tq, D = q.shape
    Hkv, Dv = a.k.shape[1], a.v.shape[3]
    r = _trimmed(a)
    if r is None:
        out, lse = empty_state((B, Hq, Tq, Dv), q.device)
        return out.to(acc if a.keep_fp32 else q.dtype), lse.to(acc)
    qg = q.reshape(B, Hkv, Hq // Hkv * Tq, D)
    vis = None
    if r.mask is not None:  # rows r = g * Tq + i take mask row i
        vis = r.mask.to(q.device).index_select(1, torch.arange(qg.shape[2], device=q.device) % Tq).unsqueeze(1)
    out, lse = body(a, r, qg, vis)
    return out.to(acc if a.keep_fp32 else q.dtype).reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


def _zero_unread(r: _Rows, B: int) -> tuple[Tensor, Tensor]:
    """K/V with the keys outside each sequence's range zeroed: fused kernels would still weigh
    them (by 0: 0 x NaN of unused cache slots would leak into the sums)."""
    S = r.k.shape[2]
    j = torch.arange(S, device=r.k.device).view(1, 1, S, 1)
    bad = (j < r.seq[0].view(B, 1, 1, 1)) | (j >= r.seq[1].view(B, 1, 1, 1))
    return r.k.masked_fill(bad, 0.0), r.v.masked_fill(bad, 0.0)


def _torch_body(a: Args, r: _Rows, qg: Tensor, vis: Tensor | None) -> tuple[Tensor, Tensor]:
    B, Hkv, Tq = a.q.shape[0], a.k.shape[1], a.q.shape[2]
    bias = None if r.alibi is None else row_bias(r.alibi, B, Hkv, Tq, a.acc)
    return _chunked(qg, r.k, r.v, a.scale, r.lo, r.hi, vis, r.seq, a.softcap, bias)


def _fused_body(a: Args, r: _Rows, qg: Tensor, vis: Tensor | None) -> tuple[Tensor, Tensor]:
    from ._fused_cuda import fused_cuda

    B, Tq = a.q.shape[0], a.q.shape[2]
    k, v = _zero_unread(r, B) if r.seq is not None and r.kv_lens is not None else (r.k, r.v)
    hi_r = None if r.hi is None else r.hi.reshape(B, qg.shape[2])
    return fused_cuda(qg, k, v, a.scale, r.kv_lens, hi_r, a.causal, a.softcap, Tq)


def _flash_body(a: Args, r: _Rows, qg: Tensor, vis: Tensor | None) -> tuple[Tensor, Tensor]:
    k, v = _zero_unread(r, a.q.shape[0]) if r.seq is not None else (r.k, r.v)  # a skipped NaN/inf key
    lo, hi = r.lo, r.hi
    # rows of one sequence with different bounds: the kernel's additive -inf mask cannot hide a
    # NaN/inf key or value from the rows that do not see it; the torch path can
    per_row = lo is not None or vis is not None or (hi is not None and bool((hi != hi[:, :, :1]).any()))
    redo = per_row and not all_finite(k, v)
    if not redo:
        out, lse = _flash_cpu(qg, k, v, a.scale, lo, hi, vis)
        # the kernel reports a row whose scores are all NaN as fully masked (lse 0, out 0); its
        # empty rows are -inf by now, so such a row is redone (exactly) on the torch path
        zero = lse == 0  # (the row check only where some lse is 0: it reads all of out)
        redo = bool(zero.any()) and bool((zero & (out == 0).all(-1)).any())
    if redo:
        out, lse = _chunked(qg, k, v, a.scale, lo, hi, vis, None, a.softcap)
    return out, lse


def run_torch(a: Args) -> tuple[Tensor, Tensor]:
    return _grouped(a, _torch_body)


def run_flash_cpu(a: Args) -> tuple[Tensor, Tensor]:
    return _grouped(a, _flash_body)


def run_fused_cuda(a: Args) -> tuple[Tensor, Tensor]:
    return _grouped(a, _fused_body)


def run_decode_cpu(a: Args) -> tuple[Tensor, Tensor]:
    """It reads only each row's ``[lo, hi)``: nothing to trim or zero (a dense mask: torch path)."""
    if a.mask is not None:
        return run_torch(a)
    call = _decode_call(a.q, a.k, a.kv_lens, a.causal, a.kv_start, a.kv_end, a.softcap)
    return call(a.q, a.k, a.v, a.scale, a.keep_fp32)


def run_triton(a: Args) -> tuple[Tensor, Tensor]:
    """Straight to the kernel: it reads each row's bounds itself (no trim, no host sync)."""
    from ._triton_attn import triton_attention

    r = _bounds(a)
    q = a.q
    B, Hq, Tq, D = q.shape
    Hkv, Dv = r.k.shape[1], r.v.shape[3]
    rows_differ = (a.causal and Tq > 1) or a.kv_end is not None or (a.kv_start is not None and a.kv_start.ndim == 2)
    R = Hq // Hkv * Tq
    lo = None if r.lo is None else r.lo.reshape(B, R)
    hi = None if r.hi is None else r.hi.reshape(B, R)
    out, lse = triton_attention(q.reshape(B, Hkv, R, D), r.k, r.v, a.scale, lo, hi, a.softcap, rows_differ, a.keep_fp32)
    return out.reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


RUNS.update(torch=run_torch, flash_cpu=run_flash_cpu, decode_cpu=run_decode_cpu, fused_cuda=run_fused_cuda,
            triton=run_triton)  # (the registry's table: Kernel.run reads it)
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
