"""One host sync to tell whether tensors are finite (the kernels' and the checks' shared test)."""

from __future__ import annotations

import torch
from torch import Tensor


def all_finite(*ts: Tensor) -> bool:
    """Whether every element of ``ts`` is finite, in one host sync: a NaN or inf element makes
    the sum of sums non-finite; only when it is (or finite values overflow it) are the tensors
    scanned element by element (one pass per tensor, against ~4 for ``isfinite(t).all()``)."""
    ts = [t for t in ts if t.numel()]
    if not ts or bool(torch.isfinite(sum(t.sum() for t in ts))):
        return True
    return all(bool(torch.isfinite(t).all()) for t in ts)
