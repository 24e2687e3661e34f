"""Validation shared by tree_decode and ring_decode (one small collective, never a hang)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import world
from ..comm.validate import agree
from ..config import STRATEGIES
from ..ops.attention import check_attention_inputs

_OPS = (*STRATEGIES, "ring")


def check_new_tokens(q: Tensor, k: Tensor, v: Tensor, new_k, new_v, new_mask) -> None:
    if (new_k is None) != (new_v is None):
        raise ValueError(
            "new_k and new_v must be given together (got only " + ("new_k)" if new_v is None else "new_v)")
        )
    if new_k is None:
        if new_mask is not None:
            raise ValueError("new_mask was given without new_k/new_v")
        return
    B, Hq, Tq, _ = q.shape
    for name, t, ref in (("new_k", new_k, k), ("new_v", new_v, v)):
        want = (B, ref.shape[1], Tq, ref.shape[3])
        if not isinstance(t, Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be [B, Hkv, Tq, D]={want}, got {got}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's dtype/device {q.dtype}/{q.device}, got {t.dtype}/{t.device}")
    if new_mask is not None:
        if (
            not isinstance(new_mask, Tensor)
            or new_mask.dtype != torch.bool
            or tuple(new_mask.shape)
            not in (
                (Tq, Tq),
                (B, Tq, Tq),
            )
        ):
            got = (
                f"{new_mask.dtype} {tuple(new_mask.shape)}" if isinstance(new_mask, Tensor) else type(new_mask).__name__
            )
            raise ValueError(f"new_mask must be a bool tensor [Tq, Tq]=({Tq}, {Tq}) or [B, Tq, Tq], got {got}")


def check_window(window) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")


def validate_decode(
    q,
    k,
    v,
    kv_lens,
    new_k,
    new_v,
    new_mask,
    scale,
    op: str,
    group: dist.ProcessGroup | None,
    allowed=_OPS,
    ranks_per_node: int = 0,
    kv_start: Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    cost_model: Callable[[], int] | None = None,
    heads: list[int] | None = None,
    alibi=None,
) -> None:
    """Local checks on this rank, then one all-gather so every rank raises the same
    ``ValueError`` when any rank's input is bad or the ranks disagree on the metadata.
    ``cost_model``: returns the fingerprint of ``auto``'s cost model (may raise ValueError);
    ``heads``: the cut points of a reduction scattered over the heads (tree_decode's);
    ``alibi``: a :class:`treeattn.ops.Alibi` (its slopes are agreed)."""
    err = None
    model = 0
    try:
        if cost_model is not None:
            model = cost_model()
        if op not in allowed:
            raise ValueError(f"strategy must be one of {tuple(allowed)}, got {op!r}")
        check_attention_inputs(q, k, v, kv_lens, scale=scale, kv_start=kv_start, softcap=softcap, alibi=alibi)
        if alibi is not None and new_k is not None and q.shape[2] > 1 and alibi.q_pos.ndim != 2:
            raise ValueError("alibi.q_pos must be [B, Tq] with new tokens and Tq > 1 (their positions)")
        check_new_tokens(q, k, v, new_k, new_v, new_mask)
        check_window(window)
        p = world(group)[1]
        if heads is not None and (len(heads) != p + 1 or heads[0] != 0 or heads[-1] != q.shape[1]
                                  or any(b < a for a, b in zip(heads, heads[1:], strict=False))):  # fmt: skip
            raise ValueError(f"heads must be {p + 1} non-decreasing cut points from 0 to Hq = {q.shape[1]}, got {heads}")
    except (ValueError, TypeError) as e:
        err = f"{type(e).__name__}: {e}" if isinstance(e, TypeError) else str(e)
    ok = err is None
    fields = {
        "B": q.shape[0] if ok else -1,
        "Hq": q.shape[1] if ok else -1,
        "Hkv": k.shape[1] if ok else -1,
        "D": q.shape[3] if ok else -1,
        "Dv": v.shape[3] if ok else -1,
        "Tq": q.shape[2] if ok else -1,
        "dtype": str(q.dtype).removeprefix("torch.") if ok else None,
        # the scale each rank will use (None: 1/sqrt(D)): None and 0.0 must not look alike
        "scale": float(q.shape[3] ** -0.5 if scale is None else scale) if ok else None,
        "strategy": op if isinstance(op, str) else None,
        "new tokens": new_k is not None,
        "new_mask": "absent" if new_mask is None or not isinstance(new_mask, Tensor) else f"{new_mask.ndim}-D",
        "ranks_per_node": ranks_per_node,
        "kv_start": "absent" if not ok or kv_start is None else ("[B]", "[B, Tq]")[kv_start.ndim - 1],
        "softcap": float(softcap) if ok and softcap is not None else None,
        "window": window if ok else None,
        "cost model (profile)": model,
        "heads": ",".join(map(str, heads)) if ok and heads is not None else None,
        "alibi slopes": ",".join(f"{x:.9g}" for x in alibi.slopes.tolist()) if ok and alibi is not None else None,
    }
    device = q.device if isinstance(q, Tensor) and q.device.type != "cpu" and _nccl(group) else "cpu"
    agree(fields, err, group=group, device=device)


def _nccl(group) -> bool:
    try:
        return dist.get_backend(group) == "nccl"
    except Exception:
        return False
