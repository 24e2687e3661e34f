"""Causal prefill across ranks: Ring Attention (seed 004: online softmax over blocks) and
Tree prefill (queries gathered, local attention, the states sent back by one all-to-all)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import all_gather, all_to_all, world
from ..comm.strategies import STRATEGIES, reduce_states
from ..ops import attention_state
from ..ops.alibi import Alibi
from ..ops.causal import causal_block_states, causal_square_states
from ..ops.state import empty_state, merge_into
from ._common import check_window

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
    window: int | None = None,
    softcap: float | None = None,
    alibi: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Float32 state of queries at global positions ``qpos [T]`` over keys at ``kpos [S]``
    (host int64; a query at position ``P`` sees the keys at positions ``P - window < pos <= P``
    — transformers' sliding-window mask — or ``<= P`` without a window; a query at position
    -1 sees nothing). ``softcap``: see :func:`treeattn.attention_with_lse`. Keys no query
    of a row block sees are never computed. Keys in position order (every placement) give
    per-query ``[start, end)`` slot bounds: float32 on AVX-512 CPUs runs them in one call of
    the prefill kernel (:mod:`treeattn.ops._prefill_cpu`), else through PyTorch's fused kernel;
    keys out of order get a dense mask for at most ``_MASK_BUDGET`` elements at a time (query
    rows in chunks). ``alibi``: ALiBi slopes ``[Hq]`` (:class:`treeattn.ops.Alibi` on these
    positions): the per-row path on the torch kernel."""
    qpos, kpos = qpos.to(torch.int64), kpos.to(torch.int64)
    T = q.shape[2]
    real = qpos[qpos >= 0]
    lo_pos = None if window is None else qpos - window + 1
    if (
        len(kpos) == 0
        or len(real) == 0
        or int(kpos.min()) > int(real.max())
        or (window is not None and int(kpos.max()) <= int(real.min()) - window)
    ):
        out, lse = empty_state((q.shape[0], q.shape[1], T, v.shape[3]), q.device)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return out.to(acc), lse.to(acc)
    if alibi is not None:
        _check_slopes(alibi, q.shape[1])
        return _biased(q, k, v, qpos, kpos, lo_pos, scale, softcap, alibi)
    if int(kpos.max()) <= int(qpos.min()) and (window is None or int(kpos.min()) > int(qpos.max()) - window):
        st = causal_block_states(q, k, v, None, None, scale, softcap, backend)  # all visible
        return st or attention_state(q, k, v, scale=scale, softcap=softcap, backend=backend, keep_fp32=True)
    B, G = q.shape[0], q.shape[1] // max(1, k.shape[1])
    rows = max(1, _MASK_BUDGET // (G * len(kpos)))
    ordered = len(kpos) < 2 or bool((kpos[1:] > kpos[:-1]).all())
    if ordered:
        end = torch.searchsorted(kpos, qpos, right=True)  # first key after the query
        start = None if lo_pos is None else torch.searchsorted(kpos, lo_pos)  # first key in its window
        st = causal_block_states(q, k, v, start, end, scale, softcap, backend)  # one call, per-row bounds
        if st is not None:
            return st
    if ordered and window is None:
        split = _causal_blocks(q, k, v, end, scale, softcap, backend)
        if split is not None:
            return split
    parts = []
    for a in range(0, T, rows):
        qa = q[:, :, a : a + rows]
        if ordered:
            ea = end[a : a + rows].to(q.device).expand(B, -1)
            sa = None if start is None else start[a : a + rows].to(q.device).expand(B, -1)
            kw = dict(kv_start=sa, kv_end=ea)
        else:
            vis = kpos[None, :] <= qpos[a : a + rows, None]
            if lo_pos is not None:
                vis &= kpos[None, :] >= lo_pos[a : a + rows, None]
            kw = dict(mask=vis.unsqueeze(0).to(q.device))
        parts.append(attention_state(qa, k, v, scale=scale, softcap=softcap, backend=backend, keep_fp32=True, **kw))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([x[0] for x in parts], 2), torch.cat([x[1] for x in parts], 2)


def _check_slopes(alibi, Hq: int) -> None:
    if not isinstance(alibi, Tensor) or not alibi.dtype.is_floating_point or tuple(alibi.shape) != (Hq,):
        got = f"{alibi.dtype} {tuple(alibi.shape)}" if isinstance(alibi, Tensor) else type(alibi).__name__
        raise ValueError(f"alibi must be the floating slopes [Hq]=({Hq},), got {got}")


def _biased(q, k, v, qpos: Tensor, kpos: Tensor, lo_pos: Tensor | None, scale, softcap, slopes: Tensor):
    """:func:`causal_states` under ALiBi: rows in chunks, each with its bias and a dense mask
    on positions (keys in any order)."""
    B, T = q.shape[0], q.shape[2]
    rows = max(1, _MASK_BUDGET // (q.shape[1] // max(1, k.shape[1]) * len(kpos)))
    kp = kpos.to(q.device).expand(B, -1)
    parts = []
    for a in range(0, T, rows):
        qa = qpos[a : a + rows]
        vis = kpos[None, :] <= qa[:, None]
        if lo_pos is not None:
            vis &= kpos[None, :] >= lo_pos[a : a + rows, None]
        bias = Alibi(slopes, qa.to(q.device).expand(B, -1), kp)
        parts.append(attention_state(q[:, :, a : a + rows], k, v, scale=scale, softcap=softcap, backend="torch",
                                keep_fp32=True, mask=vis.unsqueeze(0).to(q.device), alibi=bias))  # fmt: skip
    if len(parts) == 1:
        return parts[0]
    return torch.cat([x[0] for x in parts], 2), torch.cat([x[1] for x in parts], 2)


def _runs(e: list[int]) -> list[tuple[int, int, bool]]:
    """Query rows ``[i, j)`` that see the first ``e[i]`` keys each (``False``: the same keys) or
    one key more per row (``True``: a causal triangle after a shared prefix); rows seeing none
    are left out."""
    runs, i, T = [], 0, len(e)
    while i < T:
        if e[i] == 0:
            i += 1
            continue
        j, step = i + 1, 1 if i + 1 < T and e[i + 1] == e[i] + 1 else 0
        while j < T and e[j] == e[j - 1] + step and (step or e[j]):
            j += 1
        runs.append((i, j, bool(step)))
        i = j
    return runs


def _causal_blocks(q, k, v, end: Tensor, scale, softcap, backend) -> tuple[Tensor, Tensor] | None:
    """The state of queries that see the keys ``[0, end[row])`` (keys in position order, no
    window) as whole blocks for the fused kernel instead of per-row bounds: per run of rows,
    the keys every row sees in one unmasked call, then the causal triangle (one key more per
    row) with the kernel's own causal skipping, merged. None when the rows do not fall into a
    few (or long) such runs (the per-row path then runs)."""
    runs = _runs(end.tolist())
    B, Hq, T, D = q.shape
    if not runs or len(runs) > max(16, T // 64):  # many short runs: the per-row path
        return None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = lse = None
    for i, j, tri in runs:
        e0, e1 = int(end[i]), int(end[j - 1])
        shared = e0 - 1 if tri else e0
        qr = q[:, :, i:j]
        st = None
        if shared:
            st = attention_state(qr, k[:, :, :shared], v[:, :, :shared], scale=scale, softcap=softcap, backend=backend,
                            keep_fp32=True)  # fmt: skip
        if tri:
            t = causal_square_states(qr, k[:, :, shared:e1], v[:, :, shared:e1], scale, softcap, backend)
            if st is None:
                st = t
            else:
                merge_into(*st, *t)
        if (i, j) == (0, T):  # one run covers every row: its state is the result
            return st[0].to(acc), st[1].to(acc)
        if out is None:
            out, lse = empty_state((B, Hq, T, v.shape[3]), q.device)
            out, lse = out.to(acc), lse.to(acc)
        out[:, :, i:j], lse[:, :, i:j] = st[0], st[1]
    return out, lse


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
    window: int | None = None,
    softcap: float | None = None,
    alibi: Tensor | None = None,
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
        window: sliding window on global positions: a query at position ``a`` sees only the
            keys at ``a - window < pos <= a`` (transformers' ``sliding_window``).
        softcap: attention-logit softcapping (see :func:`treeattn.attention_with_lse`).
        alibi: ALiBi slopes ``[Hq]`` (BLOOM, MPT): ``slopes[h] * (key - query position)`` added
            to every score, on these global positions; the same on every rank (not agreed here:
            the caller's, as the positions).

    Returns:
        ``out [B, Hq, n, Dv]`` in q's dtype (and lse ``[B, Hq, n]`` float32).

    Blocks wholly in the future of (or before the window of) every local query are
    received but not computed.
    """
    from .ring import ring_pass

    check_window(window)
    if alibi is not None:
        _check_slopes(alibi, q.shape[1])
    rank, _ = world(group)
    qpos = (positions[rank] if q_positions is None else q_positions).to(torch.int64)
    state: list[Tensor] = []

    def visit(src: int, kb: Tensor, vb: Tensor) -> None:
        o, l = causal_states(
            q, kb, vb, qpos, positions[src], scale=scale, backend=backend, window=window, softcap=softcap, alibi=alibi
        )
        if state:
            merge_into(*state, o, l)
        else:
            state[:] = o, l

    ring_pass(k, v, [len(x) for x in positions], group, visit, shm=True)
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
    window: int | None = None,
    softcap: float | None = None,
    alibi: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact causal attention for queries spread over the ranks of ``group`` against a KV
    cache sharded over them, by Tree Attention: the ranks gather every rank's queries (one
    all-gather of ``p·n_max`` query rows), each attends them to its own shard, and every rank
    gets its own queries' partial states back (one all-to-all of ``n_max`` rows per pair of
    ranks) and merges them. The traffic per call is ``O(p·n_max·Hq·D)``, independent of the
    cache length (Ring prefill moves the whole cache): a few queries over a long cache are cheap.

    Args:
        q: ``[B, Hq, n, D]`` this rank's queries (``n = len(q_positions[rank])``, may differ
            per rank, may be 0).
        k, v: ``[B, Hkv, m, D]`` / ``[B, Hkv, m, Dv]`` this rank's keys/values, every key a
            query may see included (a chunked prefill stores the chunk first).
        q_positions: for every rank ``j`` the global positions ``[n_j]`` (int64, host, the
            same list on every rank) of rank j's queries.
        k_positions: ``[m]`` global positions (host) of this rank's keys. A query at
            position ``a`` sees the keys at positions ``<= a`` on every rank.
        strategy: ``"auto"``: the all-to-all above; another of ``treeattn.comm.STRATEGIES``
            merges every query's states on every rank by that reduction (as
            :func:`treeattn.tree_decode`), then keeps this rank's.
        window, softcap, alibi: sliding window on global positions, attention-logit
            softcapping and ALiBi slopes, as :func:`ring_prefill`.

    Returns:
        ``out [B, Hq, n, Dv]`` in q's dtype (and lse ``[B, Hq, n]`` float32).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_window(window)
    if alibi is not None:
        _check_slopes(alibi, q.shape[1])
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
    out, lse = causal_states(
        allq, k, v, allpos, k_positions, scale=scale, backend=backend, window=window, softcap=softcap, alibi=alibi
    )
    if strategy == "auto" and p > 1:  # each rank gets only its own queries' states: an all-to-all
        st = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], -1).unflatten(2, (p, nmax)).movedim(2, 0)
        st = all_to_all(st, group)[:, :, :, :n]  # [p, B, Hq, n, Dv + 1]: rank j's partial states of my queries
        out, lse = st[0, ..., :-1], st[0, ..., -1]  # views into the received buffer: merged in place
        for j in range(1, p):
            merge_into(out, lse, st[j, ..., :-1], st[j, ..., -1])
        out, lse = out.contiguous(), lse.contiguous()  # not views that keep the p-times buffer
    else:
        out, lse = reduce_states(out, lse, group=group, strategy=strategy)
        out, lse = out[:, :, rank * nmax : rank * nmax + n], lse[:, :, rank * nmax : rank * nmax + n]
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
