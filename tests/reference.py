"""The float64 reference and the flash-attn tolerance rule, shared by all tests."""

from __future__ import annotations

import torch
from torch import Tensor


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    kv_lens: Tensor | None = None,
    causal: bool = False,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain PyTorch attention in the inputs' dtype (float64 inputs: the reference).

    ``mask`` (optional, ``[B, Tq, S]`` bool, True = visible) is AND-ed with kv_lens/causal.
    Returns ``(out, lse)``; rows with no visible key give (0, -inf)."""
    B, Hq, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    k = k.repeat_interleave(G, 1)
    v = v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    L = torch.full((B,), S) if kv_lens is None else kv_lens.cpu()
    j = torch.arange(S)
    lim = L.view(B, 1, 1, 1) + (torch.arange(Tq).view(1, 1, Tq, 1) - Tq + 1 if causal else 0)
    vis = j < lim
    if mask is not None:
        vis = vis & mask.view(B, 1, Tq, S)
    s = s.masked_fill(~vis.to(s.device), float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def reference(q, k, v, **kw) -> tuple[Tensor, Tensor]:
    """Float64 attention on the full, unsharded K/V."""
    return naive_attention(q.double(), k.double(), v.double(), **kw)


def max_err(a: Tensor, b: Tensor) -> float:
    """Max abs difference over entries where b is finite; -inf must match exactly."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return float("inf")
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def assert_within_tolerance(out, lse, q, k, v, *, abs_floor: float = 1e-6, **kw) -> None:
    """flash-attn's rule: our error vs the float64 reference is at most 2x (+ a tiny
    floor) the error plain PyTorch makes in the same dtype."""
    ref_o, ref_l = reference(q, k, v, **kw)
    pt_o, pt_l = naive_attention(q, k, v, **kw)
    e_out, pt_out = max_err(out, ref_o), max_err(pt_o, ref_o)
    assert e_out <= 2 * pt_out + abs_floor, f"out error {e_out:.3g} > 2 x plain-torch error {pt_out:.3g}"
    if lse is not None:
        e_lse, pt_lse = max_err(lse, ref_l), max_err(pt_l, ref_l)
        assert e_lse <= 2 * pt_lse + abs_floor * 10, f"lse error {e_lse:.3g} > 2 x plain-torch error {pt_lse:.3g}"
