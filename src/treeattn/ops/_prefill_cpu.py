"""Causal prefill attention on CPU: ``_prefill_cpu.c`` (float32, AVX-512), a flash-attention
kernel built into the decode kernel's shared object (:mod:`._decode_cpu`: first use, system
compiler, ``TREEATTN_NO_CKERNEL=1`` disables both).

:func:`treeattn.parallel.prefill.causal_states` hands it every prefill block it can take: one
call per block with per-query ``[start, end)`` key bounds (causal rows, sliding windows, rows
that see nothing), where PyTorch's fused kernel needs a prefix call, a causal-triangle call and
a merge per run of rows, or a dense mask. The rows of all query heads of a KV head share each
K/V load. Measured on this 2-core AVX-512 VM (float32, 9/3 heads, D = 64;
docs/benchmarks/kernels.md): 0.62-0.87x the time of the PyTorch path with 2 threads, 0.68-0.92x with 1, for 1024
queries over 1k-7k keys. Anything else (other dtypes, softcap, non-finite keys or values,
value dims not a multiple of 64, an explicit backend, no AVX-512, ``TREEATTN_PREFILL_KERNEL=0``,
shapes that do not match, inputs that need gradients, a failed scratch allocation) returns None
and keeps the PyTorch path. The batched step's shared-prefix pass
(:func:`treeattn.runtime._cascade.prefix_state`) calls it too, with ``check=False``: it checks the
result instead of the keys and values."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ._decode_cpu import _lib, _rows, kernel_features
from ._finite import all_finite

__all__ = ["prefill_states"]

_RB = 32  # query positions per task (PF_RB in the C file)
# Below these PyTorch's path is as fast or faster (this VM, 9/3 heads, D = 64, 1 and 2 threads):
# rows x keys per KV head under 16k (0.26-0.34 ms either way; from 24k on the kernel took
# 0.65-0.87x), and row blocks padded beyond 80 % (20 queries over 7k keys, 20 / 32 real rows:
# 1.18-1.28x; whole blocks: 0.62-0.92x).
_MIN_WORK = 1 << 14
_MIN_FILL = 0.8


def prefill_states(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Tensor | None,
    end: Tensor | None,
    scale: float | None,
    softcap: float | None,
    backend: str,
    *,
    min_fill: float | None = None,
    min_work: int | None = None,
    check: bool = True,
) -> tuple[Tensor, Tensor] | None:
    """State of ``q [B, Hq, T, D]`` over ``k``/``v [B, Hkv, S, D|Dv]`` where query ``i`` sees the
    keys ``start[i] <= j < end[i]`` (host int64 ``[T]``; None: 0 and S): ``(out float32
    [B, Hq, T, Dv], lse float32 [B, Hq, T])``, empty rows 0 and -inf. None when the kernel does
    not apply (see the module docstring); the caller then takes its PyTorch path. ``min_fill``:
    the least share of real rows in the padded 32-row blocks (default: the one measured against
    PyTorch's path), ``min_work`` the least rows x keys per KV head (default: likewise).
    A row's result does not depend on the other rows of the call (its key blocks start at
    multiples of 96 whatever their bounds). ``check=False`` skips the finiteness pass over the keys and values read
    (a full read of them): the caller must then treat a non-finite result as "not applicable"
    (a NaN or +inf score, or a non-finite value read, gives NaN in the rows that weigh it, by 0
    included; a row whose every key scores -inf gets 0 and -inf, where PyTorch gives NaN)."""
    B, Hq, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    if not (
        backend == "auto"
        and softcap is None
        and q.device.type == k.device.type == v.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and Dv % 64 == 0
        and B * Hq * T > 0
        and Hkv > 0
        and Hq % Hkv == 0
        and k.shape == (B, Hkv, S, D)
        and v.shape[:3] == k.shape[:3]
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and T * (Hq // Hkv) * S >= (_MIN_WORK if min_work is None else min_work)
        and T >= (_MIN_FILL if min_fill is None else min_fill) * _RB * -(-T // _RB)
        and os.environ.get("TREEATTN_PREFILL_KERNEL", "") != "0"
        and "prefill512" in kernel_features()
    ):
        return None
    bounded = start is not None or end is not None
    threads = torch.get_num_threads()
    if bounded and (check or threads > 1):
        lo_k = torch.zeros(T, dtype=torch.int64) if start is None else start.to(torch.int64).clamp(0, S)
        hi_k = torch.full((T,), S, dtype=torch.int64) if end is None else end.to(torch.int64).clamp(0, S)
    if check:
        a, b = 0, S
        if bounded:
            live = hi_k > lo_k  # rows that read keys: only their range must be finite
            a, b = (int(lo_k[live].min()), int(hi_k[live].max())) if bool(live.any()) else (0, 0)
        if a < b and not all_finite(k[:, :, a:b], v[:, :, a:b]):
            return None  # a masked key's value would still be weighed (by 0): PyTorch's path
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    G = Hq // Hkv
    qg = q.contiguous().view(B, Hkv, G * T, D)  # row g * T + i: query i of head h * G + g
    lo, hi = _rows(start, B, T), _rows(end, B, T)  # [B, T]: the same bounds for every sequence
    order = None
    if bounded and threads > 1:  # longest row blocks first: balanced threads
        nrb = -(-T // _RB)
        pad = nrb * _RB - T
        hmax = torch.nn.functional.pad(hi_k, (0, pad), value=0).view(nrb, _RB).amax(-1)
        lmin = torch.nn.functional.pad(lo_k, (0, pad), value=S).view(nrb, _RB).amin(-1)
        cost = (hmax - lmin).clamp(min=0).expand(B * Hkv, nrb).reshape(-1)  # task (b * Hkv + h) * nrb + block
        order = torch.argsort(cost, descending=True, stable=True).contiguous()
    out = torch.empty(B, Hkv, G * T, Dv, dtype=torch.float32)
    lse = torch.empty(B, Hkv, G * T, dtype=torch.float32)
    s = D**-0.5 if scale is None else float(scale)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rc = _lib().treeattn_prefill(
        qg.data_ptr(), k.data_ptr(), v.data_ptr(), s, B, Hkv, G, T, S, D, Dv,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ptr(lo), ptr(hi), ptr(order), threads, out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    if rc == 1:
        return None  # a thread could not allocate its scratch: PyTorch's path
    if rc != 0:
        raise ValueError(f"prefill kernel: bad arguments (rc={rc}) for q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out.view(B, Hq, T, Dv), lse.view(B, Hq, T)
