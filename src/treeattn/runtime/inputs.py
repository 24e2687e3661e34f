"""The argument checks and small host-side helpers every runtime entry point shares
(:class:`treeattn.runtime.Session`, :func:`treeattn.decoding.generate`, the batched runner):
prefill windows, token trees, right-padded masks, id checks and cross-rank checksums."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_P = (1 << 31) - 1
_W: list[Tensor] = [torch.zeros(0, dtype=torch.int64)]


def checksum(t: Tensor) -> int:
    """An integer digest of an integer tensor's shape and values, for comparing across ranks:
    a sum of ``(value + 1) * w_i mod (2^31 - 1)`` with fixed pseudo-random weights per index
    (the same on every rank), so two different tensors collide only by chance (~2^-31)."""
    t = t.detach().cpu().to(torch.int64).reshape(-1)
    n = t.numel()
    if len(_W[0]) < n:
        _W[0] = torch.randint(1, _P, (max(n, 2 * len(_W[0]), 1024),), generator=torch.Generator().manual_seed(20))
    h = int((((t + 1) % _P) * _W[0][:n] % _P).sum()) % _P
    return h * 64 + n % 64 if n else 0


def prefill_windows(positions: list[Tensor], lo: int, hi: int, chunk: int | None) -> list[tuple[int, int]]:
    """Split the global positions ``[lo, hi)`` into consecutive windows in which no rank holds
    more than ``chunk`` tokens (``positions[r]``: rank r's sorted positions in ``[lo, hi)``;
    None: one window). Causal attention needs the windows in position order: a query may
    only run once every earlier key exists. Interleaved placement gives every rank
    ``chunk`` tokens per window; contiguous placement runs the ranks' chunks one after another."""
    if not chunk:
        return [(lo, hi)]
    out = []
    while lo < hi:
        end = hi
        for x in positions:
            i = int(torch.searchsorted(x, lo))
            if i + chunk < len(x):
                end = min(end, int(x[i + chunk]))
        out.append((lo, end))
        lo = end
    return out


def right_padded(mask: Tensor, B: int, T: int, dims: str = "[B, T]") -> Tensor:
    """Lengths ``[B]`` (host int64) of the rows of a right-padding mask ``[B, T]``."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"attention_mask must be a {dims} tensor, got {type(mask).__name__}")
    m = mask.detach().cpu().to(torch.int64)
    if m.shape != (B, T):
        raise ValueError(f"attention_mask must be {dims}={(B, T)}, got {tuple(m.shape)}")
    lens = m.sum(1)
    if not torch.equal(m, (torch.arange(T)[None, :] < lens[:, None]).to(torch.int64)):
        raise ValueError(
            "attention_mask must describe right padding (1...1 0...0 per row); left padding is not supported"
        )
    return lens


def tree_of(parents: Sequence[int] | None, T: int) -> tuple[list[int], Tensor, Tensor]:
    """``(parents, depth [T], sees [T, T] bool)`` of a block; ``sees[i, j]``: j is i or an
    ancestor of i. Raises ValueError for a parent that points forward or out of range."""
    if parents is None:
        parents = list(range(-1, T - 1))
    else:
        if isinstance(parents, Tensor):
            parents = parents.tolist()
        if not isinstance(parents, Sequence) or isinstance(parents, str):
            raise ValueError(f"parents must be a sequence of {T} ints or None, got {type(parents).__name__}")
        parents = list(parents)
        if len(parents) != T or not all(isinstance(x, int) and not isinstance(x, bool) for x in parents):
            raise ValueError(f"parents must be {T} ints (one per token), got {parents!r}")
        bad = [i for i, x in enumerate(parents) if not -1 <= x < i]
        if bad:
            i = bad[0]
            raise ValueError(
                f"parents[{i}] = {parents[i]}: a token's parent must be an earlier token of the block "
                f"(0 <= parent < {i}) or -1 (the last committed token)"
            )
    depth = torch.zeros(T, dtype=torch.int64)
    sees = torch.eye(T, dtype=torch.bool)
    for i, a in enumerate(parents):
        if a >= 0:
            depth[i] = depth[a] + 1
            sees[i] |= sees[a]
    return parents, depth, sees


def check_ids(ids, what: str, V: int, values: bool = True) -> None:
    """ValueError unless ``ids`` is a ``[B, T]`` integer tensor with B, T >= 1 (and, with
    ``values``, ids in ``[0, V)``: a host sync on a GPU)."""
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.shape[1] < 1 or ids.shape[0] < 1:
        got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"{what} must be a [B, T] integer tensor with B, T >= 1, got {got}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{what} must be integer token ids, got {ids.dtype}")
    if values and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{what} must lie in [0, {V}) (the model's vocabulary)")


def check_path(path, parents: list[int]) -> list[int]:
    """``path`` as a list, or ValueError unless it runs from the root of the tree ``parents`` down."""
    if isinstance(path, Tensor):
        path = path.tolist()
    if not isinstance(path, Sequence) or isinstance(path, str):
        raise ValueError(f"path must be a list of indices into the last step, got {type(path).__name__}")
    path = list(path)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(parents) for x in path):
        raise ValueError(f"path must be indices in [0, {len(parents)}) of the last step, got {path!r}")
    for i, x in enumerate(path):
        want = path[i - 1] if i else -1
        if parents[x] != want:
            raise ValueError(
                f"path {path} is not a root-to-leaf path of the last step: token {x} hangs off {parents[x]}, not {want}"
            )
    return path
