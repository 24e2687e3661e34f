"""Every local attention kernel treeattn has, in one registry: where it runs and which calls
it takes (and why not). :func:`~treeattn.ops.attention_with_lse` checks an explicit backend
here; ``auto``'s choice among them (measured) is ``ops.attention._pick_backend``; causal
prefill blocks go through :func:`causal_block_states`. ``tests/ops/test_kernels.py`` holds
every kernel to the float64 reference on every device it claims.

| kernel | devices | implementation |
|---|---|---|
| ``torch`` | any | pure PyTorch, chunked online softmax (``_blocks``) |
| ``flash_cpu`` | cpu | PyTorch's fused CPU flash kernel (a private aten op) |
| ``decode_cpu`` | cpu | treeattn's C decode kernel (``_decode_cpu.c``; PyTorch fallback) |
| ``fused_cuda`` | cuda | flash-attn / aten's flash and efficient kernels (``_fused_cuda``) |
| ``triton`` | cuda (cpu under ``TRITON_INTERPRET=1``) | split-KV flash attention (``_triton_attn``) |

The C prefill kernel (``_prefill_cpu.c``) serves causal blocks with per-row bounds, through
:func:`causal_block_states` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["KERNELS", "Call", "Kernel", "causal_block_states", "causal_square_states", "resolve", "why_not"]

_HALF_F32 = (torch.float16, torch.bfloat16, torch.float32)
_TRITON_MAX_DIM = 256


@dataclass(frozen=True)
class Call:
    """What a kernel needs to know to accept a call of :func:`attention_with_lse`."""

    device: str
    dtype: torch.dtype
    D: int
    Dv: int
    mask: bool = False  # a dense bool mask (internal callers)
    softcap: bool = False
    bounds: bool = False  # kv_start or a per-row upper bound (kv_end)

    @classmethod
    def of(cls, q: Tensor, v: Tensor, *, mask=None, softcap=None, kv_start=None, kv_end=None) -> Call:
        return cls(q.device.type, q.dtype, q.shape[3], v.shape[3], mask is not None, softcap is not None,
                   kv_start is not None or kv_end is not None)  # fmt: skip


@dataclass(frozen=True)
class Kernel:
    name: str
    devices: tuple[str, ...]  # where it runs (a kernel may claim a device only conditionally: ``why_not``)
    why_not: Callable[[Call], str | None]  # None: it takes the call; else the reason it does not
    to_torch: Callable[[Call], bool] = lambda c: False  # calls it hands to the torch path instead of refusing


def _torch(c: Call) -> str | None:
    return None


def _flash_cpu(c: Call) -> str | None:
    if c.device != "cpu":
        return f"needs CPU tensors, got {c.device}"
    if c.D != c.Dv:
        return f"needs equal q/v head dims, got D={c.D}, Dv={c.Dv}"
    if c.softcap:
        return "has no softcap (such calls run the torch path)"
    return None  # (float64 and float16 too)


def _decode_cpu(c: Call) -> str | None:
    if c.device != "cpu":
        return f"needs CPU tensors, got {c.device}"
    if c.mask:
        return "takes no dense mask"
    return None


def _fused_cuda(c: Call) -> str | None:
    if c.device != "cuda":
        return f"needs CUDA tensors, got {c.device}"
    if c.dtype not in _HALF_F32:
        return f"takes float16/bfloat16/float32, got {c.dtype}"
    if c.mask:
        return "takes no dense mask"
    if c.bounds:
        return "takes no per-row key bounds (such calls run the torch path)"
    return None


def _triton(c: Call) -> str | None:
    from ._triton_attn import _have_triton, interpreting

    if not _have_triton():
        return "needs triton (the 'gpu' extra)"
    if not (c.device == "cuda" or (c.device == "cpu" and interpreting())):
        return f"needs CUDA tensors (CPU only under TRITON_INTERPRET=1), got {c.device}"
    if c.dtype not in _HALF_F32:
        return f"takes float16/bfloat16/float32, got {c.dtype}"
    if c.mask:
        return "takes no dense mask"
    if max(c.D, c.Dv) > _TRITON_MAX_DIM:
        return f"takes head dims up to {_TRITON_MAX_DIM} (its K/V tiles live in shared memory), got D={c.D}, Dv={c.Dv}"
    return None


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("torch", ("cpu", "cuda"), _torch),
        Kernel("flash_cpu", ("cpu",), _flash_cpu, lambda c: c.softcap),
        Kernel("decode_cpu", ("cpu",), _decode_cpu),
        Kernel("fused_cuda", ("cuda",), _fused_cuda,
               lambda c: c.bounds or (c.device == "cuda" and c.dtype not in _HALF_F32)),  # fmt: skip
        Kernel("triton", ("cuda", "cpu"), _triton),
    )
}


def why_not(name: str, call: Call) -> str | None:
    """Why kernel ``name`` does not take ``call`` (None: it does)."""
    return KERNELS[name].why_not(call)


def resolve(name: str, call: Call) -> str:
    """The kernel that runs ``call`` asked of ``name``: ``name`` itself, or ``"torch"`` for the
    calls ``name`` hands over; raises ``ValueError`` with the reason for the calls it refuses."""
    kern = KERNELS[name]
    if kern.to_torch(call):
        return "torch"
    reason = kern.why_not(call)
    if reason is not None:
        hint = "; use 'torch' or 'flash_cpu'" if call.mask and "mask" in reason else ""
        raise ValueError(f"backend {name!r} {reason}{hint}")
    return name


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
    float32 aten's efficient kernel on whole blocks measured faster, see ``_cuda_backend``)."""
    from ._prefill_cpu import prefill_states
    from ._triton_attn import triton_available
    from .attention import _attention

    st = prefill_states(q, k, v, start, end, scale, softcap, backend)
    if st is not None:
        return st
    if end is not None and q.device.type == "cuda" and triton_available(q) and (
        backend == "triton" or (backend == "auto" and q.dtype != torch.float32)
    ):
        B = q.shape[0]
        kw = dict(kv_end=end.to(q.device).expand(B, -1))
        if start is not None:
            kw["kv_start"] = start.to(q.device).expand(B, -1)
        return _attention(q, k, v, scale=scale, softcap=softcap, backend="triton", keep_fp32=True, **kw)
    return None


def causal_square_states(q: Tensor, k: Tensor, v: Tensor, scale, softcap, backend: str) -> tuple[Tensor, Tensor]:
    """Square causal block (query row i sees keys 0..i), float32 states: PyTorch's fused CPU
    flash kernel with ``is_causal`` (it skips the blocks above the diagonal; grouped K/V heads
    natively, no copy) where it applies, else :func:`attention_with_lse`'s dispatch."""
    from .attention import _attention, all_finite

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    fused = (q.device.type == "cpu" and backend in ("auto", "flash_cpu") and softcap is None
             and k.shape[3] == v.shape[3] and all_finite(k, v))  # fmt: skip
    if not fused:
        return _attention(q, k, v, scale=scale, softcap=softcap, backend=backend, causal=True, keep_fp32=True)
    s = q.shape[3] ** -0.5 if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernel misreads strided rows
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True, scale=s)
    return out.to(acc), lse.to(acc)
