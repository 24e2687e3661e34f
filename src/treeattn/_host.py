"""Host facts shared across layers: memory (Linux /proc, huge pages) and treeattn's cache directory."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import torch


def cache_root() -> Path:
    """treeattn's on-disk cache (compiled kernels, converted GGUF models):
    ``$TREEATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/treeattn`` (default ``~/.cache/treeattn``)."""
    env = os.environ.get("TREEATTN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "treeattn"


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int | None:
    """Bytes of memory this host can still give (``MemAvailable``), or None if unknown."""
    return _proc_kib("/proc/meminfo", "MemAvailable:")


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Peak memory of this process so far: device memory allocated by torch on CUDA, else
    the peak resident set (Linux ``VmHWM``: weights, KV cache, activations, everything)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _proc_kib("/proc/self/status", "VmHWM:")
    if peak is not None:
        return peak
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def trim_free_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim(0)``), so memory freed
    after loading (a checkpoint's copies, weights replaced by packed ones) stops counting in the
    resident set and later peaks; False where there is no such call (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def mapped_from_file():
    """A test ``(address) -> bool``: whether this process maps that address from a file (Linux
    ``/proc/self/maps``: a mapping with an inode, e.g. a memory-mapped checkpoint), as the maps
    stand now. Where they cannot be read, every address counts as mapped (callers then copy)."""
    import bisect

    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return lambda addr: True
    spans = []
    for line in lines:
        f = line.split()
        if len(f) >= 6 and f[4] != "0" and not f[5].startswith("["):
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            spans.append((lo, hi))
    spans.sort()
    starts = [lo for lo, _ in spans]

    def mapped(addr: int) -> bool:
        i = bisect.bisect_right(starts, addr) - 1
        return i >= 0 and addr < spans[i][1]

    return mapped


_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15  # Linux <asm-generic/mman-common.h>
_HUGE_MIN_BYTES = 4 << 20
_libc: list = []


def _madvise(addr: int, nbytes: int, advice: int) -> bool:
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            _libc.append(libc)
        except (OSError, AttributeError):
            _libc.append(None)
    if _libc[0] is None:
        return False
    page = mmap.PAGESIZE
    start, end = (addr + page - 1) // page * page, (addr + nbytes) // page * page
    return end > start and _libc[0].madvise(start, end - start, advice) == 0


def empty_huge(
    *shape: int, dtype: torch.dtype, device: torch.device | str | None = None, huge: bool = True
) -> torch.Tensor:
    """``torch.empty(*shape, dtype=dtype, device=device)``; for Linux CPU tensors of 4 MiB or
    more the kernel is asked (``madvise(MADV_HUGEPAGE)``) to back the memory with 2 MiB
    transparent huge pages as it is first touched (pages the allocator reuses from freed
    memory keep the size they have). Decode attention streams the whole KV cache every step,
    and with 4 KiB pages TLB misses cost about a third of one core's read bandwidth
    (docs/benchmarks/kernels.md). Without THP (``never``) or off Linux this is plain
    ``torch.empty``; the advice changes nothing but the page size. ``huge=False``, or
    ``TREEATTN_HUGE_PAGES=0`` in the environment, asks for small pages instead
    (``MADV_NOHUGEPAGE``): the first touch of fresh 2 MiB pages can cost several times that
    of 4 KiB pages on a VM whose host reclaims the guest's free memory (docs/benchmarks/prefill.md,
    the page size), a prefill-time cost that decoding from huge pages pays back only later."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    huge = huge and os.environ.get("TREEATTN_HUGE_PAGES", "1") != "0"
    if t.device.type == "cpu" and t.nbytes >= _HUGE_MIN_BYTES and sys.platform.startswith("linux"):
        _madvise(t.data_ptr(), t.nbytes, _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE)
    return t


def huge_page_bytes() -> int:
    """Bytes of this process's anonymous memory backed by transparent huge pages (Linux), else 0."""
    return _proc_kib("/proc/self/smaps_rollup", "AnonHugePages:") or 0
