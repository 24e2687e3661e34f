"""Causal prefill across ranks with Ring Attention (seed 004: online softmax over blocks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import world
from ..ops.attention import _attention
from ..ops.state import merge_states

_MASK_BUDGET = 1 << 24  # elements of the dense causal mask per attention call


def ring_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: list[Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact causal attention for a prompt whose tokens are spread over the ranks of ``group``.

    Args:
        q: ``[B, Hq, n, D]`` queries of this rank's tokens; k, v: ``[B, Hkv, n, D]`` their
            keys/values (``n = len(positions[rank])``, may differ per rank).
        positions: for every rank ``j``, the global positions ``[n_j]`` (int64, host, the same
            list on every rank) of rank j's tokens. A query at position ``a`` sees the keys
            at positions ``<= a`` on every rank. Any layout works; a striped/interleaved one
            (``treeattn.cache.Placement("interleaved", p)``) balances the causal work.

    Returns:
        ``out [B, Hq, n, Dv]`` in q's dtype (and lse ``[B, Hq, n]`` float32).

    Blocks wholly in the future of every local query are received but not computed.
    """
    from .ring import ring_pass

    rank, _ = world(group)
    qpos = positions[rank].to(torch.int64)
    qmax = int(qpos.max()) if len(qpos) else -1
    state: list[Tensor] = []

    G = q.shape[1] // max(1, k.shape[1])

    def visit(src: int, kb: Tensor, vb: Tensor) -> None:
        kpos = positions[src].to(torch.int64)
        if len(kpos) == 0 or int(kpos.min()) > qmax:
            if not state:
                o, l = _attention(q, kb[:, :, :0], vb[:, :, :0], scale=scale, keep_fp32=True)
                state[:] = (o, l)
            return
        if int(kpos.max()) <= int(qpos.min()):  # every key precedes every query: no mask
            o, l = _attention(q, kb, vb, scale=scale, backend=backend, keep_fp32=True)
        else:  # query rows in chunks, so the dense mask stays under _MASK_BUDGET elements
            rows = max(1, _MASK_BUDGET // (G * len(kpos)))
            parts = []
            for a in range(0, len(qpos), rows):
                mask = (kpos[None, :] <= qpos[a : a + rows, None]).unsqueeze(0).to(q.device)
                parts.append(
                    _attention(q[:, :, a : a + rows], kb, vb, scale=scale, mask=mask, backend=backend, keep_fp32=True)
                )
            o, l = torch.cat([x[0] for x in parts], 2), torch.cat([x[1] for x in parts], 2)
        state[:] = merge_states(*state, o, l) if state else (o, l)

    ring_pass(k, v, [len(x) for x in positions], group, visit)
    out, lse = state
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
