"""Streaming decode attention on CPU: a small C kernel (``_decode_cpu.c``) built with the
system C compiler on first use and loaded with ctypes, with a pure-PyTorch fallback. The same
shared object holds the prefill kernel (``_prefill_cpu.c``, used by :mod:`._prefill_cpu`), the
merge of packed states (``_merge_cpu.c``, used by the all-gather reduction) and the linear layers
of a decode step (``_linear_cpu.c``, used by :mod:`.linear_cpu`).

Why a plain C file and not ``torch.utils.cpp_extension``: decode attention is a streaming
problem (every K/V byte is read once, ~2 flops per byte), so what matters is one pass over
each KV head at memory speed with the bf16/fp16 -> fp32 conversion fused into that pass.
A dependency-free C99 file compiles in well under a second with gcc (a C++ extension
against the torch headers takes a minute), needs no build step at install time, and runs
in any process with a compiler; without one (or with ``TREEATTN_NO_CKERNEL=1``) the same
contract is served by :func:`decode_torch`.

The shared object lands in ``$TREEATTN_CACHE_DIR`` (default ``~/.cache/treeattn``, see ``_host.cache_root``), named
by a hash of the source, the compiler, its flags and the CPU's feature flags (``-march=native``),
written to a temporary file and renamed into place so concurrent ranks never see half a file.
Threads are pthreads inside the kernel (no second OpenMP runtime next to torch's); the loops
are vectorised by gcc (``-fopenmp-simd``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from .._host import cache_root
from ._blocks import block_state
from .state import empty_state, merge_states

__all__ = ["decode_cpu", "decode_torch", "kernel_available", "kernel_features", "kernel_info"]

_SRCS = tuple(Path(__file__).with_name(f) for f in ("_decode_cpu.c", "_prefill_cpu.c", "_merge_cpu.c",
                                                    "_merge_shm.c", "_linear_cpu.c"))  # one .so
# the headers _decode_cpu.c includes (one translation unit): not compiled on their own, but
# hashed with the sources, so that a header's edit builds a new .so
_HDRS = tuple(sorted(Path(__file__).parent.glob("_decode_cpu_*.h")))
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_QDTYPES = {torch.float32: 0, torch.bfloat16: 1}
# -fopenmp: the prefill kernel's threads come from torch's OpenMP pool (libgomp.so.1, already
# loaded by torch, is the copy the loader binds); the decode kernel keeps its own pthreads
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-march=native", "-fopenmp-simd"],
    ["-O3", "-fopenmp-simd"],
    ["-O2"],
)
# Keys per online-softmax block: K+V of a block (fp32, D=128: 64 KiB) stays in L1/L2 while
# the block's rows are processed. The keys are cut in splits of _SPLIT, whatever the call's
# shape and threads (the splits and the sequences are the threads' tasks, merged in order): a
# row's bits depend on its own key range alone, not on what shares the call or how many threads.
# Each split costs a task's start and a partial state: 2,048 made a 512k-key bf16 call on one
# thread 1.09x slower (two runs), 4,096-16,384 were within this VM's noise of one split per head.
_BLOCK = 64
_SPLIT = 8192
# A sequence-split S must give each thread at least this many K/V bytes before threads pay off.
_MIN_BYTES_PER_THREAD = 1 << 20

_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> Path:
    return cache_root()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    for c in ([cc] if cc else []) + ["gcc", "cc"]:
        if c and shutil.which(c):
            return c
    return None


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("TREEATTN_NO_CKERNEL", "") not in ("", "0"):
        return None, "disabled by TREEATTN_NO_CKERNEL"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (gcc/cc/$CC) found"
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cc} --version failed: {e}"
    src = b"\0".join(p.read_bytes() for p in _SRCS + _HDRS)
    cache = _cache_dir()
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([src, ver.encode(), " ".join(flags).encode(), _cpu_flags().encode()]))
        so = cache / f"decode_cpu-{key.hexdigest()[:20]}.so"
        if not so.exists():
            try:
                cache.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=cache, prefix=".decode_cpu-", suffix=".so")
                os.close(fd)
                cmd = [cc, "-std=c99", *flags, "-fPIC", "-shared", "-o", tmp, *map(str, _SRCS), "-lm", "-lpthread"]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    os.unlink(tmp)
                    errors.append(f"{' '.join(flags)}: {r.stderr.strip()[-500:]}")
                    continue
                os.replace(tmp, so)  # atomic: concurrent builders each rename a complete file
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{' '.join(flags)}: {e}")
                continue
        try:
            lib = ctypes.CDLL(str(so))
        except OSError as e:
            errors.append(f"load {so}: {e}")
            continue
        f = lib.treeattn_decode
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = (
            [vp, vp, ctypes.c_float, vp, vp, ctypes.c_int]
            + [i64] * 12
            + [vp, vp, ctypes.c_float, ctypes.c_int, i64, i64, vp, vp]
        )
        f.restype = ctypes.c_int
        lib.treeattn_decode_rows.argtypes = (
            [vp, ctypes.c_int, ctypes.c_float, vp, vp, ctypes.c_int]
            + [i64] * 13
            + [vp, vp, ctypes.c_float, ctypes.c_int, i64, i64, vp, vp]
        )
        lib.treeattn_decode_rows.restype = ctypes.c_int
        lib.treeattn_prefill.argtypes = [vp, vp, vp, ctypes.c_float] + [i64] * 13 + [vp, vp, vp, ctypes.c_int, vp, vp]
        lib.treeattn_prefill.restype = ctypes.c_int
        lib.treeattn_features.restype = ctypes.c_int
        lib.treeattn_merge.argtypes = [vp, i64, i64, i64, vp, vp]
        lib.treeattn_merge.restype = ctypes.c_int
        lib.treeattn_shm_gather_merge.argtypes = [ctypes.POINTER(vp)] + [i64] * 4 + [vp, vp] + [i64] * 4 + [vp] * 3
        lib.treeattn_shm_gather_merge.restype = ctypes.c_int
        lib.treeattn_prefill_available.restype = ctypes.c_int
        lib.treeattn_linear_pack.argtypes = [vp, i64, i64, vp]
        lib.treeattn_linear_pack.restype = None
        lib.treeattn_linear.argtypes = [vp, i64, i64, i64, vp, vp, vp, i64, i64, ctypes.c_int]
        lib.treeattn_linear.restype = ctypes.c_int
        lib.treeattn_linear_available.restype = ctypes.c_int
        feats = _features(lib)
        return lib, f"{so} ({cc} {' '.join(flags)}; {', '.join(feats) or 'portable C'})"
    return None, "build failed: " + " | ".join(errors)


def _features(lib: ctypes.CDLL) -> list[str]:
    bits = lib.treeattn_features()
    names = [name for bit, name in ((1, "avx2"), (4, "avx512"), (2, "avx512bf16"), (8, "bf16tiles")) if bits & bit]
    names += ["prefill512"] if lib.treeattn_prefill_available() else []
    return names + (["linear512"] if lib.treeattn_linear_available() else [])


def kernel_features() -> frozenset[str]:
    """Fast paths of the loaded kernel: ``"avx2"`` (float32/bfloat16, AVX2+FMA), ``"avx512"``
    (groups of 4 query rows per KV head with AVX-512: float32, and bfloat16 when the queries are
    bf16 and the CPU has AVX512-BF16) and
    ``"avx512bf16"`` (bfloat16 queries and K/V with AVX512-BF16 dot products for the scores),
    ``"bf16tiles"`` (bfloat16 K/V on AVX2 CPUs without AVX-512: rows that see the same keys
    share register tiles over groups of keys), ``"prefill512"`` (the float32 AVX-512 prefill
    kernel of ``_prefill_cpu.c``, see :mod:`treeattn.ops._prefill_cpu`), ``"linear512"`` (the
    float32 AVX-512 linear layers of ``_linear_cpu.c``, see :mod:`treeattn.ops.linear_cpu`); empty when the PyTorch
    fallback is in use."""
    _lib()
    return _state["features"]


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, info = _build()
                _state["features"] = frozenset(_features(lib)) if lib is not None else frozenset()
                _state["lib"], _state["info"] = lib, info
    return _state["lib"]


def merge_packed_cpu(buf: Tensor) -> tuple[Tensor, Tensor] | None:
    """The C merge of ``buf [p, ..., Dv + 1]`` (contiguous float32 on the CPU: each row's out,
    then its lse) into ``(out [..., Dv], lse [...])``, as :func:`~treeattn.ops.state.merge_states_n`
    does; None when the C kernel is not loaded."""
    lib = _lib()
    if lib is None:
        return None
    p, Dv = buf.shape[0], buf.shape[-1] - 1
    out = torch.empty(buf.shape[1:-1] + (Dv,), dtype=torch.float32, device="cpu")
    lse = torch.empty(buf.shape[1:-1], dtype=torch.float32, device="cpu")
    lib.treeattn_merge(buf.data_ptr(), p, lse.numel(), Dv, out.data_ptr(), lse.data_ptr())
    return out, lse


def shm_gather_merge():
    """The compiled all-gather round and merge of packed states through shared memory
    (``_merge_shm.c``, used by :mod:`treeattn.comm.shm_small`), or None without the kernel."""
    lib = _lib()
    return None if lib is None else lib.treeattn_shm_gather_merge


def kernel_available() -> bool:
    """True when the compiled C kernel is usable (builds it on first call)."""
    return _lib() is not None


def kernel_info() -> str:
    """Path and flags of the loaded kernel, or why the PyTorch fallback is used."""
    _lib()
    return _state["info"]


def _rows(x: Tensor | None, B: int, R: int) -> Tensor | None:
    if x is None:
        return None
    if x.dtype == torch.int64 and x.shape == (B, R) and x.is_contiguous():
        return x
    return x.to(dtype=torch.int64).reshape(-1, R).expand(B, R).contiguous()


def decode_cpu(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    softcap: float | None = None,
    threads: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of grouped queries over one KV head each, for decode on CPU.

    Args:
        qg: ``[B, Hkv, R, D]``: the R rows that read KV head h (GQA: row ``g*Tq + i`` is
            query head ``h*G + g``, query ``i``), any float dtype.
        k: ``[B, Hkv, S, D]``, v: ``[B, Hkv, S, Dv]``, float32/bfloat16/float16, last dim
            contiguous (other strides are followed, not copied).
        scale: multiplies the scores q.k.
        lo, hi: optional int ``[B, R]``: row r of batch b sees keys ``lo <= j < hi``
            (default 0 and S; values are clipped to [0, S]). Keys no row sees are not read.
        softcap: optional c > 0: scores s become ``c * tanh(s / c)`` before the softmax.
        threads: worker threads (default ``torch.get_num_threads()``). Each sequence's keys
            are cut in splits of 8,192, the (sequence, head, split) tasks spread over the
            threads and each row's splits merged in order: with the compiled kernel a row's
            result does not depend on the thread count, the other sequences or S beyond its
            own keys (with AVX-512 and float32 K/V, D % 16 == 0, or bf16 K/V and queries with
            AVX512-BF16, D % 32 == 0, not on the other rows' bounds or number either).

    Returns:
        ``(out float32 [B, Hkv, R, Dv], lse float32 [B, Hkv, R])``, lse the natural log of
        the softmax denominator of the (scaled, capped) scores; a row with no visible key
        gives out 0 and lse -inf. Float64 inputs or a missing compiler use
        :func:`decode_torch` (float64 inputs then give float64 results).
    """
    B, H, R, D = qg.shape
    S, Dv = k.shape[2], v.shape[3]
    lib = _lib() if k.dtype in _DTYPES and k.device.type == "cpu" and v.dtype == k.dtype else None
    if lib is None:
        return decode_torch(qg, k, v, scale, lo, hi, softcap)
    if k.stride(-1) != 1 or min(k.stride()) < 0:
        k = k.contiguous()
    if v.stride(-1) != 1 or min(v.stride()) < 0:
        v = v.contiguous()
    lo_, hi_ = _rows(lo, B, R), _rows(hi, B, R)
    R0 = R
    feats = _state["features"]
    if R % 4 and D == Dv and "avx512" in feats:
        # AVX-512 runs rows in groups of 4 sharing each K/V load. Where those groups run
        # (float32 K/V with D % 16 == 0; bf16 K/V and queries with AVX512-BF16 and D % 32 == 0)
        # every other row's scores take the groups' arithmetic too (tail rows, calls of 1-3
        # rows), so a row's bits do not depend on how many rows share the call and the pad is
        # a matter of speed: bf16 runs 3 tail rows faster as a group with a 4th row of zeros
        # (R = 3 over 3.9k keys: 0.5-0.75x the time), float32 faster by themselves
        # (docs/benchmarks/kernels.md). Elsewhere (bf16 K/V with float32 queries, other head
        # dims, no AVX512-BF16) a tail row runs with other rounding, so tails over 4 rows and
        # R = 3 run padded: a row's bits are the same in every call of 3 rows or more. The pad
        # rows take the last row's bounds (rows with equal bounds share the groups).
        if k.dtype == torch.float32:
            groups = D % 16 == 0
        else:
            groups = k.dtype == torch.bfloat16 and qg.dtype == torch.bfloat16 and D % 32 == 0 and "avx512bf16" in feats
        if (R % 4 == 3 and k.dtype == torch.bfloat16) if groups else (R > 4 or R == 3):
            R += 4 - R % 4
    # the kernel scales (and pads) the queries itself: float32 and bf16 go in as they are (bf16
    # with bf16 K/V also unscaled: with AVX512-BF16 the dot products take bf16 pairs directly)
    if qg.dtype not in _QDTYPES:
        qg = qg.to(torch.float32)
    qg = qg.contiguous()
    out = torch.empty(B, H, R0, Dv, dtype=torch.float32)
    lse = torch.empty(B, H, R0, dtype=torch.float32)
    nt = torch.get_num_threads() if threads is None else int(threads)
    kv_bytes = (D + Dv) * k.element_size() * B * H * S
    nt = max(1, min(nt, kv_bytes // max(1, _MIN_BYTES_PER_THREAD)))
    cap = float(softcap) if softcap else 0.0
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rc = lib.treeattn_decode_rows(
        qg.data_ptr(), _QDTYPES[qg.dtype], float(scale), ptr(k), ptr(v), _DTYPES[k.dtype], B, H, R0, R, S, D, Dv,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ptr(lo_), ptr(hi_), cap, nt, _BLOCK, _SPLIT, out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    if rc == 1:
        raise MemoryError("decode_cpu: the C kernel could not allocate its scratch buffers")
    if rc != 0:
        raise ValueError(f"decode_cpu: bad arguments (rc={rc}) for shapes q {tuple(qg.shape)}, k {tuple(k.shape)}")
    return out, lse


def decode_torch(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    softcap: float | None = None,
    chunk: int = 4096,
) -> tuple[Tensor, Tensor]:
    """Pure-PyTorch :func:`decode_cpu` (any device): chunked online softmax over the keys
    ``[min lo, max hi)``; values no row of a sequence sees are zeroed before use."""
    B, H, R, D = qg.shape
    S, Dv = k.shape[2], v.shape[3]
    acc = torch.float64 if qg.dtype == torch.float64 else torch.float32
    dev = qg.device
    lo_ = _rows(lo, B, R)
    hi_ = _rows(hi, B, R)
    lo_ = torch.zeros(B, R, dtype=torch.int64, device=dev) if lo_ is None else lo_.to(dev).clamp(0, S)
    hi_ = torch.full((B, R), S, dtype=torch.int64, device=dev) if hi_ is None else hi_.to(dev).clamp(0, S)
    out, lse = empty_state((B, H, R, Dv), dev)
    out, lse = out.to(acc), lse.to(acc)
    if B * H * R == 0 or S == 0:
        return out, lse
    a, e = int(lo_.min()), int(hi_.max())
    qs = qg.to(acc) * scale
    lo4, hi4 = lo_.view(B, 1, R, 1), hi_.view(B, 1, R, 1)
    for s0 in range(a, e, chunk):
        s1 = min(e, s0 + chunk)
        j = torch.arange(s0, s1, device=dev)
        vis = (j >= lo4) & (j < hi4)  # [B, 1, R, C]
        s = torch.matmul(qs, k[:, :, s0:s1].to(acc).transpose(-1, -2))
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~vis, float("-inf"))
        vc = v[:, :, s0:s1].to(acc).masked_fill(~vis.any(2).unsqueeze(-1), 0.0)
        out, lse = merge_states(out, lse, *block_state(s, vc))
    return out, lse
