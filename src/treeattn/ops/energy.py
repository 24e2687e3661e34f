"""Attention as the gradient of an energy function (seed paper, Observation 1, §5, App. F).

For one query ``q`` with keys/values ``k_a, v_a`` and an auxiliary *source* ``ζ``::

    F(ζ) = log Σ_a exp(s · q·k_a + ζ·v_a)          (eq. 6, s the softmax scale)
    ∂F/∂ζ |_{ζ=0} = Σ_a softmax_a(s · q·k) v_a      (eq. 5: attention)

With one source per query position, ``F_tot = Σ_i F_i`` and ``∂F_tot/∂ζ_i`` is row ``i`` of
causal self-attention (eq. 25–26). Because ``logsumexp`` and ``max`` are associative, F can
be reduced over key chunks by any tree: Algorithms 1 and 2 below do this explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["energy", "energy_attention", "tree_reduce", "tree_energy", "tree_attention_reference"]


def _scores(q: Tensor, k: Tensor, scale: float | None, causal: bool) -> Tensor:
    """Scaled scores ``[B, Hq, Tq, S]`` with GQA broadcast, -inf where masked (bottom-right causal)."""
    B, Hq, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"Hq must be a multiple of Hkv: Hq={Hq}, Hkv={Hkv}")
    scale = D**-0.5 if scale is None else scale
    s = torch.matmul(q.reshape(B, Hkv, Hq // Hkv * Tq, D), k.transpose(-1, -2)).reshape(B, Hq, Tq, S) * scale
    if causal:
        i = torch.arange(Tq, device=q.device).view(Tq, 1)
        j = torch.arange(S, device=q.device).view(1, S)
        s = s.masked_fill(j > i + (S - Tq), float("-inf"))
    return s


def _zeta_v(zeta: Tensor, v: Tensor) -> Tensor:
    """``ζ·v_a`` per query and key, ``[B, Hq, Tq, S]``."""
    B, Hq, Tq, Dv = zeta.shape
    Hkv = v.shape[1]
    return torch.matmul(zeta.reshape(B, Hkv, Hq // Hkv * Tq, Dv), v.transpose(-1, -2)).reshape(B, Hq, Tq, -1)


def energy(
    q: Tensor, k: Tensor, v: Tensor, zeta: Tensor, *, scale: float | None = None, causal: bool = False
) -> Tensor:
    """The energy ``F_i(ζ) = log Σ_a exp(scale · q_i·k_a + ζ_i·v_a)`` of every query (eq. 6).

    Args:
        q: ``[B, Hq, Tq, D]``; k: ``[B, Hkv, S, D]``; v: ``[B, Hkv, S, Dv]``; ``Hq % Hkv == 0``.
        zeta: ``[B, Hq, Tq, Dv]``, one source per query (and head).
        scale: default ``1/sqrt(D)``.
        causal: query ``i`` sees keys ``0 .. S - Tq + i`` only (eq. 25 when Tq = S).

    Returns:
        ``F [B, Hq, Tq]`` in the inputs' dtype; differentiable in every argument.
    """
    if zeta.shape[:3] != q.shape[:3] or zeta.shape[3] != v.shape[3]:
        raise ValueError(f"zeta must be [B, Hq, Tq, Dv]={(*q.shape[:3], v.shape[3])}, got {tuple(zeta.shape)}")
    return torch.logsumexp(_scores(q, k, scale, causal) + _zeta_v(zeta, v), dim=-1)


def energy_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: bool = False, shift: Tensor | None = None
) -> Tensor:
    """Attention computed as ``∂F_tot/∂ζ`` at ``ζ = 0`` with ``torch.autograd`` (eq. 5, 26).

    ``F_tot = Σ_{b,h,i} F_{b,h,i}``; since ``F_{b,h,i}`` depends only on ``ζ_{b,h,i}``, the
    gradient's row ``i`` is the attention output of query ``i``. ``shift`` (``[B, Hq, Tq]``,
    optional) subtracts a per-query constant ``m_i`` inside the exponent (App. F, eq. 36);
    the gradient does not change — the safe-softmax shift invariance.

    Shapes as :func:`energy`; returns ``[B, Hq, Tq, Dv]`` in the inputs' dtype.
    """
    zeta = torch.zeros((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device, requires_grad=True)
    with torch.enable_grad():
        logits = _scores(q.detach(), k.detach(), scale, causal) + _zeta_v(zeta, v.detach())
        if shift is not None:
            logits = logits - shift.unsqueeze(-1)
        (grad,) = torch.autograd.grad(torch.logsumexp(logits, dim=-1).sum(), zeta)
    return grad


def tree_reduce(xs: Sequence[Tensor], op: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, int]:
    """Reduce ``xs`` with the associative ``op`` by a pairwise tree; returns ``(result, depth)``
    with ``depth = ceil(log2 len(xs))`` rounds (what p devices would need, Theorem 1)."""
    if not xs:
        raise ValueError("tree_reduce needs at least one element")
    level, depth = list(xs), 0
    while len(level) > 1:
        level = [op(level[i], level[i + 1]) if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
        depth += 1
    return level[0], depth


def tree_energy(
    q: Tensor, k: Tensor, v: Tensor, p: int, *, zeta: Tensor | None = None, scale: float | None = None
) -> tuple[Tensor, Tensor, int]:
    """Algorithm 1 (single-query energy forward) over ``p`` key chunks, single process.

    Splits the keys into ``p`` chunks (``torch.tensor_split``; chunks may be empty when
    ``p > S``), computes ``r = scale·q·k + ζ·v`` per chunk, the global max ``m`` by a tree
    reduction of chunk maxima, then ``lse = log Σ exp(r - m)`` by a tree reduction of chunk
    log-sum-exps (``logaddexp``). Returns ``(F, m, depth)`` with ``F = m + lse`` ``[B, Hq, Tq]``
    and ``depth = ceil(log2 p)``. ``zeta`` defaults to 0 (then F is the attention lse).
    """
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if zeta is None:
        zeta = torch.zeros((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)
    rs = [_scores(q, kc, scale, False) + _zeta_v(zeta, vc) for kc, vc in _chunks(k, v, p)]
    neg = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
    m, depth = tree_reduce([r.amax(-1) if r.shape[-1] else neg for r in rs], torch.maximum)
    m0 = torch.where(torch.isinf(m), 0.0, m)
    lse, _ = tree_reduce([torch.logsumexp(r - m0.unsqueeze(-1), -1) for r in rs], torch.logaddexp)
    return m0 + lse, m, depth


def tree_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, p: int, *, scale: float | None = None
) -> tuple[Tensor, Tensor, int]:
    """Algorithms 1 + 2 (tree decoding) over ``p`` key chunks, single process.

    Algorithm 1 gives the global ``m`` and ``lse``; then every chunk computes
    ``R = Σ_a exp(scale·q·k_a - F) v_a`` and a tree reduction of the sums gives the output.

    Returns ``(out [B, Hq, Tq, Dv], lse [B, Hq, Tq], depth)``, equal to direct attention.
    """
    F, _, depth = tree_energy(q, k, v, p, scale=scale)
    Hkv = k.shape[1]
    B, Hq, Tq, _ = q.shape
    parts = []
    for kc, vc in _chunks(k, v, p):
        w = torch.exp(_scores(q, kc, scale, False) - F.unsqueeze(-1))  # [B, Hq, Tq, t]
        parts.append(torch.matmul(w.reshape(B, Hkv, Hq // Hkv * Tq, -1), vc).reshape(B, Hq, Tq, -1))
    out, _ = tree_reduce(parts, torch.add)
    return out, F, depth


def _chunks(k: Tensor, v: Tensor, p: int) -> list[tuple[Tensor, Tensor]]:
    return list(zip(torch.tensor_split(k, p, dim=2), torch.tensor_split(v, p, dim=2), strict=True))
