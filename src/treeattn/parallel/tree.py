"""Tree Attention decoding (seed paper, Algorithm 3): local attention, then one reduction."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import world
from ..comm.scatter import reduce_scatter_heads
from ..comm.strategies import STRATEGIES, auto_model, reduce_states
from ..comm.topology import Topology
from ..ops import attention_state
from ..ops.alibi import Alibi
from ..ops.state import merge_states
from ._common import validate_decode


def new_token_state(
    q: Tensor,
    new_k: Tensor,
    new_v: Tensor,
    new_mask: Tensor | None,
    scale,
    *,
    softcap: float | None = None,
    window: int | None = None,
    alibi: Alibi | None = None,
) -> tuple[Tensor, Tensor]:
    """State of the queries over their own tokens, float32. Default mask: causal, and with
    ``window`` query i sees new token j only if ``0 <= i - j < window`` (on the CPU as per-query
    bounds in the compiled kernel: 35-55 us a call for 2-9 tokens, 77-89 us with a mask).
    ``alibi``: the queries' bias; the new tokens' positions are the queries'."""
    B, Tq = q.shape[0], q.shape[2]
    if alibi is not None:
        qp = alibi.q_pos.reshape(B, -1).expand(B, Tq)
        alibi = Alibi(alibi.slopes, qp, qp)
    if new_mask is None and q.device.type == "cpu":
        lo = None if window is None else (torch.arange(Tq) - (window - 1)).clamp_min(0).expand(B, Tq)
        return attention_state(q, new_k, new_v, scale=scale, causal=True, kv_start=lo, softcap=softcap,
                          backend="decode_cpu", keep_fp32=True, alibi=alibi)  # fmt: skip
    if new_mask is None:
        new_mask = torch.ones(Tq, Tq, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            new_mask = new_mask.triu(1 - window)
    mask = new_mask if new_mask.ndim == 3 else new_mask.unsqueeze(0)
    return attention_state(q, new_k, new_v, scale=scale, mask=mask, softcap=softcap, backend="torch", keep_fp32=True,
                      alibi=alibi)  # fmt: skip


def tree_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    kv_lens: Tensor | None = None,
    new_k: Tensor | None = None,
    new_v: Tensor | None = None,
    new_mask: Tensor | None = None,
    strategy: str = "auto",
    return_lse: bool = False,
    topology: Topology | None = None,
    check: bool = True,
    backend: str = "auto",
    kv_start: Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    profile: Any = None,
    heads: list[int] | None = None,
    alibi: Alibi | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention of ``q`` over a KV cache sharded along the sequence across ``group``.

    Called on every rank of ``group`` (default: the world; without torch.distributed
    initialised it runs on one process). Each rank attends to its own shard, then the
    attention states are merged by one reduction whose message is ``B·Hq·Tq·(Dv+1)``
    floats, independent of the context length.

    Args:
        q: ``[B, Hq, Tq, D]``, identical on every rank.
        k, v: ``[B, Hkv, S_local, D]`` / ``[B, Hkv, S_local, Dv]``, this rank's shard (past
            tokens only; ``S_local`` may differ per rank and may be 0). ``Hq % Hkv == 0``.
        scale: softmax scale, default ``1/sqrt(D)``; same on every rank.
        kv_lens: optional integer ``[B]``: valid prefix of each sequence in the local shard.
        new_k, new_v: optional ``[B, Hkv, Tq, D]`` / ``[B, Hkv, Tq, Dv]``: the query tokens'
            own keys/values, identical on every rank and in no shard; counted once.
        new_mask: bool ``[Tq, Tq]`` or ``[B, Tq, Tq]`` (True = query i may attend new token
            j); default causal. A token tree (SpecInfer) is a tree-shaped mask.
        strategy: one of ``"auto", "allreduce3", "allreduce2", "allgather", "hierarchical"``
            (see :mod:`treeattn.comm.strategies`).
        return_lse: also return the global lse.
        topology: node layout for ``hierarchical``/``auto`` (default: ``LOCAL_WORLD_SIZE``).
        check: validate inputs and agree on metadata across ranks first (one small integer
            all-gather with a host sync). Per-step callers that validated once may pass False.
        backend: local attention backend (see :func:`treeattn.attention_with_lse`).
        kv_start: optional integer ``[B]`` or ``[B, Tq]``: the first local slot each sequence
            (or query) sees — a sliding window on global positions, converted to this
            shard's slots by :meth:`treeattn.cache.ShardedKVCache.window_start`. A rank whose keys
            all lie below it contributes the empty state without running its kernel.
        softcap: attention-logit softcapping ``c * tanh(s / c)`` of the scaled scores
            (Gemma-2), applied inside the local kernel before the lse; same on every rank.
        window: sliding window of the *new tokens'* default causal mask (query i sees new
            token j iff ``0 <= i - j < window``); with ``new_mask`` the mask decides.
        profile: the cost model ``auto`` decides with: a calibrated profile's path (written by
            ``treeattn simulate --calibrate ... --profile-out``), a :class:`treeattn.cost.Cluster`
            or :class:`treeattn.cost.Profile`, or None: the file named by ``$TREEATTN_PROFILE``,
            else the built-in preset of the group's backend (``local``; ``dgx-h100`` on NCCL).
            With ``check`` the ranks agree on the model (a hash of its constants) first.
        heads: ``p + 1`` cut points of the query heads: the states are reduced scattered over
            the heads (one all-to-all, :func:`treeattn.comm.scatter.reduce_scatter_heads`,
            instead of ``strategy``'s reduction) and rank ``j`` returns heads ``[heads[j],
            heads[j + 1])`` only (Helix: each rank then multiplies its heads' columns of the
            output projection). None: every rank returns every head.
        alibi: optional :class:`treeattn.ops.Alibi`: ALiBi biases (BLOOM, MPT) on global
            positions, ``q_pos [B]`` or ``[B, Tq]`` and this shard's ``k_pos [B, S_local]``
            (the new tokens' positions are the queries'; with new tokens and ``Tq`` > 1,
            ``q_pos`` is ``[B, Tq]``); the same slopes on every rank. The local attention then
            runs on the torch path.

    Returns:
        ``out [B, Hq, Tq, Dv]`` in q's dtype, the same on every rank (``[B, h, Tq, Dv]``, this
        rank's heads, with ``heads``); with ``return_lse``
        also ``lse [B, Hq, Tq]`` float32 (float64 for float64 inputs). Rows with no visible key give
        (0, -inf).

    Raises:
        ValueError: on *every* rank, when any rank's input is invalid or ranks disagree on
            B, Hq, Hkv, D, Dv, Tq, dtype, scale, strategy, the presence of new tokens, the
            shape of ``new_mask`` (or its absence), the topology's ranks per node, softcap,
            window, the presence and rank of ``kv_start``, the ALiBi slopes or (``auto``) the cost model; also
            when a rank's profile is absent or malformed (:class:`treeattn.cost.ProfileError`
            names the file and the field).
    """
    if check:
        topo = topology if topology is not None else Topology.from_env()
        rpn = topo.ranks_per_node if topo is not None else 0
        model = None

        def fingerprint() -> int:
            nonlocal model
            model = auto_model(profile, group)[0]
            return model.fingerprint()

        validate_decode(q, k, v, kv_lens, new_k, new_v, new_mask, scale, strategy, group, STRATEGIES, rpn,
                        kv_start, softcap, window, fingerprint if strategy == "auto" else None, heads, alibi)  # fmt: skip
        profile = model if model is not None else profile
    # one rank and no new tokens: the local state is the answer, written in q's dtype by the kernel
    # (no reduction, no cast: the local op's cost; its lse is never +inf, which a reduction reads as empty)
    if strategy not in STRATEGIES:  # (reduce_states says so too; one rank never calls it)
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    alone = world(group)[1] == 1
    out, lse = attention_state(q, k, v, scale=scale, kv_lens=kv_lens, kv_start=kv_start, softcap=softcap,
                          backend=backend, keep_fp32=not alone or new_k is not None, alibi=alibi)  # fmt: skip
    mine = slice(None)  # the heads this rank returns
    if not alone and heads is not None:
        rank = world(group)[0]
        mine = slice(heads[rank], heads[rank + 1])
        out, lse = reduce_scatter_heads(out, lse, heads, group)
    elif not alone:
        out, lse = reduce_states(out, lse, group=group, strategy=strategy, topology=topology, profile=profile)
    if new_k is not None:
        n_out, n_lse = new_token_state(q, new_k, new_v, new_mask, scale, softcap=softcap, window=window, alibi=alibi)
        out, lse = merge_states(out, lse, n_out[:, mine], n_lse[:, mine])
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
