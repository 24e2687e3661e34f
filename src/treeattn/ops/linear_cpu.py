"""Linear layers for decode on CPU: float32 weights packed once into one stream of 64-output
groups and multiplied by a compiled AVX-512 kernel (``_linear_cpu.c``, in the decode kernel's
shared object).

A decode step multiplies a few rows by every weight of the model, so what it costs is one read
of the weights. On this project's CPU (AMD EPYC, one thread; SmolLM2-135M's 30 layers of
linears and its LM head, ``benchmarks/packed_linear.py``) oneDNN's packed GEMM reads them at
about half the memory's rate at one row; this kernel at about two thirds, and within a few
percent of oneDNN at 256 rows (compute-bound, a prefill chunk).

Every output is the same sum whatever else is in the call: FMA chains over the inputs in blocks
of 64, in order, the blocks added in order, then the bias. A row's output is therefore bitwise
independent of its batch, its tile and the thread count. The rounding is not MKL's or oneDNN's
(within float32 rounding of both). Threads: OpenMP (torch's pool) where the shared object was
built with ``-fopenmp`` (the first flags tried, see :func:`treeattn.ops.kernel_info`), else one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._decode_cpu import _lib, kernel_features

__all__ = ["linear_available", "pack_weight", "packed_linear", "unpack_weight"]


def linear_available() -> bool:
    """Whether the compiled kernel is loaded and has its AVX-512 path (``"linear512"`` in
    :func:`treeattn.ops.kernel_features`)."""
    return "linear512" in kernel_features()


def _numel(n: int, k: int) -> int:
    return 16 * ((n + 15) // 16) * k


def pack_weight(w: Tensor) -> Tensor:
    """``w [N, K]`` float32 on the CPU, packed: a flat float32 tensor of ``16 * ceil(N / 16) * K``
    elements (outputs padded with zeros to a multiple of 16), for :func:`packed_linear`.
    Raises RuntimeError without the kernel, ValueError for other inputs."""
    lib = _lib()
    if lib is None or not linear_available():
        raise RuntimeError("the compiled AVX-512 linear kernel is not available (treeattn.ops.kernel_info())")
    if w.ndim != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
        raise ValueError(f"pack_weight takes a float32 CPU matrix, got {tuple(w.shape)} {w.dtype} on {w.device}")
    w = w.detach().contiguous()
    wp = torch.empty(_numel(*w.shape), dtype=torch.float32)
    lib.treeattn_linear_pack(w.data_ptr(), w.shape[0], w.shape[1], wp.data_ptr())
    return wp


def unpack_weight(wp: Tensor, n: int, k: int) -> Tensor:
    """The ``[n, k]`` weight that :func:`pack_weight` packed into ``wp`` (bitwise)."""
    np16 = 16 * ((n + 15) // 16)
    full = np16 // 64  # groups of 64 outputs; then one narrower group, if any
    head = wp[: full * 64 * k].view(full, k, 64).permute(0, 2, 1).reshape(full * 64, k)
    rest = wp[full * 64 * k :].view(k, np16 - full * 64).t()
    return torch.cat([head, rest])[:n].contiguous()


def packed_linear(x: Tensor, wp: Tensor, n: int, bias: Tensor | None = None) -> Tensor:
    """``x [..., K] @ W.T + bias`` for the ``[n, K]`` weight packed in ``wp`` (:func:`pack_weight`):
    ``[..., n]`` float32. ``x`` and ``bias [n]`` float32 on the CPU; threads:
    ``torch.get_num_threads()``. Raises ValueError for other inputs."""
    k = x.shape[-1]
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"packed_linear takes float32 CPU inputs, got {x.dtype} on {x.device}")
    if wp.dtype != torch.float32 or wp.device.type != "cpu" or not wp.is_contiguous() or wp.numel() != _numel(n, k):
        raise ValueError(f"packed weight {wp.dtype} of {wp.numel()} elements is not a packed float32 [{n}, {k}]")
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.numel() != n):
        raise ValueError(f"bias must be float32 [{n}] on the CPU, got {bias.dtype} {tuple(bias.shape)} on {bias.device}")
    x2 = x.reshape(x.shape[:-1].numel(), k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    rc = _lib().treeattn_linear(x2.data_ptr(), x2.shape[0], k, n, wp.data_ptr(), None if b is None else b.data_ptr(),
                                y.data_ptr(), max(x2.stride(0), k), n, torch.get_num_threads())  # fmt: skip
    if rc:
        raise RuntimeError(f"treeattn_linear failed ({rc})")
    return y.view(*x.shape[:-1], n)
