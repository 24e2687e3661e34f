"""argparse types shared by the command lines."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NamedTuple


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low`` (and <= ``high``; argparse exits 2 with a
    one-line message)."""

    def integer(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {v}")
        return v

    return integer


def positive_float(s: str) -> float:
    """An argparse ``type``: a finite float > 0 (seconds)."""
    v = _number(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


def non_negative_float(s: str) -> float:
    """An argparse ``type``: a finite float >= 0 (temperatures)."""
    v = _number(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def _number(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
    return v


def fraction(s: str) -> float:
    """An argparse ``type``: a float in (0, 1] (top-p)."""
    v = _number(s)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


_NOT_A_SIZE = "expected a size such as 8GiB or 512MiB, or a fraction in (0, 1), got {!r}"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}  # fmt: skip


class MemorySize(NamedTuple):
    kind: str  # "bytes" or "fraction"
    value: float
    text: str  # as given


def memory_size(text: str) -> MemorySize:
    """An argparse ``type`` (``--kv-cache-memory``): ``("bytes", n)`` for a size (``8GiB``,
    ``512MiB``, ``2G``: K/M/G/T and KiB... binary, KB/MB/GB/TB decimal; or a whole number of
    bytes), ``("fraction", f)`` for a number in (0, 1); ``ArgumentTypeError`` otherwise."""
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    try:
        x = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(_NOT_A_SIZE.format(text)) from None
    if unit not in _UNITS or not (x > 0 and x == x and x != float("inf")):
        raise argparse.ArgumentTypeError(_NOT_A_SIZE.format(text))
    if not unit and x < 1:
        return MemorySize("fraction", x, text)
    n = x * _UNITS[unit]
    if not unit and n != int(n):
        raise argparse.ArgumentTypeError(f"a size in bytes is a whole number, got {text!r}")
    return MemorySize("bytes", float(int(n)), text)

