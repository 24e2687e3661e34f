"""Host facts shared across layers: memory (Linux /proc) and treeattn's cache directory."""

from __future__ import annotations

import os
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
