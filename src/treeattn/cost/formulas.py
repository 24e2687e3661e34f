"""Alpha-beta closed forms of the collectives treeattn uses, in seconds.

``n`` is bytes per rank, ``p`` ranks, ``a`` seconds per latency step and ``ib = 1/beta``
seconds per byte (per device, per direction). Every form is linear in ``(a, ib)`` so the
same code evaluates floats and the calibration's linear tracers; ``p <= 1`` costs 0.
The public ``(n_bytes, p, alpha, beta)`` wrappers at the end return floats.
"""

from __future__ import annotations

from typing import Any


def log2c(p: int) -> int:
    """``ceil(log2 p)`` for ``p >= 1``."""
    return (p - 1).bit_length()


def ar_ring(n: float, p: int, a: Any, ib: Any) -> Any:
    """Ring all-reduce (reduce-scatter + all-gather): ``2(p-1)·a + 2(p-1)/p·n·ib``.
    The byte term is the seed paper's eq. 12 (and eq. 14 with ``n`` one state)."""
    return 0.0 if p <= 1 else 2 * (p - 1) * a + (2 * (p - 1) / p * n) * ib


def ar_tree(n: float, p: int, a: Any, ib: Any) -> Any:
    """Pipelined binary-tree all-reduce (reduce up, broadcast down; NCCL's double binary
    tree): ``2·ceil(log2 p)·a + 2·n·ib``."""
    return 0.0 if p <= 1 else 2 * log2c(p) * a + (2 * n) * ib


def ag_ring(n: float, p: int, a: Any, ib: Any) -> Any:
    """Ring all-gather of ``n`` bytes per rank: ``(p-1)·a + (p-1)·n·ib``."""
    return 0.0 if p <= 1 else (p - 1) * a + ((p - 1) * n) * ib


def ag_rd(n: float, p: int, a: Any, ib: Any) -> Any:
    """Recursive-doubling all-gather (Bruck for p not a power of two):
    ``ceil(log2 p)·a + (p-1)·n·ib``."""
    return 0.0 if p <= 1 else log2c(p) * a + ((p - 1) * n) * ib


def a2a(n: float, p: int, a: Any, ib: Any) -> Any:
    """Pairwise all-to-all, ``n`` bytes per rank of which each peer gets ``n / p``:
    ``(p-1)·a + (p-1)/p·n·ib``."""
    return 0.0 if p <= 1 else (p - 1) * a + ((p - 1) / p * n) * ib


def pick(algo: str, ring: Any, other: Any) -> Any:
    """``algo`` ``"ring"``: ``ring``; ``"auto"``: the cheaper (as NCCL's tuner); else ``other``."""
    return ring if algo == "ring" else other if algo != "auto" else min(ring, other)


def ring_pass(p: int, hop: Any, block: Any, first_hop_overlapped: bool = False) -> Any:
    """Ring Attention pass: ``p - 1`` hops of ``T = hop`` seconds overlapped with ``C = block``
    seconds of attention on the block received before (the seed paper's eq. 10 counts the
    bytes: ``2btd`` per hop). treeattn computes its own block first, cannot overlap hop 1
    and computes the last block after the loop: ``C + (p-1)·max(T, C) + min(T, C)``; the
    idealised ``C + (p-1)·max(T, C)`` with ``first_hop_overlapped``. ``p = 1``: ``C``."""
    if p <= 1:
        return block
    tail = 0.0 if first_hop_overlapped else min(hop, block)
    return block + (p - 1) * max(hop, block) + tail


def attention_time(kv_bytes: float, mem_bw: float, efficiency: float, overhead_s: float = 0.0) -> float:
    """Memory-bound decode attention (s): ``overhead_s + kv_bytes / (mem_bw · efficiency)``."""
    return overhead_s + kv_bytes / (mem_bw * efficiency)


def allreduce_ring(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """:func:`ar_ring` in seconds for ``beta`` in B/s."""
    return float(ar_ring(n_bytes, p, alpha, 1.0 / beta))


def allreduce_tree(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """:func:`ar_tree` in seconds for ``beta`` in B/s."""
    return float(ar_tree(n_bytes, p, alpha, 1.0 / beta))


def allgather_ring(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """:func:`ag_ring` in seconds for ``beta`` in B/s."""
    return float(ag_ring(n_bytes, p, alpha, 1.0 / beta))


def allgather_recursive_doubling(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """:func:`ag_rd` in seconds for ``beta`` in B/s."""
    return float(ag_rd(n_bytes, p, alpha, 1.0 / beta))


def hierarchical_allgather(
    n_bytes: float,
    ranks_per_node: int,
    nodes: int,
    intra_alpha: float,
    intra_beta: float,
    inter_alpha: float,
    inter_beta: float,
    algo: str = "ring",
) -> float:
    """treeattn's two-level all-gather of one state per rank (s): an all-gather inside each
    node (intra constants), a merge, then an all-gather of the merged state among the
    ``nodes`` ranks sharing a local index (inter constants): one state per node crosses
    the slow link. ``algo``: ``"ring"`` or ``"rd"``. Per-call overheads not included."""
    ag = ag_ring if algo == "ring" else ag_rd
    return float(
        ag(n_bytes, ranks_per_node, intra_alpha, 1 / intra_beta) + ag(n_bytes, nodes, inter_alpha, 1 / inter_beta)
    )


def ring_p2p_time(
    p: int, shard_bytes: float, block_compute_s: float, alpha: float, beta: float, *, first_hop_overlapped: bool = False
) -> float:
    """:func:`ring_pass` with hops of ``alpha + shard_bytes/beta`` seconds. For a ring
    spanning nodes pass the inter-node constants: the slowest hop gates every step."""
    return float(ring_pass(p, alpha + shard_bytes / beta, block_compute_s, first_hop_overlapped))
