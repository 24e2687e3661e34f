"""argparse types shared by the command lines."""

from __future__ import annotations

import argparse
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
