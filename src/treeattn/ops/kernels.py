"""Every local attention kernel treeattn has, in one registry: where it runs, which calls it
takes (and why not), how it runs one (:meth:`Kernel.run`) and which one ``auto`` runs
(:func:`pick`, with the measurements behind it). :func:`~treeattn.ops.attention_with_lse`
resolves every backend here and runs it through :func:`treeattn.ops.dispatch.dispatch`; causal
prefill blocks go through :mod:`treeattn.ops.causal`. ``tests/ops/test_kernels.py`` holds every kernel
to the float64 reference on every device it claims.

| kernel | devices | implementation |
|---|---|---|
| ``torch`` | any | pure PyTorch, chunked online softmax (``_blocks``) |
| ``flash_cpu`` | cpu | PyTorch's fused CPU flash kernel (a private aten op) |
| ``decode_cpu`` | cpu | treeattn's C decode kernel (``_decode_cpu.c``; PyTorch fallback) |
| ``fused_cuda`` | cuda | flash-attn / aten's flash and efficient kernels (``_fused_cuda``) |
| ``triton`` | cuda (cpu under ``TRITON_INTERPRET=1``) | split-KV flash attention (``_triton_attn``) |

The C prefill kernel (``_prefill_cpu.c``) serves causal blocks with per-row bounds, through
:func:`treeattn.ops.causal.causal_block_states` only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._fused_cuda import fused_cuda_supported
from ._triton_attn import _have_triton, interpreting, triton_available

__all__ = ["KERNELS", "Call", "Kernel", "pick", "resolve", "why_not"]

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
    """A local attention kernel: where it runs, which calls it takes (:meth:`accepts`) and
    how it runs one (:meth:`run`, an :class:`treeattn.ops.dispatch.Args`; the dispatch alone calls it)."""

    name: str
    devices: tuple[str, ...]  # where it runs (a kernel may claim a device only conditionally: ``why_not``)
    why_not: Callable[[Call], str | None]  # None: it takes the call; else the reason it does not
    to_torch: Callable[[Call], bool] = lambda c: False  # calls it hands to the torch path instead of refusing

    def accepts(self, call: Call) -> str | None:
        """None when this kernel takes ``call``, else the reason it does not."""
        return self.why_not(call)

    def run(self, args) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of the call ``args`` (validated, accepted) on this kernel."""
        return RUNS[self.name](args)


# name -> how the kernel runs a call (an ``ops.dispatch.Args``), filled by :mod:`.dispatch`, where
# the runs live (importing this registry, not imported by it)
RUNS: dict[str, Callable] = {}


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


# Largest rows per KV head (G * Tq) for which auto picks decode_cpu, per dtype (measured,
# see pick): past these flash_cpu's GEMM blocking wins.
_DECODE_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16, torch.float16: 128}
_DECODE_MAX_ROWS_F32_AVX512 = 48  # float32 when the kernel has its AVX-512 row groups
_DECODE_MAX_ROWS_F32_AVX512_PLAIN = 768  # the same, every row seeing every key (measured up to 768)
# bfloat16 when the kernel has AVX512-BF16 dot products (bf16 q and K/V, D = Dv, D % 32 == 0)
_DECODE_MAX_ROWS_BF16DP = 128


def pick(q: Tensor, k: Tensor, v: Tensor, *, plain: bool = False, causal_rows: bool = False) -> str:
    """The kernel ``auto`` runs for ``q``/``k``/``v`` (the measured choice among the registry's).
    ``plain``: no kv_lens, window, per-row bound, mask or softcap (every row sees every key);
    ``causal_rows``: a causal mask over several queries."""
    # CPU, 1 thread, B=1, D=128, Tq=1 on a shared 2-core EPYC VM (loadavg 4-8), `treeattn bench
    # kernel` (docs/benchmarks/kernels.md): decode_cpu beats flash_cpu and torch in
    # every measured row (fp32 16/16 and 32/8, bf16 16/16 and 32/8, S = 16k..256k).
    # Rows per KV head sweep (S=16k, 8 KV heads, no mask), flash_cpu time / decode_cpu time:
    #   rows   1      4     8     16    32    64    128
    #   fp32   4.01   2.53  1.74  1.57  1.07  0.83  0.90
    #   bf16   8.98   1.93  1.80  1.20  0.95  1.00  1.04   (after the 2-key bf16 4-row path)
    #   fp16   5.40   5.50  2.46  2.50  1.90  1.87  1.96   (flash_cpu is slow in fp16)
    #   bf16 with AVX512-BF16 (the 2026-11-23 EPYC VM, loadavg ~0.9, mean of two sweeps; at 1
    #   row both machines run the same AVX2 code):
    #          8.98   2.45  2.41  1.99  1.35  1.43  1.27
    #   with the AVX-512 4-row path (same VM, three sweeps, lowest-highest):
    #   fp32   3.8    1.9-2.1  1.5-1.6  1.1-1.2  0.92-0.95  1.0-1.05  1.0-1.15
    #   bf16   9.7-10.8  3.6-3.9  1.9-2.2  1.3-1.4  1.1-1.2  1.3-1.4  1.4-1.5
    #   (fp32 limit 16 until 2026-11-27: at 32 rows flash_cpu was ahead in every sweep then)
    #   2026-11-27, AVX-512 EPYC VM, K/V out of cache (60 MB of layers cycled, as a model's step
    #   reads them), one thread, fp32, attention_state with each backend forced:
    #     Hkv=3 D=64 G=3 S=3861 (SmolLM2's shard): rows 18 1.35, 24 1.25, 33 1.20, 48 1.06,
    #       66 0.99, 96 0.90
    #     Hkv=8 D=128 G=4 S=16k: rows 8 2.33, 16 1.61, 24 1.35, 32 1.13, 64 1.13
    #   so fp32 took decode_cpu up to 48 rows with AVX-512 (a batched step's 8 rows x 3 query
    #   heads); AVX2 alone keeps 16 (the Zen 1 sweep below: 0.70-0.73 at 32 rows).
    #   2026-11-28, the same VM and method (20 / 4 layers cycled), after the 3-tail-row padding:
    #     Hkv=3 D=64 G=3 S=3861: rows 48 1.43, 96 1.29, 192 1.22, 384 1.21, 768 1.15 (S=7700:
    #       48 1.49, 96 1.37, 144 1.36)
    #     Hkv=8 D=128 G=4 S=4096: rows 48 1.40, 96 1.43, 192 1.34, 384 1.33, 768 1.20
    #     short prefixes: Hkv=3 S=256 rows 96 1.18, 768 1.03; S=1024 96 1.26, 768 1.12;
    #       Hkv=8 D=128 S=512 96 1.39, 768 1.13
    #   and inside the batched server's step (4 rows verifying 5-token drafts, 60 rows, p = 1)
    #   the shared-prefix attention took 151.5 ms through flash_cpu where decode_cpu's rate
    #   gives ~106: fp32 with AVX-512 now takes decode_cpu up to 768 rows, the widest measured,
    #   where every row sees every key (``plain``); rows with bounds of their own (a prefill's
    #   causal rows) keep 48.
    #   AVX2-only Zen 1 EPYC (2026-11-24, loadavg ~1, two sweeps; bf16 with the register tiles,
    #   1 row before row1_eo, which is 1.2x faster again):
    #   fp32   1.80-1.83  2.05-2.08  1.33-1.39  0.93-0.99  0.70-0.73  0.71  0.71-0.73
    #   bf16   6.3-7.0    1.75-1.81  1.24-1.33  1.02-1.07  0.85-0.88  0.88-0.92  0.88-0.93
    # flash_cpu: at least as fast as the grouped matmul path in float32/float64 and much
    # faster in half precision, where the matmul path upcasts K/V chunks to float32.
    # CUDA: the Triton split-KV kernel where triton is installed (it ships with PyTorch's CUDA
    # builds), else the fused kernels (flash-attn / aten flash / mem-efficient).
    if q.device.type == "cpu":
        rows = (q.shape[1] // k.shape[1]) * q.shape[2]
        limit = _DECODE_MAX_ROWS.get(q.dtype, 0)
        wider = None  # (the kernel feature, the limit with it)
        if q.dtype == torch.float32:
            wider = ("avx512", _DECODE_MAX_ROWS_F32_AVX512_PLAIN if plain else _DECODE_MAX_ROWS_F32_AVX512)
        elif q.dtype == k.dtype == torch.bfloat16 and q.shape[3] % 32 == 0 and v.shape[3] == q.shape[3]:
            wider = ("avx512bf16", _DECODE_MAX_ROWS_BF16DP)
        if wider is not None and limit < rows <= wider[1]:
            from ._decode_cpu import kernel_features  # builds the kernel: only when it decides

            if wider[0] in kernel_features():
                limit = wider[1]
        if rows <= limit:
            return "decode_cpu"
        if v.shape[3] == q.shape[3]:
            return "flash_cpu"
        return "torch"
    if q.device.type == "cuda":
        return _cuda_backend(q, k, v, plain, causal_rows)
    return "torch"


# CUDA, one H200 (benchmarks/gpu_kernel.py, 2026-11-27 at 32cc966, the Triton decode shape
# (64, 4, 2); Hq/Hkv 32/8 x 128, Tq = 1, medians of 30 CUDA-event timings, ms; fused_cuda =
# aten_flash on the folded rows). Eager calls up to ~128k keys are host-bound (two Triton
# launches, ~0.14 ms of host time); a CUDA-graph replay of the Triton op took 0.047 / 0.137 ms
# at B = 1, S = 32k / 128k, SDPA's 0.042 / 0.130.
#   bf16   B  S      triton   fused_cuda   SDPA
#          1  32k    0.273    0.344        0.066
#          1  128k   0.301    0.338        0.156
#          1  512k   0.662    0.648        0.512
#          1  1M     1.093    1.170        0.973
#          8  32k    0.399    0.375        0.266
#          8  128k   1.111    1.106        0.980
#          8  512k   4.351    4.357        3.826
#          8  1M     8.700    8.801        7.582
#   (2026-11-26, the first kernel: triton 1.449 / 5.474 / 10.809 at B = 8, S = 128k / 512k / 1M,
#   hence aten_flash from 64 pairs; since then the two are within 1 % there and it stays.)
#   fp32   triton 0.28-5.1 ms at B = 1 and 2.3-31 ms at B = 8 (2026-11-27, multiply-adds), against
#          3.5-100 ms for fused_cuda (aten's efficient kernel, no key splits) and 1.5-47 ms for SDPA.
#   fp32 prefill (an 8,192-token prompt through a 1B-shaped model): the Triton kernel's exact
#          (IEEE) float32 products made time to first token 5.9x transformers', so float32 calls
#          with many rows and no per-row bounds stay on aten's efficient kernel (0.49x
#          transformers' time to first token, 2026-11-27).
_FLASH_MIN_PAIRS = 64  # (sequence, KV head) pairs from which aten_flash beat the Triton kernel
_TRITON_F32_MAX_ROWS = 16  # float32 rows per KV head up to which the Triton kernel runs plain calls


def _cuda_backend(q: Tensor, k: Tensor, v: Tensor, plain: bool, causal_rows: bool) -> str:
    B, Hq, Tq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    rows = Hq // Hkv * Tq
    aten_shape = D % 8 == 0 and Dv % 8 == 0 and max(D, Dv) <= 256 and fused_cuda_supported(q, k, v)
    if plain and not causal_rows and aten_shape and q.dtype != torch.float32 and D == Dv and B * Hkv >= _FLASH_MIN_PAIRS:
        return "fused_cuda"
    if plain and aten_shape and q.dtype == torch.float32 and rows > _TRITON_F32_MAX_ROWS:
        return "fused_cuda"
    if triton_available(q) and why_not("triton", Call.of(q, v)) is None:
        return "triton"
    return "fused_cuda" if fused_cuda_supported(q, k, v) else "torch"
