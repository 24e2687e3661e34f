"""Which keys each query row reads (``[lo, hi)`` per row from lengths, starts, ends and
causality), which kernel :func:`~treeattn.ops.attention.attention_state` runs, and its decode_cpu
call with the rows' bounds worked out once (:func:`prepare_decode`: a batched step's layers
share them)."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import Call, pick, resolve
from .state import empty_state


def _backend(q, k, v, backend, mask, kv_lens, causal, kv_start, kv_end, softcap) -> str:
    """The kernel :func:`attention_state` runs for these arguments."""
    if backend == "auto":
        plain = kv_lens is None and kv_start is None and kv_end is None and mask is None and softcap is None
        backend = pick(q, k, v, plain=plain, causal_rows=causal and q.shape[2] > 1)
        if backend in ("decode_cpu", "fused_cuda", "triton") and mask is not None:
            backend = "flash_cpu" if backend == "decode_cpu" and v.shape[3] == q.shape[3] else "torch"
    # the registry (ops.kernels) knows what each kernel takes, hands over (flash_cpu: softcap;
    # fused_cuda: per-row bounds) or refuses
    return resolve(backend, Call.of(q, v, mask=mask, softcap=softcap, kv_start=kv_start, kv_end=kv_end))


class DecodeCall:
    """:func:`attention_state`'s decode_cpu call with each row's keys worked out once, for calls of
    one shape, the same bounds and softcap (the layers of a batched step): called with their q,
    k, v, it passes the kernel the arguments :func:`attention_state` would, so the bits are the same."""

    def __init__(self, n: int | None, lo: Tensor | None, hi: Tensor | None, empty: bool, softcap) -> None:
        self.n, self.lo, self.hi, self.empty, self.softcap = n, lo, hi, empty, softcap  # n: keys kept (None: all)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
                 keep_fp32: bool = False) -> tuple[Tensor, Tensor]:  # fmt: skip
        B, Hq, Tq, D = q.shape
        Hkv, Dv = k.shape[1], v.shape[3]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if self.n is not None:
            k, v = k[:, :, : self.n], v[:, :, : self.n]
        if self.empty or k.shape[2] == 0 or B * Hq * Tq == 0:  # no row reads a key: no kernel call
            out, lse = empty_state((B, Hq, Tq, Dv), q.device)
            return out.to(acc if keep_fp32 else q.dtype), lse.to(acc)
        from ._decode_cpu import decode_cpu

        scale = D**-0.5 if scale is None else float(scale)  # keys outside a row's [lo, hi) are never read
        out, lse = decode_cpu(q.reshape(B, Hkv, Hq // Hkv * Tq, D), k, v, scale, self.lo, self.hi, self.softcap)
        if acc == torch.float64:
            out, lse = out.double(), lse.double()
        return out.to(acc if keep_fp32 else q.dtype).reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


def prepare_decode(q: Tensor, k: Tensor, v: Tensor, *, kv_lens: Tensor | None = None, causal: bool = False,
                   kv_start: Tensor | None = None, kv_end: Tensor | None = None, softcap: float | None = None,
                   backend: str = "auto") -> DecodeCall | None:  # fmt: skip
    """What :func:`attention_state` (without a mask) runs for these arguments, where that is the
    decode_cpu kernel, ready for calls of the same shapes and bounds; None where it is another."""
    if _backend(q, k, v, backend, None, kv_lens, causal, kv_start, kv_end, softcap) != "decode_cpu":
        return None
    return _decode_call(q, k, kv_lens, causal, kv_start, kv_end, softcap)


def _decode_call(q: Tensor, k: Tensor, kv_lens, causal: bool, kv_start, kv_end, softcap) -> DecodeCall:
    B, Hq, Tq, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    n = one_length(q, S, kv_lens, causal, kv_start, kv_end)
    if n is not None:
        S, kv_lens = n, None
    lo, hi = _row_bounds(B, Tq, Hq // Hkv, S, kv_lens, causal, kv_start, kv_end, q.device)
    empty = False
    if lo is not None or hi is not None:
        empty = not bool(((S if hi is None else hi.clamp(max=S)) > (0 if lo is None else lo)).any())
    R = Hq // Hkv * Tq  # the kernel's [B, R] int64 bounds, made once
    lo, hi = (None if x is None else x.reshape(B, R).contiguous() for x in (lo, hi))
    return DecodeCall(n, lo, hi, empty, softcap)


def one_length(q: Tensor, S: int, kv_lens, causal: bool, kv_start, kv_end) -> int | None:
    """The keys every sequence reads where that is one length on the CPU and nothing else bounds
    a row (a decode step's cache): the call takes a slice of the keys, no per-row bounds."""
    if kv_lens is None or q.device.type != "cpu" or kv_start is not None or kv_end is not None:
        return None
    if causal and q.shape[2] > 1:
        return None
    lens = kv_lens.tolist()  # a host tensor: no sync
    return min(max(int(lens[0]), 0), S) if len(set(lens)) == 1 else None


def _per_row(t: Tensor, B: int, Tq: int, R: int, device: torch.device) -> Tensor:
    t = t.to(device=device, dtype=torch.int64)
    if t.ndim == 1:
        return t.view(B, 1, 1, 1).expand(B, 1, R, 1)
    return t.repeat(1, R // Tq).view(B, 1, R, 1)  # row r = g * Tq + i takes query i


def _row_bounds(
    B: int,
    Tq: int,
    G: int,
    S: int,
    kv_lens: Tensor | None,
    causal: bool,
    kv_start: Tensor | None,
    kv_end: Tensor | None,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """Per (batch, row) visible key range ``[lo, hi)``, each ``[B, 1, G*Tq, 1]`` int64 or
    None (no bound). Row ``r = g * Tq + i`` is query ``i`` of group member ``g``."""
    R = G * Tq
    hi = None
    if kv_lens is not None or (causal and Tq > 1) or kv_end is not None:
        L = torch.full((B,), S, device=device) if kv_lens is None else kv_lens.to(device=device, dtype=torch.int64)
        hi = L.view(B, 1, 1, 1).expand(B, 1, R, 1)
        if causal:
            i = torch.arange(R, device=device) % Tq
            hi = hi - (Tq - 1) + i.view(1, 1, R, 1)
        if kv_end is not None:
            hi = torch.minimum(hi, _per_row(kv_end, B, Tq, R, device))
    lo = None if kv_start is None else _per_row(kv_start, B, Tq, R, device)
    return lo, hi


def _trim(lo: Tensor | None, hi: Tensor | None, S: int, B: int):
    """Keys no row reads. Returns ``(lo, hi, span, seq)``: the bounds relative to the kept
    key slice ``span = (a, b)`` (None: keep all ``S``; bounds that hide nothing dropped), and
    ``seq = (seq_lo, seq_hi)`` ``[B]`` when some sequence reads only part of the slice (its
    other values must be zeroed: 0 x NaN of unused cache slots would leak into the sums)."""
    if lo is None and hi is None:
        return None, None, None, None
    ref = lo if lo is not None else hi
    if ref.numel() == 0:  # no rows (B or Tq 0): nothing is read
        return None, None, (0, 0), None
    if ref.device.type != "cpu":  # no host sync off the CPU: mask only
        seq_lo = lo.amin((1, 2, 3)).clamp(0, S) if lo is not None else torch.zeros(B, dtype=torch.int64)
        seq_hi = hi.amax((1, 2, 3)).clamp(0, S) if hi is not None else torch.full((B,), S, dtype=torch.int64)
        return lo, hi, None, (seq_lo.to(ref.device), seq_hi.to(ref.device))
    seq_lo = lo.amin((1, 2, 3)).clamp(0, S) if lo is not None else torch.zeros(B, dtype=torch.int64)
    seq_hi = hi.amax((1, 2, 3)).clamp(0, S) if hi is not None else torch.full((B,), S, dtype=torch.int64)
    live = seq_lo < seq_hi
    if not bool(live.any()):
        return None, None, (0, 0), None
    a, b = int(seq_lo[live].min()), int(seq_hi[live].max())
    if a:
        lo = lo - a if lo is not None else None
        hi = hi - a if hi is not None else None
        seq_lo, seq_hi = seq_lo - a, seq_hi - a
    n = b - a
    seq_lo, seq_hi = seq_lo.clamp(0, n), seq_hi.clamp(0, n)
    if lo is not None and not bool((lo > 0).any()):
        lo = None
    if hi is not None and not bool((hi < n).any()):
        hi = None
    ragged = bool((seq_lo[live] > 0).any() or (seq_hi[live] < n).any() or (~live).any())
    return lo, hi, ((a, b) if (a, b) != (0, S) else None), ((seq_lo, seq_hi) if ragged else None)
