"""The floating dtypes treeattn knows, written once: their names (the CLIs' ``--dtype``), bytes
per element (the cost and memory models), the torch dtypes, and one integer code each (the
cross-rank agreements compare integers). The compiled kernels' own enumeration is their C
ABI (``ops._decode_cpu``), not a table of this kind."""

from __future__ import annotations

import torch

__all__ = ["BYTES", "CHOICES", "TORCH", "code", "torch_dtype"]

#: name -> bytes per element
BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
#: name -> torch dtype
TORCH: dict[str, torch.dtype] = {n: getattr(torch, n) for n in BYTES}
#: the ``--dtype`` choices of the CLIs (models and K/V; float64 is for references)
CHOICES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_CODE = {t: i + 1 for i, t in enumerate(TORCH.values())}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (ValueError naming the choices otherwise)."""
    if name not in TORCH:
        raise ValueError(f"dtype must be one of {tuple(TORCH)}, got {name!r}")
    return TORCH[name]


def code(dtype: torch.dtype) -> int | None:
    """A stable integer for a floating ``dtype`` treeattn knows (None for any other)."""
    return _CODE.get(dtype)
