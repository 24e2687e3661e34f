"""Split-KV flash attention in Triton that returns the log-sum-exp (backend ``"triton"``).

One program takes a block of query rows of one (sequence, KV head) — the G query heads of
a KV head folded into rows, so K/V are read once for all of them — and one split of the
keys; a second kernel merges the splits' partial states with the semantics of
:func:`~treeattn.ops.state.merge_states_n` (one launch instead of a dozen small ops).
Decode (few rows, long S) runs many splits to fill the GPU; prefill (many rows) one split
and many row blocks. Every row has its own visible key range ``[lo, hi)`` (kv_lens, causal,
windows), so the same kernel serves decode, speculative steps and causal prefill.

Keys outside the union of the rows' ranges are never loaded (masked loads), so garbage
beyond ``kv_lens`` cannot leak in. A row with a NaN or +inf score is NaN (out and lse), an
empty row ``(0, -inf)``; with per-row bounds, a non-finite value reaches only the rows that
weigh it (checked per block, a slow branch taken only when the block holds one).

The two kernels (the splits, then their merge) are the custom op
``treeattn::split_kv_attention``, with a fake implementation, so they compose with FakeTensor
and ``torch.compile``. The kernels' source is :mod:`treeattn.ops._triton_kernels`; this module plans
and launches them. On CPU tensors it runs only under
``TRITON_INTERPRET=1`` (how CI tests it). ``triton`` is imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

from ._triton_kernels import kernels as _kernel
from ._triton_launch import Launcher

__all__ = ["triton_available", "triton_attention", "num_splits"]

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PROGRAMS_PER_SM = 4  # decode's split count aims at this many programs per SM


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available(q: Tensor) -> bool:
    """Whether the Triton kernel can run on ``q``'s device and dtype: CUDA (or CPU under
    ``TRITON_INTERPRET=1``), float16/bfloat16/float32, triton installed."""
    if q.dtype not in _DTYPES or not _have_triton():
        return False
    return q.device.type == "cuda" or (q.device.type == "cpu" and interpreting())


@functools.cache
def _sm_count(device: torch.device) -> int:
    if not torch.cuda.is_available():
        return 132  # fake CUDA tensors on a CPU-only build (an H100's count)
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fma(R: int, dtype: torch.dtype) -> bool:
    """Whether the products run as multiply-adds over the real rows instead of tl.dot. At most
    8 rows: from 16 Triton turns a broadcast multiply-reduce back into tl.dot, which takes
    float32 as tf32 (seen on the H200: float32 errors past the tolerance at 12 and 24 rows)."""
    return R <= min(FMA_ROWS.get(dtype, 0), 8)


def _blocks(R: int, D: int, Dv: int, fma: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, BLOCK_DV): tl.dot needs every side >= 16 (BLOCK_N: the configs below);
    the multiply-adds take the rows' power of two."""
    bm = max(2, min(64, triton_next_pow2(R))) if fma else max(16, min(64, triton_next_pow2(R)))
    return bm, max(16, triton_next_pow2(D)), max(16, triton_next_pow2(Dv))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_splits(B: int, H: int, R: int, S: int, device: torch.device, fma: bool = False) -> int:
    """Key splits per (sequence, KV head, row block): ``PROGRAMS_PER_SM`` programs per SM, each
    split at least 256 keys. A pure function of host-known shapes (no device read). Under the
    interpreter (CPU tensors) up to 3, so that tests run the merge."""
    if device.type == "cpu":
        return max(1, min(3, -(-S // 256)))
    bm = _blocks(R, 16, 16, fma)[0]
    programs = B * H * -(-R // bm)
    want = -(-PROGRAMS_PER_SM * _sm_count(device) // programs)
    return max(1, min(want, -(-S // 256)))


# kernel shapes (BLOCK_N, num_warps, num_stages) from benchmarks/gpu_kernel.py on one H200
# (2026-11-27, docs/benchmarks/gpu.md; 32/8 heads x 128, Tq = 1). Decode, bf16, the whole
# table: (64, 4, 2) 96 / 80 % of the read floor at B = 1, S = 1M / 512k and 95-97 % at B = 8,
# S >= 128k; (64, 4, 3) 83 / 74 % and 93-102 %. (A sweep that read K twice, as V, ranked 3 stages
# first: it hid V's loads.) Prefill (4096 rows x 8192 keys): (64, 4, 2) 1.72 ms, (64, 4, 3)
# 2.15, (32, 4, 4) 1.82; (128, *, 3) exceeds the shared memory.
DECODE_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=2)  # few rows per (sequence, KV head)
PREFILL_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=2)  # row blocks of 64
# the multiply-add variant, float32 decode (4 rows), ms at B = 1 S = 32k / B = 1 S = 1M / B = 8
# S = 32k (K read as V): tl.dot 0.37 / 6.67 / 2.43; (16, 2, 2) 0.31 / 4.93 / 2.09; (16, 1, 2)
# 0.23 / 4.12 / 1.16; (8, 2, 2) 0.37 / 5.04 / 1.61; (32, 2, 2) 0.42 / 6.78 / 2.48. bf16 loses
# (3.8-5.6 ms against tl.dot's 0.92 at 1M) and keeps tl.dot
FMA_CONFIG = dict(BLOCK_N=16, num_warps=1, num_stages=2)
# rows per (sequence, KV head) up to which a dtype takes the multiply-add variant (0: never; 8 at
# most). Timed at 4 rows only (its [rows, BLOCK_N, D] products live in registers: 8 rows double
# them), so 4; the tests run it up to 8 (on the H200: float32 within tolerance at 8 rows)
FMA_ROWS: dict[torch.dtype, int] = {torch.float32: 4}
_SMEM = 160 * 1024  # bytes of K/V pipeline buffers a config may ask for (the H100/H200 have 227 KiB)


def _merge_block(splits: int) -> int:
    """The merge's split block: few sizes, so that few variants compile (each new one costs
    seconds, inside the first call with that split count)."""
    return 16 if splits <= 16 else 128 if splits <= 128 else triton_next_pow2(splits)


def _config(cfg: dict, D: int, Dv: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of ``cfg``, stages then BLOCK_N cut until the K/V
    buffers fit (float32 or head dims of 256 would not)."""
    bn, st = cfg["BLOCK_N"], cfg["num_stages"]
    while st * bn * (D + Dv) * itemsize > _SMEM and (st > 1 or bn > 16):
        if st > 2 or bn == 16:
            st -= 1
        else:
            bn //= 2
    return bn, cfg["num_warps"], st


class _Plan:
    """What a call's signature fixes (shapes but S, strides, dtypes, flags, the settings above):
    the kernels' shapes, constexprs and fixed arguments, and their launchers. Per call there
    remain S (the split count, the split length), the tensors and their alignment."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, lo, hi, scale, softcap, row_bounds, keep_fp32) -> None:
        B, H, R, D = q.shape
        Dv, dev = v.shape[3], q.device
        fma = _fma(R, q.dtype)
        self.want = num_splits(B, H, R, 1 << 62, dev, fma)  # splits = min(want, ceil(S / 256))
        # the decode config when the GPU wants splits or rows are few (whatever S; the configs
        # share BLOCK_N today, so a short S that gets one split differs in nothing but the name)
        decode = self.want > 1 or R <= 16
        cfg = FMA_CONFIG if fma else DECODE_CONFIG if decode else PREFILL_CONFIG
        bm, bd, bdv = _blocks(R, D, Dv, fma)
        self.bn, warps, stages = _config(cfg, bd, bdv, k.element_size())
        self.B, self.H, self.R, self.D, self.Dv, self.dev = B, H, R, D, Dv, dev
        interp = dev.type == "cpu"  # the interpreter's tl.dot misreads bfloat16 operands
        # the kernels write q's dtype (rounding to nearest even); the interpreter truncates to
        # bfloat16, so there torch casts
        self.out_dtype = torch.float32 if keep_fp32 or interp else q.dtype
        self.cast = None if keep_fp32 or not interp else q.dtype
        self.empty = B * H * R == 0
        self.grid01 = (B * H, -(-R // bm))
        cap = float(softcap)
        bounds = tuple(t.stride() if t is not None else (0, 0) for t in (lo, hi))
        self.fixed = (*q.stride(), *k.stride(), *v.stride(), *bounds[0], *bounds[1])
        self.scalars = (scale * _LOG2E, scale / cap if cap else 0.0, cap * _LOG2E)
        # direct launches on CUDA (ROCm's Triton also specializes pointers on their buffer's size)
        self.cuda = dev.type == "cuda" and not torch.version.hip
        fwd, merge = _kernel()
        self.fwd = Launcher(fwd, 41, dict(
            HAS_LO=lo is not None, HAS_HI=hi is not None, SOFTCAP=cap > 0, ROW_BOUNDS=row_bounds,
            IEEE=q.dtype == torch.float32 or interp, F32DOT=interp, FMA=fma, BLOCK_M=bm, BLOCK_N=self.bn,
            BLOCK_D=bd, BLOCK_DV=bdv, num_warps=warps, num_stages=stages))  # fmt: skip
        self.merges = {}  # BLOCK_S -> Launcher
        self.merge_fn, self.bdv = merge, bdv

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, lo: Tensor | None, hi: Tensor | None) -> tuple[Tensor, Tensor]:
        B, H, R, Dv, dev = self.B, self.H, self.R, self.Dv, self.dev
        out = torch.empty((B, H, R, Dv), dtype=self.out_dtype, device=dev)
        lse = torch.empty((B, H, R), dtype=torch.float32, device=dev)
        if self.empty:
            return (out, lse) if self.cast is None else (out.to(self.cast), lse)
        S = k.shape[2]
        splits = max(1, min(self.want, -(-S // 256)))
        per = -(-max(S, 1) // splits)
        split_len = -(-per // self.bn) * self.bn  # a multiple of BLOCK_N
        if splits > 1:
            po = torch.empty((B, H, splits, R, Dv), dtype=torch.float32, device=dev)
            pl = torch.empty((B, H, splits, R), dtype=torch.float32, device=dev)
        else:  # one split writes the result (its split stride is never used)
            po, pl = out, lse
        so = (H * splits * R * Dv, splits * R * Dv, R * Dv, Dv, 1)
        sl = (H * splits * R, splits * R, R, 1)
        lo_t = q if lo is None else lo
        hi_t = q if hi is None else hi
        key = launch_key(splits, S, split_len, so[0], q, k, v, lo_t, hi_t) if self.cuda else None
        self.fwd(
            (*self.grid01, splits), key,
            (q, k, v, lo_t, hi_t, po, pl, *self.fixed, *so, *sl, H, R, S, self.D, Dv, split_len, *self.scalars),
        )  # fmt: skip
        if splits > 1:
            bs = _merge_block(splits)
            merge = self.merges.get(bs)
            if merge is None:
                merge = self.merges[bs] = Launcher(self.merge_fn, 24, dict(BLOCK_S=bs, BLOCK_DV=self.bdv))
            to, tl_ = (H * R * Dv, R * Dv, Dv, 1), (H * R, R, 1)
            merge((B * H * R, 1, 1), key and (splits, so[0] < 1 << 31), (po, pl, out, lse, *so, *sl, *to, *tl_, H, R, Dv, splits))
        return (out, lse) if self.cast is None else (out.to(self.cast), lse)


def launch_key(splits: int, S: int, split_len: int, stride0: int, *ptrs: Tensor) -> tuple:
    """What Triton specializes the split kernel on that its plan does not fix: the split count
    (the partial buffers' dtype and strides follow from it), S and the split length being 1 or
    multiples of 16, the partials' batch stride fitting 32 bits, each pointer's 16-byte alignment."""
    return (splits, S == 1, S % 16 == 0, split_len % 16 == 0, stride0 < 1 << 31,
            *(t.data_ptr() % 16 == 0 for t in ptrs))  # fmt: skip


_PLANS: dict = {}


def _split_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lo: Tensor | None,
    hi: Tensor | None,
    scale: float,
    softcap: float,
    row_bounds: bool,
    keep_fp32: bool = True,
) -> tuple[Tensor, Tensor]:
    """Attention states of ``q [B, H, R, D]`` over ``k/v [B, H, S, D|Dv]`` (last dims
    contiguous), ``lo/hi`` int ``[B, R]`` or None, ``softcap`` 0 for none: ``out [B, H, R, Dv]``
    (float32, or q's dtype written by the kernels unless ``keep_fp32``) and float32
    ``lse [B, H, R]``. The key splits (:func:`num_splits`) are merged by a second kernel with
    :func:`~treeattn.ops.state.merge_states_n`'s semantics. A plan per call signature
    (:class:`_Plan`) keeps the host's work per call small."""
    key = (q.shape, q.stride(), q.dtype, q.device, k.shape[3], k.stride(), k.dtype, v.shape[3], v.stride(), v.dtype,
           None if lo is None else (lo.dtype, lo.stride()), None if hi is None else (hi.dtype, hi.stride()),
           scale, softcap, row_bounds, keep_fp32, PROGRAMS_PER_SM, FMA_ROWS.get(q.dtype),
           *DECODE_CONFIG.values(), *PREFILL_CONFIG.values(), *FMA_CONFIG.values())  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(q, k, v, lo, hi, scale, softcap, row_bounds, keep_fp32)
    return plan(q, k, v, lo, hi)


split_kv_attention = torch.library.custom_op("treeattn::split_kv_attention", _split_kv, mutates_args=())


@split_kv_attention.register_fake
def _(q, k, v, lo, hi, scale, softcap, row_bounds, keep_fp32=True):
    B, H, R, _ = q.shape
    out = q.new_empty(B, H, R, v.shape[3], dtype=torch.float32 if keep_fp32 else q.dtype)
    return out, q.new_empty(B, H, R, dtype=torch.float32)


def triton_attention(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    lo: Tensor | None,
    hi: Tensor | None,
    softcap: float | None,
    row_bounds: bool,
    keep_fp32: bool = True,
) -> tuple[Tensor, Tensor]:
    """Grouped-row attention: ``qg [B, H, R, D]`` (row ``g*Tq + i``), ``k/v [B, H, S, D|Dv]``,
    ``lo/hi`` int ``[B, R]`` (views with zero strides are fine) or None. ``row_bounds``: rows
    of one sequence may have different bounds. Returns ``(out [B, H, R, Dv], lse [B, H, R])``,
    out float32 (``keep_fp32``) or in qg's dtype, lse float32. No device-to-host read."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    # plain tensors outside torch.compile skip the custom op's dispatch (host time per call);
    # FakeTensor, functional tensors and compiled graphs see the op and its fake
    plain = type(qg) is Tensor and not torch.compiler.is_compiling()
    if plain and torch.is_grad_enabled():  # autograd meets the op (which has no backward) and says so
        plain = not (qg.requires_grad or k.requires_grad or v.requires_grad)
    op = _split_kv if plain else split_kv_attention
    return op(qg, k, v, lo, hi, float(scale), float(softcap or 0.0), bool(row_bounds), bool(keep_fp32))
