"""Launching compiled Triton kernels with little host time.

Triton's own launch binds, specializes, keys and formats every argument of a kernel on every
call: on the H200 host that was ~50-80 µs per launch of the split-KV kernel's ~45 arguments,
which bounded an eager decode call below ~128k keys. A :class:`Launcher` serves one call
signature (its caller's plan, which fixes the shapes, strides, dtypes and constexprs): a key's
first call goes through Triton (which compiles if needed) and keeps the compiled kernel, later
calls launch that kernel directly. The key, computed by the caller, must determine whatever
Triton specializes on that the plan does not fix (an int being 1 or a multiple of 16, a
pointer's 16-byte alignment). If a direct launch raises (another Triton's calling convention),
every later launch goes through Triton.
"""

from __future__ import annotations

import os
from collections.abc import Hashable

LEAN = os.environ.get("TREEATTN_TRITON_LEAN", "1") != "0"  # benchmarks/gpu_kernel.py compares both


class Launcher:
    ok = True  # class-wide: cleared when a direct launch raises

    def __init__(self, fn, n_args: int, kw: dict) -> None:
        """``fn`` a ``triton.jit`` kernel called with ``n_args`` positional arguments and ``kw``
        (its constexprs, every one after the positional ones, and launch options)."""
        self.fn, self.kw, self.compiled = fn, kw, {}
        names = list(getattr(fn, "arg_names", ()))
        self.tail = tuple(kw[n] for n in names[n_args:]) if names else None

    def __call__(self, grid: tuple[int, int, int], key: Hashable | None, args: tuple) -> None:
        """Launch on ``grid`` (3 dims); ``key`` None: always through Triton (the interpreter)."""
        if key is not None and LEAN and Launcher.ok and self.tail is not None:
            kernel = self.compiled.get(key)
            if kernel is not None:
                try:
                    kernel[grid](*args, *self.tail)
                    return
                except (TypeError, ValueError, AttributeError, IndexError):
                    Launcher.ok = False
        kernel = self.fn[grid](*args, **self.kw)
        if key is not None and kernel is not None:
            self.compiled[key] = kernel
