"""Block kernels of the pure-torch attention path: the attention state of one score block
(:func:`block_state`, shared with ``_decode_cpu.decode_torch``) and the chunked online
softmax over the keys built on it (``_chunked``, the ``"torch"`` path of ``attention``).

Imports nothing from ``attention`` or ``_decode_cpu``, which both import it."""

from __future__ import annotations

import torch
from torch import Tensor

from .alibi import add_bias
from .state import empty_state, merge_states

__all__ = ["block_state"]

# Largest score block the chunked path materialises, in elements (float32: 32 MiB).
_SCORE_BUDGET = 1 << 23


def block_state(s: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block: scores ``s [..., R, C]`` in the accumulation dtype (-inf
    where hidden) over values ``v [..., C, Dv]`` (cast to the scores' dtype for the product).
    On the CPU a non-finite value reaches only the rows that weigh it (a hidden one would
    leak in as 0 x NaN); a +inf lse (an inf score) becomes NaN, never "empty"."""
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - m)
    den = p.sum(-1)
    # the product in the accumulation dtype: p rounded to bf16/fp16 first cost up to 2.2-2.6x
    # plain PyTorch's error against float64 (a new user's seeds)
    v = v.to(p.dtype) if v.dtype != p.dtype else v
    bad = ~torch.isfinite(v) if v.device.type == "cpu" else None
    if bad is not None and bool(bad.any()):
        hit = torch.matmul((p > 0).to(p.dtype), bad.to(p.dtype)) > 0  # [..., R, Dv]: weighs a bad value
        o = torch.where(hit, torch.matmul(p, v), torch.matmul(p, v.masked_fill(bad, 0.0)))
    else:
        o = torch.matmul(p, v)
    o = o / torch.where(den > 0, den, 1.0).unsqueeze(-1)
    lse = m.squeeze(-1) + torch.log(den)
    return o, torch.where(lse == float("inf"), float("nan"), lse)


def _chunked(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    lo: Tensor | None,
    hi: Tensor | None,
    vis: Tensor | None = None,
    seq: tuple[Tensor, Tensor] | None = None,
    softcap: float | None = None,
    bias: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked online-softmax attention. ``seq = (seq_lo, seq_hi)`` ``[B]``: zero the values
    outside each sequence's read range (0 x NaN would otherwise leak masked garbage).
    ``bias``: an ALiBi bias per row (:func:`treeattn.ops.alibi.row_bias`), added after the softcap."""
    B, Hkv, R, _ = qg.shape
    S, Dv = k.shape[2], v.shape[3]
    acc = torch.float64 if qg.dtype == torch.float64 else torch.float32
    chunk = max(256, _SCORE_BUDGET // max(1, B * Hkv * R))
    qs = qg.to(acc) * scale
    out, lse = empty_state((B, Hkv, R, Dv), qg.device)
    for s0 in range(0, S, chunk):
        kc, vc = k[:, :, s0 : s0 + chunk], v[:, :, s0 : s0 + chunk]
        s = torch.matmul(qs, kc.to(acc).transpose(-1, -2))  # [B, Hkv, R, C]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            s = add_bias(s, bias, s0)
        if lo is not None or hi is not None:
            j = torch.arange(s0, s0 + kc.shape[2], device=qg.device)
            hide = (j >= hi) if hi is not None else None
            if lo is not None:
                hide = (j < lo) if hide is None else hide | (j < lo)
            s = s.masked_fill(hide, float("-inf"))
        if vis is not None:
            s = s.masked_fill(~vis[..., s0 : s0 + kc.shape[2]], float("-inf"))
        if seq is not None:
            jv = torch.arange(s0, s0 + kc.shape[2], device=qg.device).view(1, 1, -1, 1)
            vc = vc.masked_fill((jv < seq[0].view(B, 1, 1, 1)) | (jv >= seq[1].view(B, 1, 1, 1)), 0.0)
        o, c_lse = block_state(s, vc)
        if s0 == 0:
            out, lse = o, c_lse
        else:
            out, lse = merge_states(out, lse, o, c_lse)
    return out, lse
