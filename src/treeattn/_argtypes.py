"""argparse types shared by the command lines."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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
