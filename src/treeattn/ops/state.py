"""Attention states ``(out, lse)`` and their associative, commutative merge.

An attention state summarises attention of a query over a *set* of keys: ``out`` is the
softmax-weighted average of the values and ``lse`` the log of the softmax denominator
(natural log of ``sum_a exp(score_a)``). The empty set is the state ``(0, -inf)``.

Two states over disjoint key sets merge into the state over their union::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

The merge is associative and commutative (up to float rounding), so any reduction tree
over p partial states gives the exact result. All merge arithmetic is float32 (float64
when the inputs are float64).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_states", "merge_states_n", "normalize_lse", "empty_state"]


def _acc_dtype(*ts: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def normalize_lse(lse: Tensor) -> Tensor:
    """Return ``lse`` as float32 (or float64) with NaN and +inf replaced by -inf (empty).

    A tool for states from foreign kernels that mark a fully masked row with NaN or +inf.
    The merges do not use it: there NaN means an undefined row (a NaN or +inf score, see
    :func:`merge_states`) and propagates; only use it where NaN can only mean "no key".
    """
    lse = lse.to(_acc_dtype(lse))
    return torch.where(torch.isfinite(lse), lse, float("-inf"))


def empty_state(shape_out: tuple[int, ...], device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """The identity of the merge: ``out`` zeros of ``shape_out`` and ``lse`` -inf of
    ``shape_out[:-1]``, both float32."""
    out = torch.zeros(shape_out, dtype=torch.float32, device=device)
    lse = torch.full(shape_out[:-1], float("-inf"), dtype=torch.float32, device=device)
    return out, lse


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two attention states over disjoint key sets.

    Args:
        out_a, out_b: ``[..., D]`` attention outputs, any float dtype; broadcastable.
        lse_a, lse_b: ``[...]`` log-sum-exp of the scores (natural log), any float dtype.
            -inf and +inf mean an empty state (+inf: flash-attn's mark of a row without
            keys); the output of an empty state is ignored, NaN or not. NaN means an
            undefined state (:func:`attention_with_lse` gives it to a row with a NaN or
            +inf score) and propagates: the merged row is NaN.

    Returns:
        ``(out, lse)``: ``out [..., D]`` and ``lse [...]``, both float32 (float64 if any
        input is float64). ``(0, -inf)`` is the identity; merging two empty states gives
        ``(0, -inf)``, never NaN. Stable for any finite lse difference (e.g. ±1e4).

    Raises:
        TypeError: a non-tensor or non-floating-point argument. ValueError: shapes that do not
            broadcast as above.
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, Tensor):
            raise TypeError(f"merge_states: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():  # torch.stack would promote it silently
            raise TypeError(f"merge_states: {name} must be a floating point tensor, got {t.dtype}")
    try:
        out, lse = torch.broadcast_tensors(out_a, out_b), torch.broadcast_tensors(lse_a, lse_b)
        ok = out[0].ndim > 0 and out[0].shape[:-1] == lse[0].shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            "merge_states: out_a/out_b must broadcast to [..., D] and lse_a/lse_b to [...], got out_a "
            f"{tuple(out_a.shape)}, lse_a {tuple(lse_a.shape)}, out_b {tuple(out_b.shape)}, lse_b {tuple(lse_b.shape)}"
        )
    return merge_states_n(torch.stack(out), torch.stack(lse))


def merge_states_n(out: Tensor, lse: Tensor, dim: int = 0) -> tuple[Tensor, Tensor]:
    """Merge N attention states stacked along ``dim``.

    Args:
        out: ``[..., N, ..., D]`` stacked outputs (N at ``dim``; ``dim`` must not be the last).
        lse: ``out.shape[:-1]`` stacked log-sum-exps; +inf and -inf are empty, NaN
            propagates (as in :func:`merge_states`).
        dim: the stacking dimension (of ``lse``; negative values count from lse's end).

    Returns:
        ``(out, lse)`` with ``dim`` removed, float32 (float64 if an input is float64).
        N = 0 or all-empty inputs give ``(0, -inf)``.

    Raises:
        TypeError: out or lse not a tensor (e.g. a list of states: stack them first), or not
            floating point.
        ValueError: ``lse.shape != out.shape[:-1]``.
    """
    if not isinstance(out, Tensor) or not isinstance(lse, Tensor):
        raise TypeError(
            f"merge_states_n: out and lse must be stacked torch.Tensors (torch.stack a list first), got "
            f"{type(out).__name__} and {type(lse).__name__}"
        )
    if not (out.is_floating_point() and lse.is_floating_point()):
        raise TypeError(f"merge_states_n: out and lse must be floating point tensors, got {out.dtype} and {lse.dtype}")
    if out.shape[:-1] != lse.shape:
        raise ValueError(f"merge_states_n: out.shape[:-1] {tuple(out.shape[:-1])} != lse.shape {tuple(lse.shape)}")
    dim = dim % lse.ndim
    acc = _acc_dtype(out, lse)
    lse = lse.to(acc)
    undefined = torch.isnan(lse).any(dim) if lse.shape[dim] else None
    lse = torch.where(torch.isfinite(lse), lse, float("-inf"))
    m = lse.amax(dim, keepdim=True) if lse.shape[dim] else lse.sum(dim, keepdim=True) + float("-inf")
    m = torch.where(torch.isinf(m), 0.0, m)  # all-empty rows: any finite shift works
    w = torch.exp(lse - m)  # 0 for empty states, <= 1 otherwise
    s = w.sum(dim)
    w_ = w.unsqueeze(-1)
    num = torch.where(w_ > 0, w_ * out.to(acc), 0.0).sum(dim)  # empty states may carry NaN out
    out_m = num / torch.where(s > 0, s, 1.0).unsqueeze(-1)
    lse_m = m.squeeze(dim) + torch.log(s)
    if undefined is not None:
        out_m = out_m.masked_fill(undefined.unsqueeze(-1), float("nan"))
        lse_m = lse_m.masked_fill(undefined, float("nan"))
    return out_m, lse_m


def merge_into(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """In place: ``(out_a, lse_a)`` becomes the merge of itself with ``(out_b, lse_b)``, the
    semantics of :func:`merge_states`. ``out_a``/``lse_a`` are the caller's float32 (float64)
    accumulators of equal shapes; ``out_b``/``lse_b`` have the same shapes, any float dtype.
    Two passes over ``out`` and no stacking: the hot path of a prefill's block merges."""
    inf = float("inf")
    la = lse_a.masked_fill(lse_a == inf, -inf)
    lb = lse_b.to(lse_a.dtype).masked_fill(lse_b == inf, -inf)
    m = torch.maximum(la, lb)  # NaN propagates
    m = m.masked_fill(torch.isinf(m), 0.0)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    s = wa + wb
    lse_a.copy_(m + torch.log(s))
    s = s.masked_fill(s == 0, 1.0)
    wa, wb = (wa / s).unsqueeze(-1), (wb / s).unsqueeze(-1)
    host = out_a.device.type == "cpu"  # elsewhere no device read: the fills run unconditionally
    if not host or bool((wb == 0).any()):  # an empty (or negligible) state's out may be NaN: it must not count
        out_b = out_b.masked_fill(wb == 0, 0.0)
    if not host or bool((wa == 0).any()):
        out_a.masked_fill_(wa == 0, 0.0)
    out_a.mul_(wa).addcmul_(out_b, wb)

