"""Causal prefill across ranks: Ring Attention (seed 004: online softmax over blocks) and
Tree prefill (queries gathered, local attention, one tree reduction of the states)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import all_gather, world
from ..comm.strategies import STRATEGIES, reduce_states
from ..ops.attention import _attention
from ..ops.state import empty_state, merge_states

_MASK_BUDGET = 1 << 24  # elements of the dense causal mask per attention call


def causal_states(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qpos: Tensor,
    kpos: Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Float32 state of queries at global positions ``qpos [T]`` over keys at ``kpos [S]``
    (host int64; a query sees the keys at positions ``<=`` its own; a query at position -1
    sees nothing). Keys wholly in the future are never computed; the dense mask is built
    for at most ``_MASK_BUDGET`` elements at a time (query rows in chunks)."""
    qpos, kpos = qpos.to(torch.int64), kpos.to(torch.int64)
    T = q.shape[2]
    if len(kpos) == 0 or T == 0 or int(kpos.min()) > int(qpos.max()):
        out, lse = empty_state((q.shape[0], q.shape[1], T, v.shape[3]), q.device)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return out.to(acc), lse.to(acc)
    if int(kpos.max()) <= int(qpos.min()):  # every key precedes every query: no mask
        return _attention(q, k, v, scale=scale, backend=backend, keep_fp32=True)
    G = q.shape[1] // max(1, k.shape[1])
    rows = max(1, _MASK_BUDGET // (G * len(kpos)))
    parts = []
    for a in range(0, T, rows):
        mask = (kpos[None, :] <= qpos[a : a + rows, None]).unsqueeze(0).to(q.device)
        parts.append(_attention(q[:, :, a : a + rows], k, v, scale=scale, mask=mask, backend=backend, keep_fp32=True))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([x[0] for x in parts], 2), torch.cat([x[1] for x in parts], 2)


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
    q_positions: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact causal attention for a prompt whose tokens are spread over the ranks of ``group``.

    Args:
        q: ``[B, Hq, n, D]`` queries of this rank's tokens; k, v: ``[B, Hkv, m, D]`` this
            rank's keys/values (``m = len(positions[rank])``, may differ per rank).
        positions: for every rank ``j``, the global positions ``[m_j]`` (int64, host, the same
            list on every rank) of rank j's keys. A query at position ``a`` sees the keys
            at positions ``<= a`` on every rank. Any layout works; a striped/interleaved one
            (``treeattn.cache.Placement("interleaved", p)``) balances the causal work.
        q_positions: global positions ``[n]`` (host) of this rank's queries; default
            ``positions[rank]`` (queries = this rank's keys). A chunked prefill passes the
            current chunk here and every stored key in ``k``/``v``.

    Returns:
        ``out [B, Hq, n, Dv]`` in q's dtype (and lse ``[B, Hq, n]`` float32).

    Blocks wholly in the future of every local query are received but not computed.
    """
    from .ring import ring_pass

    rank, _ = world(group)
    qpos = (positions[rank] if q_positions is None else q_positions).to(torch.int64)
    state: list[Tensor] = []

    def visit(src: int, kb: Tensor, vb: Tensor) -> None:
        o, l = causal_states(q, kb, vb, qpos, positions[src], scale=scale, backend=backend)
        state[:] = merge_states(*state, o, l) if state else (o, l)

    ring_pass(k, v, [len(x) for x in positions], group, visit)
    out, lse = state
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def tree_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_positions: list[Tensor],
    k_positions: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    strategy: str = "auto",
    backend: str = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact causal attention for queries spread over the ranks of ``group`` against a KV
    cache sharded over them, by Tree Attention: the ranks gather every rank's queries (one
    all-gather of ``p·n_max`` query rows), each attends them to its own shard, and one
    reduction (``strategy``, as :func:`treeattn.tree_decode`) merges the states. The traffic
    per call is ``O(p·n_max·Hq·D)``, independent of the cache length (Ring prefill moves
    the whole cache), which is what makes a chunked prefill of a long prompt cheap.

    Args:
        q: ``[B, Hq, n, D]`` this rank's queries (``n = len(q_positions[rank])``, may differ
            per rank, may be 0).
        k, v: ``[B, Hkv, m, D]`` / ``[B, Hkv, m, Dv]`` this rank's keys/values, every key a
            query may see included (a chunked prefill stores the chunk first).
        q_positions: for every rank ``j`` the global positions ``[n_j]`` (int64, host, the
            same list on every rank) of rank j's queries.
        k_positions: ``[m]`` global positions (host) of this rank's keys. A query at
            position ``a`` sees the keys at positions ``<= a`` on every rank.
        strategy: reduction (one of ``treeattn.comm.STRATEGIES``).

    Returns:
        ``out [B, Hq, n, Dv]`` in q's dtype (and lse ``[B, Hq, n]`` float32).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    rank, p = world(group)
    B, Hq, n, _ = q.shape
    sizes = [len(x) for x in q_positions]
    nmax = max(sizes)
    if nmax == 0:
        out, lse = empty_state((B, Hq, 0, v.shape[3]), q.device)
        return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)
    qp = q if n == nmax else torch.cat([q, q.new_zeros(B, Hq, nmax - n, q.shape[3])], 2)
    allq = all_gather(qp, group)  # [p, B, Hq, nmax, D]
    allq = allq.permute(1, 2, 0, 3, 4).reshape(B, Hq, p * nmax, q.shape[3])
    pad = torch.full((nmax,), -1, dtype=torch.int64)
    allpos = torch.cat([torch.cat([x.to(torch.int64), pad[: nmax - len(x)]]) for x in q_positions])
    out, lse = causal_states(allq, k, v, allpos, k_positions, scale=scale, backend=backend)
    out, lse = reduce_states(out, lse, group=group, strategy=strategy)
    out, lse = out[:, :, rank * nmax : rank * nmax + n], lse[:, :, rank * nmax : rank * nmax + n]
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
