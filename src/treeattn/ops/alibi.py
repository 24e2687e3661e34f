"""ALiBi (Press et al., 2022; BLOOM, MPT): a per-head linear bias on the distance between a
query's and a key's *global* positions, added to the scaled scores before the softmax. The
bias of a key depends on nothing but its own position and the query's, so each shard adds it
to its own keys' scores and the attention states still merge exactly (like a softcap)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Alibi", "alibi_slopes", "check_alibi"]


class Alibi(NamedTuple):
    """The bias ``slopes[h] * (k_pos[j] - q_pos[i])`` (<= 0 for a visible key) added to head
    ``h``'s scaled score of query ``i`` over key ``j``.

    Attributes:
        slopes: ``[Hq]`` floating slope of each query head (the same on every rank).
        q_pos: integer ``[B]`` or ``[B, Tq]`` global position of each query.
        k_pos: integer ``[B, S]`` global position of each key (slot) the call reads; slots
            beyond a sequence's ``kv_lens`` are never visible, whatever they hold.
    """

    slopes: Tensor
    q_pos: Tensor
    k_pos: Tensor


def alibi_slopes(n_heads: int) -> Tensor:
    """The standard ALiBi slopes of ``n_heads`` heads (float32 ``[n_heads]``): the geometric
    sequence ``2^(-8 i / n)`` for the largest power of two ``n <= n_heads``, then every
    other slope of the ``2n`` sequence for the rest (BLOOM's ``_get_alibi_slopes``)."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be an int >= 1, got {n_heads!r}")
    n = 2 ** math.floor(math.log2(n_heads))
    base = 2 ** (-(2 ** -(math.log2(n) - 3)))
    slopes = torch.pow(torch.tensor(base, dtype=torch.float32), torch.arange(1, 1 + n, dtype=torch.int32))
    if n != n_heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * n) - 3)))
        more = min(n, n_heads - n)
        slopes = torch.cat([slopes, torch.pow(torch.tensor(extra), torch.arange(1, 1 + 2 * more, 2, dtype=torch.int32))])
    return slopes


def check_alibi(alibi, B: int, Hq: int, Tq: int, S: int, device: torch.device) -> None:
    """ValueError naming the field unless ``alibi`` (an :class:`Alibi` or None) fits a call of
    ``B`` sequences, ``Hq`` query heads, ``Tq`` queries and ``S`` key slots on ``device``."""
    if alibi is None:
        return
    if not isinstance(alibi, Alibi):
        raise ValueError(f"alibi must be a treeattn.ops.Alibi (slopes, q_pos, k_pos) or None, got {type(alibi).__name__}")
    s, qp, kp = alibi
    if not isinstance(s, Tensor) or not s.dtype.is_floating_point or tuple(s.shape) != (Hq,):
        raise ValueError(f"alibi.slopes must be a floating tensor [Hq]=({Hq},), got {_desc(s)}")
    if not isinstance(qp, Tensor) or not _integer(qp) or tuple(qp.shape) not in ((B,), (B, Tq)):
        raise ValueError(f"alibi.q_pos must be an integer tensor [B]=({B},) or [B, Tq]=({B}, {Tq}), got {_desc(qp)}")
    if not isinstance(kp, Tensor) or not _integer(kp) or kp.ndim != 2 or kp.shape[0] != B or kp.shape[1] < S:
        raise ValueError(f"alibi.k_pos must be an integer tensor [B, >= S]=({B}, {S}), got {_desc(kp)}")
    for name, t in (("slopes", s), ("q_pos", qp), ("k_pos", kp)):
        if t.device != device:
            raise ValueError(f"alibi.{name} must be on q's device {device}, got {t.device}")


def _integer(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def row_bias(alibi: Alibi, B: int, Hkv: int, Tq: int, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The bias's factors per row of the grouped layout (row ``r = g * Tq + i`` of KV head
    ``kv``: query head ``kv * G + g``, query ``i``): ``(slope [1, Hkv, R, 1] acc,
    q_pos [B, 1, R, 1] int64, k_pos [B, S] int64)``."""
    s, qp, kp = alibi
    G = s.shape[0] // Hkv
    slope = s.to(acc).view(Hkv, G, 1).expand(Hkv, G, Tq).reshape(1, Hkv, G * Tq, 1)
    qp = qp.to(torch.int64).reshape(B, -1).expand(B, Tq)
    qp = qp.repeat(1, G).view(B, 1, G * Tq, 1)
    return slope, qp, kp.to(torch.int64)


def add_bias(s: Tensor, bias: tuple[Tensor, Tensor, Tensor], s0: int) -> Tensor:
    """Scores ``s [B, Hkv, R, C]`` of the keys ``s0 .. s0 + C - 1`` plus the ALiBi bias."""
    slope, qp, kp = bias
    dist = (kp[:, None, None, s0 : s0 + s.shape[-1]] - qp).to(s.dtype)  # exact integers: no large terms
    return s + slope * dist
