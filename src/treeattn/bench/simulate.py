"""``treeattn simulate``: an analytic alpha-beta cost model of one decode step at cluster scale.

One decoding query attends to a KV cache of ``seq`` tokens sharded along the sequence over
``p`` ranks (``ceil(seq/p)`` tokens on the fullest rank, which gates the step). The model:

- **Attention** is memory-bound at decode: ``attn_alpha + kv_bytes / (device_mem_bw *
  attn_efficiency)`` seconds, ``kv_bytes = batch * kv_heads * ceil(seq/p) * 2 * dim *
  dtype_bytes`` (K and V, ``Dv = D``). Merging ``k`` float32 states reads ``k * state`` bytes
  at the same bandwidth. When more ranks share a node than it has ``compute_slots`` (CPU
  ranks on few cores), compute slows by ``ranks_per_node / compute_slots``.
- **Collectives** follow the alpha-beta forms below, plus ``collective_alpha`` per call
  (launch/synchronisation). ``alpha`` is per latency step, ``beta`` the per-device, per-direction
  bandwidth. Flat collectives on more than one node run entirely at the *inter-node* constants:
  a synchronous ring or tree step lasts as long as its slowest link (an assumption; NCCL's
  hierarchical rings/trees do somewhat better for large messages, decode states are small).
- **Tree strategies** (:mod:`treeattn.comm.strategies`; states are float32 whatever the KV
  dtype): local attention, then ``allreduce3`` (all-reduce lse max, numerator, denominator),
  ``allreduce2`` (max, then packed [numerator | denominator]), ``allgather`` (packed
  [out | lse], merge p states), ``hierarchical`` (all-gather + merge inside each node, then
  all-gather + merge among the ranks with the same local index: the inter-node message is
  one merged state) or ``auto`` (what :func:`treeattn.comm.strategies.choose_strategy` picks).
- **Ring** (:func:`treeattn.parallel.ring_decode`): one small all-gather of shard lengths,
  then ``p - 1`` hops each moving a packed K/V shard to the next rank, overlapped with
  attention over the previous block (:func:`ring_p2p_time`), then a merge of p states.
  When the ring spans several nodes every hop is gated by the inter-node link.
- **local**: attention over this rank's shard only (no communication), the lower bound.

The presets' constants are nominal hardware figures and stated assumptions (see
:data:`PRESETS`); ``local`` is meant to be fitted with :func:`calibrate` from measured rows.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "Cluster",
    "PRESETS",
    "STRATEGIES",
    "Calibration",
    "allreduce_ring",
    "allreduce_tree",
    "allgather_ring",
    "allgather_recursive_doubling",
    "hierarchical_allgather",
    "ring_p2p_time",
    "attention_time",
    "predict",
    "breakdown",
    "calibrate",
    "holdout_report",
    "add_parser",
    "run",
]

#: Predicted methods: the tree strategies, Ring Attention, and local attention only.
STRATEGIES: tuple[str, ...] = ("local", "allreduce3", "allreduce2", "allgather", "hierarchical", "auto", "ring")
TREE_STRATEGIES: tuple[str, ...] = ("allreduce3", "allreduce2", "allgather", "hierarchical")
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
STATE_BYTES = 4  # attention states (out, lse) are reduced in float32 by treeattn


@dataclass(frozen=True)
class Cluster:
    """Hardware constants of the cost model. Times in seconds, bandwidths in bytes/second.

    Attributes:
        name: preset name.
        nodes: nodes available (``p`` may not exceed ``nodes * devices_per_node``).
        devices_per_node: ranks per node; ranks fill nodes in order (torchrun layout).
        intra_alpha: latency per step of a collective inside a node (s).
        intra_beta: per-device, per-direction bandwidth inside a node (B/s).
        inter_alpha: latency per step of a collective across nodes (s).
        inter_beta: per-device NIC bandwidth, per direction (B/s).
        device_mem_bw: device memory bandwidth (B/s).
        attn_efficiency: fraction of ``device_mem_bw`` reached by decode attention.
        collective_alpha: fixed cost of every collective call and p2p hop (launch, sync) (s).
        attn_alpha: fixed cost of one attention call (kernel launch / dispatch) (s).
        p2p_alpha: latency of one intra-node ring hop (s); None: ``collective_alpha + intra_alpha``.
        p2p_beta: intra-node send/recv bandwidth (B/s); None: ``intra_beta``.
        allreduce_algo: ``"ring"``, ``"tree"`` or ``"auto"`` (the cheaper, as NCCL's tuner does).
        allgather_algo: ``"ring"``, ``"rd"`` (recursive doubling) or ``"auto"``.
        compute_slots: ranks per node that can compute at once (0: every rank has its device).
        device_mem: device memory (bytes), for the "fits" column only; None: unchecked.
        notes: where the constants come from and which are assumptions.
    """

    name: str
    nodes: int
    devices_per_node: int
    intra_alpha: float
    intra_beta: float
    inter_alpha: float
    inter_beta: float
    device_mem_bw: float
    attn_efficiency: float
    collective_alpha: float = 0.0
    attn_alpha: float = 0.0
    p2p_alpha: float | None = None
    p2p_beta: float | None = None
    allreduce_algo: str = "auto"
    allgather_algo: str = "ring"
    compute_slots: int = 0
    device_mem: float | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"nodes and devices_per_node must be >= 1, got {self.nodes}, {self.devices_per_node}")
        for f in ("intra_beta", "inter_beta", "device_mem_bw", "attn_efficiency"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)!r}")
        if self.p2p_beta is not None and not self.p2p_beta > 0:
            raise ValueError(f"p2p_beta must be > 0, got {self.p2p_beta!r}")
        if self.allreduce_algo not in ("ring", "tree", "auto"):
            raise ValueError(f"allreduce_algo must be ring/tree/auto, got {self.allreduce_algo!r}")
        if self.allgather_algo not in ("ring", "rd", "auto"):
            raise ValueError(f"allgather_algo must be ring/rd/auto, got {self.allgather_algo!r}")

    def placement(self, p: int) -> tuple[int, int]:
        """``(ranks per node, nodes used)`` for ``p`` ranks filling nodes in order."""
        if p < 1:
            raise ValueError(f"p must be >= 1, got {p}")
        r = min(p, self.devices_per_node)
        n = -(-p // r)
        if n > self.nodes:
            raise ValueError(f"p = {p} needs {n} nodes of {r}; preset {self.name!r} has {self.nodes}")
        return r, n


def _local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


PRESETS: dict[str, Cluster] = {
    "dgx-h100": Cluster(
        name="dgx-h100",
        nodes=128,
        devices_per_node=8,
        intra_alpha=1e-6,
        intra_beta=450e9,
        inter_alpha=5e-6,
        inter_beta=50e9,
        device_mem_bw=3.35e12,
        attn_efficiency=0.7,
        collective_alpha=8e-6,
        attn_alpha=5e-6,
        allreduce_algo="auto",
        allgather_algo="ring",
        device_mem=80e9,
        notes=(
            "Paper's cluster (seed 000, section 6): DGX H100 nodes, 8 GPUs each, NVLink 4 all-to-all "
            "900 GB/s per GPU = 450 GB/s per direction (used as intra_beta), 8 x 400 Gb/s InfiniBand NDR per "
            "node = one 50 GB/s NIC per GPU per direction (inter_beta); HBM3 3.35 TB/s (H100 SXM datasheet). "
            "The paper used 16 nodes; 128 are modelled so p can reach 1024 with the same per-node hardware. "
            "ASSUMPTIONS (not from the paper): 8 us fixed cost per NCCL call or p2p hop, 1 us per NVLink step, "
            "5 us per InfiniBand step (so an NVLink p2p hop costs 9 us, an IB hop 13 us, an 8-GPU small "
            "all-reduce 22 us); attention at 70% of HBM bandwidth plus 5 us per kernel; NCCL-like algorithm "
            "choice: all-reduce = cheaper of ring and tree, all-gather = ring."
        ),
    ),
    "2x4090-pcie": Cluster(
        name="2x4090-pcie",
        nodes=1,
        devices_per_node=2,
        intra_alpha=5e-6,
        intra_beta=25e9,
        inter_alpha=5e-6,
        inter_beta=25e9,
        device_mem_bw=1.008e12,
        attn_efficiency=0.7,
        collective_alpha=10e-6,
        attn_alpha=5e-6,
        allreduce_algo="auto",
        allgather_algo="ring",
        device_mem=24e9,
        notes=(
            "Two RTX 4090 on one host over PCIe 4.0 x16 (32 GB/s nominal, 25 GB/s effective per direction, "
            "ASSUMED); GDDR6X 1008 GB/s (datasheet). ASSUMPTIONS: 10 us per NCCL call or hop plus 5 us per "
            "step (GeForce cards have no peer-to-peer, NCCL goes through host memory), attention at 70% "
            "of memory bandwidth plus 5 us per kernel."
        ),
    ),
    "local": Cluster(
        name="local",
        nodes=1,
        devices_per_node=64,
        intra_alpha=50e-6,
        intra_beta=2.7e9,
        inter_alpha=50e-6,
        inter_beta=2.7e9,
        device_mem_bw=10e9,
        attn_efficiency=0.6,
        collective_alpha=200e-6,
        attn_alpha=50e-6,
        p2p_alpha=300e-6,
        p2p_beta=2.7e9,
        allreduce_algo="ring",
        allgather_algo="ring",
        compute_slots=_local_cores(),
        notes=(
            "This CPU machine: p processes on one host, gloo over loopback TCP (ring all-reduce and "
            "all-gather). DEFAULTS TO BE REPLACED BY CALIBRATION (--calibrate): 200 us per gloo call + 50 us "
            "per step (about 300 us per all-reduce at p = 2), 2.7 GB/s per loopback stream, 300 us per "
            "send/recv hop, 10 GB/s memory bandwidth per rank at 60% efficiency plus 50 us per attention "
            "call; compute_slots = this machine's usable cores."
        ),
    ),
}

#: Default ``--p`` and ``--seq`` lists of each preset.
PRESET_GRID: dict[str, tuple[list[int], list[int]]] = {
    "dgx-h100": (
        [8, 16, 32, 64, 128, 256, 512, 1024],
        [80_000, 320_000, 1_280_000, 5_120_000, 20_480_000, 100_000_000],
    ),
    "2x4090-pcie": ([1, 2], [8_192, 32_768, 131_072, 524_288, 2_097_152]),
    "local": ([1, 2, 4], [16_384, 65_536, 262_144, 1_048_576]),
}

#: The paper's headline (seed 000, section 6.1): Fig. 3 uses "a standard attention block of 16
#: heads of dimension 128", all computation in BF16; batch is not stated (1 assumed), MHA assumed.
PAPER_CASE: dict[str, Any] = {
    "preset": "dgx-h100",
    "p": 128,
    "seq": 5_120_000,
    "batch": 1,
    "heads": 16,
    "kv_heads": 16,
    "head_dim": 128,
    "dtype_bytes": 2,
    "paper_speedup": 8.0,
}


# ---------------------------------------------------------------------------------------------
# Closed forms. ``n`` is bytes per rank, ``alpha`` s per step, ``beta`` B/s; p <= 1 costs 0.
# The ``_``-prefixed twins take ``inv_beta = 1/beta`` so calibration can trace them linearly.


def _log2c(p: int) -> int:
    return (p - 1).bit_length()  # ceil(log2 p) for p >= 1


def _ar_ring(n: float, p: int, a: Any, ib: Any) -> Any:
    return 0.0 if p <= 1 else 2 * (p - 1) * a + (2 * (p - 1) / p * n) * ib


def _ar_tree(n: float, p: int, a: Any, ib: Any) -> Any:
    return 0.0 if p <= 1 else 2 * _log2c(p) * a + (2 * n) * ib


def _ag_ring(n: float, p: int, a: Any, ib: Any) -> Any:
    return 0.0 if p <= 1 else (p - 1) * a + ((p - 1) * n) * ib


def _ag_rd(n: float, p: int, a: Any, ib: Any) -> Any:
    return 0.0 if p <= 1 else _log2c(p) * a + ((p - 1) * n) * ib


def _pick(algo: str, ring: Any, other: Any) -> Any:
    return ring if algo == "ring" else other if algo != "auto" else min(ring, other)


def _ring_p2p(p: int, hop: Any, block: Any, first_hop_overlapped: bool = False) -> Any:
    if p <= 1:
        return block
    if first_hop_overlapped:
        return block + (p - 1) * max(hop, block)
    return block + (p - 1) * max(hop, block) + min(hop, block)


def allreduce_ring(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce (reduce-scatter + all-gather): ``2(p-1)·alpha + 2(p-1)/p · n/beta`` s."""
    return float(_ar_ring(n_bytes, p, alpha, 1.0 / beta))


def allreduce_tree(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Tree all-reduce (reduce up, broadcast down a binary tree; NCCL's double binary tree),
    pipelined so the bandwidth term does not grow with depth: ``2·ceil(log2 p)·alpha + 2·n/beta`` s."""
    return float(_ar_tree(n_bytes, p, alpha, 1.0 / beta))


def allgather_ring(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-gather of ``n_bytes`` per rank: ``(p-1)·alpha + (p-1)·n/beta`` s."""
    return float(_ag_ring(n_bytes, p, alpha, 1.0 / beta))


def allgather_recursive_doubling(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Recursive-doubling (Bruck for non powers of two) all-gather: ``ceil(log2 p)·alpha + (p-1)·n/beta`` s."""
    return float(_ag_rd(n_bytes, p, alpha, 1.0 / beta))


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
    """treeattn's two-level all-gather of one ``n_bytes`` state per rank (s): all-gather inside
    each node (``ranks_per_node`` ranks, intra constants), merge, then all-gather of the merged
    state among the ``nodes`` ranks sharing a local index (inter constants). The second step moves
    one state per node, not ``ranks_per_node`` of them. ``algo``: ``"ring"`` or ``"rd"``.
    Per-call overheads (``collective_alpha``) are not included."""
    ag = _ag_ring if algo == "ring" else _ag_rd
    return float(
        ag(n_bytes, ranks_per_node, intra_alpha, 1 / intra_beta) + ag(n_bytes, nodes, inter_alpha, 1 / inter_beta)
    )


def ring_p2p_time(
    p: int, shard_bytes: float, block_compute_s: float, alpha: float, beta: float, *, first_hop_overlapped: bool = False
) -> float:
    """Ring Attention pass (s): ``p - 1`` hops of ``T = alpha + shard_bytes/beta`` overlapped with
    ``C = block_compute_s`` of attention on the block received before.

    treeattn's :func:`~treeattn.parallel.ring.ring_pass` computes its own block first, cannot
    overlap hop 1 (nothing has arrived) and computes the last block after the loop:
    ``C + T + (p-2)·max(T, C) + C = C + (p-1)·max(T, C) + min(T, C)``. With
    ``first_hop_overlapped`` the idealised ``C + (p-1)·max(T, C)``. ``p = 1``: ``C``.
    For a ring spanning nodes, pass the inter-node constants: the slowest hop gates every step."""
    return float(_ring_p2p(p, alpha + shard_bytes / beta, block_compute_s, first_hop_overlapped))


def attention_time(kv_bytes: float, mem_bw: float, efficiency: float, overhead_s: float = 0.0) -> float:
    """Memory-bound decode attention (s): ``overhead_s + kv_bytes / (mem_bw · efficiency)``."""
    return overhead_s + kv_bytes / (mem_bw * efficiency)


# ---------------------------------------------------------------------------------------------
# The step model, written once over "linear tracers" so calibration sees its exact features.


class _Lin:
    """A number and its coefficients on named model parameters; +, scalar *, comparisons by value."""

    __slots__ = ("v", "c")

    def __init__(self, v: float, c: dict[str, float]) -> None:
        self.v = v
        self.c = c

    def __add__(self, o: Any) -> _Lin:
        if isinstance(o, _Lin):
            c = dict(self.c)
            for k, x in o.c.items():
                c[k] = c.get(k, 0.0) + x
            return _Lin(self.v + o.v, c)
        return _Lin(self.v + o, self.c)

    __radd__ = __add__

    def __mul__(self, k: float) -> _Lin:
        return _Lin(self.v * k, {n: x * k for n, x in self.c.items()})

    __rmul__ = __mul__

    def __lt__(self, o: Any) -> bool:
        return self.v < _val(o)

    def __gt__(self, o: Any) -> bool:
        return self.v > _val(o)

    def __le__(self, o: Any) -> bool:
        return self.v <= _val(o)

    def __ge__(self, o: Any) -> bool:
        return self.v >= _val(o)


def _val(x: Any) -> float:
    return x.v if isinstance(x, _Lin) else float(x)


# linear parameters of the model; calibration fits (a subset of) these
_PARAMS = (
    "collective_alpha",
    "intra_alpha",
    "intra_inv_beta",
    "inter_alpha",
    "inter_inv_beta",
    "p2p_alpha",
    "p2p_inv_beta",
    "attn_alpha",
    "inv_attn_bw",
)
_COMPUTE_PARAMS = ("attn_alpha", "inv_attn_bw")


def _linear_params(c: Cluster) -> dict[str, float | None]:
    return {
        "collective_alpha": c.collective_alpha,
        "intra_alpha": c.intra_alpha,
        "intra_inv_beta": 1.0 / c.intra_beta,
        "inter_alpha": c.inter_alpha,
        "inter_inv_beta": 1.0 / c.inter_beta,
        "p2p_alpha": c.p2p_alpha,
        "p2p_inv_beta": None if c.p2p_beta is None else 1.0 / c.p2p_beta,
        "attn_alpha": c.attn_alpha,
        "inv_attn_bw": 1.0 / (c.device_mem_bw * c.attn_efficiency),
    }


def _traced(c: Cluster) -> dict[str, Any]:
    return {k: None if v is None else _Lin(v, {k: 1.0}) for k, v in _linear_params(c).items()}


def _check_shape(p: int, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> None:
    for name, v in (("p", p), ("seq", seq), ("batch", batch), ("heads", heads), ("kv_heads", kv_heads)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim < 1 or dtype_bytes < 1:
        raise ValueError(f"head_dim and dtype_bytes must be >= 1, got {head_dim}, {dtype_bytes}")


def _model(
    c: Cluster,
    P: dict[str, Any],
    p: int,
    seq: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    strategy: str,
) -> Any:
    """Seconds of one decode step (float or _Lin), with parameters ``P`` in linear form."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    _check_shape(p, seq, batch, heads, kv_heads, head_dim, dtype_bytes)
    r, nodes = c.placement(p)
    multi = nodes > 1
    slow = max(1.0, r / c.compute_slots) if c.compute_slots else 1.0
    kv = batch * kv_heads * -(-seq // p) * 2 * head_dim * dtype_bytes  # fullest rank's K/V bytes
    out_b, lse_b = batch * heads * head_dim * STATE_BYTES, batch * heads * STATE_BYTES
    state = out_b + lse_b
    inv_bw = P["inv_attn_bw"]
    attn = slow * (P["attn_alpha"] + kv * inv_bw)

    def mem(nbytes: float) -> Any:
        return (slow * nbytes) * inv_bw

    if strategy == "local" or p == 1:
        return attn
    ca = P["collective_alpha"]
    a, ib = (P["inter_alpha"], P["inter_inv_beta"]) if multi else (P["intra_alpha"], P["intra_inv_beta"])

    def ar(n: float) -> Any:
        return ca + _pick(c.allreduce_algo, _ar_ring(n, p, a, ib), _ar_tree(n, p, a, ib))

    def ag(n: float, q: int, a_: Any, ib_: Any) -> Any:
        return ca + _pick(c.allgather_algo, _ag_ring(n, q, a_, ib_), _ag_rd(n, q, a_, ib_))

    if strategy == "auto":
        from ..comm.strategies import choose_strategy
        from ..comm.topology import Topology

        strategy = choose_strategy(out_b, lse_b, p, Topology(r))
    if strategy == "allreduce3":
        return attn + ar(lse_b) + ar(out_b) + ar(lse_b) + mem(2 * state)
    if strategy == "allreduce2":
        return attn + ar(lse_b) + ar(state) + mem(2 * state)
    if strategy == "hierarchical" and multi and r > 1:
        if p % r:
            raise ValueError(f"hierarchical needs equal nodes: p = {p} is not a multiple of {r} ranks per node")
        intra = ag(state, r, P["intra_alpha"], P["intra_inv_beta"])
        return attn + intra + ag(state, nodes, a, ib) + mem((r + nodes) * state)
    if strategy in ("allgather", "hierarchical"):  # hierarchical on one node (or one rank per node) = allgather
        return attn + ag(state, p, a, ib) + mem(p * state)
    # ring: shard lengths all-gather, p - 1 overlapped hops, merge of p states
    if multi:
        hop_a, hop_ib = ca + P["inter_alpha"], P["inter_inv_beta"]
    else:
        hop_a = P["p2p_alpha"] if P["p2p_alpha"] is not None else ca + P["intra_alpha"]
        hop_ib = P["p2p_inv_beta"] if P["p2p_inv_beta"] is not None else P["intra_inv_beta"]
    ring = _ring_p2p(p, hop_a + kv * hop_ib, attn)
    return ag((batch + 1) * 8, p, a, ib) + ring + mem(p * state)


def breakdown(
    cluster: Cluster,
    p: int,
    seq: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    strategy: str,
) -> dict[str, float]:
    """Like :func:`predict`, split along the critical path: ``total_s``, ``compute_s`` (attention
    and merges) and ``comm_s`` (everything else), seconds; also ``kv_shard_bytes`` of the fullest rank."""
    t = _model(cluster, _traced(cluster), p, seq, batch, heads, kv_heads, head_dim, dtype_bytes, strategy)
    vals = _linear_params(cluster)
    compute = sum(t.c.get(k, 0.0) * vals[k] for k in _COMPUTE_PARAMS) if isinstance(t, _Lin) else 0.0
    total = _val(t)
    return {
        "total_s": total,
        "compute_s": compute,
        "comm_s": total - compute,
        "kv_shard_bytes": batch * kv_heads * -(-seq // p) * 2 * head_dim * dtype_bytes,
    }


def predict(
    cluster: Cluster,
    p: int,
    seq: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    strategy: str,
) -> float:
    """Predicted seconds of one decode step (one query token per sequence).

    Args:
        cluster: hardware constants (:data:`PRESETS` or a fitted one).
        p: ranks the KV cache is sharded over; seq: total context tokens.
        batch, heads, kv_heads, head_dim: query batch, query heads, K/V heads, head size.
        dtype_bytes: bytes per K/V element (2 for bf16).
        strategy: one of :data:`STRATEGIES` — a tree strategy (local attention on ``S/p`` keys
            plus its reduction), ``"ring"``, or ``"local"`` (attention on ``S/p`` keys only).

    Raises:
        ValueError: unknown strategy, bad shape, ``p`` beyond the cluster, or ``hierarchical``
            with unequal nodes.
    """
    return _val(
        _model(cluster, _linear_params(cluster), p, seq, batch, heads, kv_heads, head_dim, dtype_bytes, strategy)
    )


# ---------------------------------------------------------------------------------------------
# Calibration from measured rows (``treeattn bench latency`` results).


class _Row(NamedTuple):
    strategy: str
    p: int
    seq: int
    batch: int
    heads: int
    kv_heads: int
    dim: int
    dtype_bytes: int
    seconds: float
    method: str

    def model(self, c: Cluster, P: dict[str, Any]) -> Any:
        return _model(
            c, P, self.p, self.seq, self.batch, self.heads, self.kv_heads, self.dim, self.dtype_bytes, self.strategy
        )


def _parse_row(row: Any) -> _Row | None:
    """A bench row, or None when it is unusable (unknown method, missing/invalid fields)."""
    try:
        method = str(row["method"]).strip()
        if method in ("ring", "local"):
            strategy = method
        elif method == "single device":  # full context on rank 0 alone: local attention at p = 1
            strategy = "local"
        elif method == "tree":
            strategy = "auto"
        elif method.startswith("tree "):
            strategy = method[5:].strip()
        else:
            return None
        if strategy not in STRATEGIES:
            return None
        heads = int(row["heads"])
        parsed = _Row(
            strategy,
            1 if method == "single device" else int(row["p"]),
            int(row["seq"]),
            int(row.get("batch", 1)),
            heads,
            int(row.get("kv_heads") or heads),
            int(row["dim"]),
            DTYPE_BYTES[str(row.get("dtype", "float32"))],
            float(row["median_s"]),
            method,
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not (parsed.seconds > 0 and math.isfinite(parsed.seconds)) or min(parsed[1:8]) < 1:
        return None
    if parsed.heads % parsed.kv_heads:
        return None
    return parsed


def _parse_rows(rows: Iterable[Any]) -> tuple[list[_Row], int]:
    out, skipped = [], 0
    for r in rows:
        x = _parse_row(r)
        if x is None:
            skipped += 1
        else:
            out.append(x)
    return out, skipped


def _with_params(base: Cluster, th: dict[str, float | None]) -> Cluster:
    return replace(
        base,
        collective_alpha=th["collective_alpha"],
        intra_alpha=th["intra_alpha"],
        intra_beta=1.0 / th["intra_inv_beta"],
        inter_alpha=th["inter_alpha"],
        inter_beta=1.0 / th["inter_inv_beta"],
        p2p_alpha=th["p2p_alpha"],
        p2p_beta=None if th["p2p_inv_beta"] is None else 1.0 / th["p2p_inv_beta"],
        attn_alpha=th["attn_alpha"],
        attn_efficiency=1.0 / (th["inv_attn_bw"] * base.device_mem_bw),
    )


def _natural(th: dict[str, float | None], names: Iterable[str]) -> dict[str, float]:
    """Fitted linear parameters in the units of :class:`Cluster` (s, B/s)."""
    rename = {
        "intra_inv_beta": "intra_beta",
        "inter_inv_beta": "inter_beta",
        "p2p_inv_beta": "p2p_beta",
        "inv_attn_bw": "attn_bw",
    }
    return {rename.get(k, k): (1.0 / th[k] if k in rename else th[k]) for k in names if th[k] is not None}


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`.

    Attributes:
        cluster: the base cluster with the fitted constants.
        fitted: fitted constants in natural units (s; B/s; ``attn_bw`` = mem_bw x efficiency).
        fixed: constants left at the base value: no row constrains them, or a bandwidth fitted <= 0.
            (A latency fitted <= 0 is reported in ``fitted`` as 0.)
        n_rows, skipped: usable and unusable input rows.
        rms_rel_err, median_rel_err: relative error of the fit on its own rows.
        iterations: refits until the overlap/algorithm branches stopped changing (or the cap, keeping
            the iterate with the least error).
    """

    cluster: Cluster
    fitted: dict[str, float]
    fixed: tuple[str, ...]
    n_rows: int
    skipped: int
    rms_rel_err: float
    median_rel_err: float
    iterations: int


# order in which parameters enter the fit when rows cannot separate all of them
_FIT_ORDER = (
    "inv_attn_bw",
    "collective_alpha",
    "intra_alpha",
    "intra_inv_beta",
    "p2p_inv_beta",
    "p2p_alpha",
    "attn_alpha",
    "inter_alpha",
    "inter_inv_beta",
)


def _independent(M: torch.Tensor, cols: Sequence[int], tol: float = 1e-7) -> list[int]:
    """Greedily keep the columns of ``M`` (in the given order) that add to its rank."""
    keep: list[int] = []
    for j in cols:
        if not bool(M[:, j].abs().max() > 0):
            continue
        trial = [*keep, j]
        N = M[:, trial] / M[:, trial].norm(dim=0)
        sv = torch.linalg.svdvals(N)
        if sv[-1] > tol * sv[0]:
            keep = trial
    return keep


def _calibrate(rows: list[_Row], skipped: int, base: Cluster, max_iter: int = 50) -> Calibration:
    if not rows:
        raise ValueError("no usable rows to calibrate from (need method, p, seq, heads, dim, median_s)")
    y = torch.tensor([r.seconds for r in rows], dtype=torch.float64)
    w = 1.0 / y  # minimise relative error: times span orders of magnitude
    base_th = _linear_params(base)
    names = [k for k in _FIT_ORDER if base_th[k] is not None]
    cur = base
    fixed: list[str] = []
    best: tuple[float, Cluster, torch.Tensor, list[str]] | None = None
    it = 0
    for it in range(1, max_iter + 1):  # noqa: B007 - reported
        th = _linear_params(cur)
        P = _traced(cur)
        A = torch.zeros(len(rows), len(names), dtype=torch.float64)
        off = torch.zeros(len(rows), dtype=torch.float64)
        for i, r in enumerate(rows):
            t = r.model(cur, P)
            coef = t.c if isinstance(t, _Lin) else {}
            A[i] = torch.tensor([coef.get(k, 0.0) for k in names], dtype=torch.float64)
            off[i] = _val(t) - sum(coef.get(k, 0.0) * th[k] for k in names)
        Aw = A * w[:, None]
        free = _independent(Aw, range(len(names)))
        hold = {j: base_th[names[j]] for j in range(len(names)) if j not in free}
        zeroed: set[int] = set()
        while True:
            rhs = y - off - sum((A[:, j] * v for j, v in hold.items()), torch.zeros_like(y))
            x = torch.zeros(len(free), dtype=torch.float64)
            if free:
                M = Aw[:, free]
                s = M.norm(dim=0)
                x = torch.linalg.lstsq(M / s, (rhs * w)[:, None], driver="gelsd").solution[:, 0] / s
            bad = [free[i] for i in range(len(free)) if not x[i] > 0]
            if not bad:
                break
            # non-physical: a latency goes to 0 (the non-negative optimum), a bandwidth keeps its base value
            for j in bad:
                zero = names[j].endswith("alpha")
                hold[j] = 0.0 if zero else base_th[names[j]]
                zeroed |= {j} if zero else set()
            free = [j for j in free if j not in bad]
        new = dict(base_th)
        for i, j in enumerate(free):
            new[names[j]] = float(x[i])
        for j, v in hold.items():
            new[names[j]] = v
        fixed = [names[j] for j in range(len(names)) if j not in free and j not in zeroed]
        done = all(
            (new[k] is None and th[k] is None) or abs(new[k] - th[k]) <= 1e-9 * abs(th[k]) + 1e-30 for k in names
        )
        cur = _with_params(base, new)
        pred = torch.tensor([predict(cur, *r[1:8], r.strategy) for r in rows], dtype=torch.float64)
        rel = (pred - y) / y
        err = float(rel.pow(2).mean())
        if best is None or err < best[0]:
            best = (err, cur, rel, fixed)
        if done:
            break
    _, cur, rel, fixed = best  # branches may cycle on noisy rows: keep the best iterate
    final = _linear_params(cur)
    return Calibration(
        cluster=cur,
        fitted=_natural(final, [k for k in names if k not in fixed]),
        fixed=tuple(fixed),
        n_rows=len(rows),
        skipped=skipped,
        rms_rel_err=float(rel.pow(2).mean().sqrt()),
        median_rel_err=float(rel.abs().median()),
        iterations=it,
    )


def calibrate(rows: Iterable[dict[str, Any]], base: Cluster | None = None) -> Calibration:
    """Fit the constants of ``base`` (default the ``local`` preset) to measured decode steps by
    least squares on the relative error.

    The model is linear in ``collective_alpha``, ``intra_alpha``, ``1/intra_beta``, ``p2p_alpha``,
    ``1/p2p_beta``, ``attn_alpha`` and ``1/(device_mem_bw·attn_efficiency)`` (plus the inter-node
    pair on multi-node rows) once the ring's overlap branch (``max(T, C)``) and the all-reduce
    algorithm are fixed, so it alternates: choose branches with the current constants, solve, repeat
    until they stop changing. Constants no row constrains (missing methods), or that the rows cannot
    separate from already fitted ones, keep the base value. A latency fitted <= 0 is set to 0 and an
    inverse bandwidth fitted <= 0 keeps the base value, then the rest is refitted (an active-set
    non-negative least squares). ``device_mem_bw`` is kept; ``attn_efficiency`` absorbs the fitted
    bandwidth. Times are weighted by 1/measured, so the fit minimises relative error.

    Args:
        rows: dicts as written by ``treeattn bench latency``: ``method`` (``"tree <strategy>"``,
            ``"ring"``, ``"local"``, or ``"single device"`` read as local at p = 1), ``p``, ``seq``,
            ``batch``, ``heads``, ``kv_heads``, ``dim``, ``dtype``, ``median_s`` (s). Unusable rows
            (other methods, missing or invalid fields) are skipped and counted.
        base: cluster whose topology and defaults are used.

    Raises:
        ValueError: no usable row.
    """
    parsed, skipped = _parse_rows(rows)
    return _calibrate(parsed, skipped, base or PRESETS["local"])


def holdout_report(
    rows: Iterable[dict[str, Any]], fit_fraction: float = 0.5, base: Cluster | None = None, seed: int = 0
) -> dict[str, Any]:
    """Fit on a random ``fit_fraction`` of the rows of each method (at least one per method, seeded)
    and predict the others.

    Returns:
        ``{"fit": Calibration, "n_fit", "n_holdout", "skipped", "points": [{method, p, seq, batch,
        heads, kv_heads, dim, measured_s, predicted_s, rel_err}], "median_abs_rel_err"}``
        (``rel_err = predicted/measured - 1``; the median is NaN when nothing was held back).
    """
    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    parsed, skipped = _parse_rows(rows)
    by_method: dict[str, list[_Row]] = {}
    for r in parsed:
        by_method.setdefault(r.method, []).append(r)
    rng = random.Random(seed)
    fit, held = [], []
    for m in sorted(by_method):
        rs = by_method[m]
        idx = list(range(len(rs)))
        rng.shuffle(idx)
        k = max(1, math.ceil(fit_fraction * len(rs) - 1e-9))
        fit += [rs[i] for i in idx[:k]]
        held += [rs[i] for i in idx[k:]]
    cal = _calibrate(fit, skipped, base or PRESETS["local"])
    points = []
    for r in sorted(held, key=lambda r: (r.method, r.p, r.seq, r.batch, r.heads)):
        pred = predict(cal.cluster, *r[1:8], r.strategy)
        points.append(
            {
                "method": r.method,
                "p": r.p,
                "seq": r.seq,
                "batch": r.batch,
                "heads": r.heads,
                "kv_heads": r.kv_heads,
                "dim": r.dim,
                "measured_s": r.seconds,
                "predicted_s": pred,
                "rel_err": pred / r.seconds - 1.0,
            }
        )
    med = statistics.median(abs(x["rel_err"]) for x in points) if points else float("nan")
    return {
        "fit": cal,
        "n_fit": len(fit),
        "n_holdout": len(held),
        "skipped": skipped,
        "points": points,
        "median_abs_rel_err": med,
    }


# ---------------------------------------------------------------------------------------------
# Command line.


def _tokens(s: str) -> int:
    """A token count: ``131072``, ``80k``, ``5.12M``, ``1G`` (decimal suffixes)."""
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}
    t = s.strip().replace("_", "")
    f = mult.get(t[-1:].lower(), 1)
    try:
        v = float(t[:-1] if f != 1 else t) * f
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r}") from None
    if v < 1 or v != v:
        raise argparse.ArgumentTypeError(f"token count must be >= 1, got {s!r}")
    return int(round(v))


def _positive(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s!r}")
    return v


def add_parser(sub: Any) -> None:
    """Add the ``simulate`` sub-command to an argparse subparsers object; its handler is :func:`run`."""
    g = sub.add_parser(
        "simulate",
        help="analytic alpha-beta model of decode latency: Tree strategies vs Ring at cluster scale",
        description=(
            "Predict one decode step of every Tree strategy and of Ring Attention from an alpha-beta model "
            "of the cluster. Prints a markdown table and the paper's headline case (dgx-h100, 128 GPUs, "
            "5.12M tokens); --out writes CSV, JSON with provenance and plots; --calibrate fits the local "
            "preset to `treeattn bench latency` results."
        ),
    )
    g.add_argument("--preset", choices=list(PRESETS), default="dgx-h100")
    g.add_argument("--p", type=_positive, nargs="+", default=None, help="ranks (default: the preset's grid)")
    g.add_argument(
        "--seq", type=_tokens, nargs="+", default=None, help="total context tokens, e.g. 80k 5.12M 100M (default: grid)"
    )
    g.add_argument("--heads", type=_positive, default=16, help="query heads (default 16, the paper's Fig. 3)")
    g.add_argument("--kv-heads", type=_positive, default=None, help="K/V heads (default: --heads)")
    g.add_argument("--dim", type=_positive, default=128, help="head dimension (default 128)")
    g.add_argument("--batch", type=_positive, default=1)
    g.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="K/V dtype (default bf16; local: fp32)",
    )
    g.add_argument("--calibrate", metavar="RESULTS.json", default=None, help="fit the local preset to bench rows")
    g.add_argument("--fit-fraction", type=float, default=0.5, help="share of rows fitted in the holdout check")
    g.add_argument("--out", metavar="DIR", default=None, help="write simulate.csv, simulate.json and PNG plots")
    g.set_defaults(func=run)


def _md(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.4g}"


def _fmt_si(v: float, unit: str) -> str:
    for f, pre in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n")):
        if abs(v) >= f:
            return f"{v / f:.4g} {pre}{unit}"
    return f"{v:.3g} {unit}"


def _const(k: str, v: Any) -> str:
    if isinstance(v, float) and (k.endswith("alpha") or k.endswith(("beta", "bw")) or k == "device_mem"):
        return _fmt_si(v, "s" if k.endswith("alpha") else "B" if k == "device_mem" else "B/s")
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _ratio(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _describe_fit(fitted: dict[str, float]) -> str:
    return ", ".join(f"{k} = {_fmt_si(v, 'B/s' if k.endswith(('beta', 'bw')) else 's')}" for k, v in fitted.items())


def _headline() -> dict[str, Any]:
    c = PRESETS[PAPER_CASE["preset"]]
    shape = (
        PAPER_CASE["p"],
        PAPER_CASE["seq"],
        PAPER_CASE["batch"],
        PAPER_CASE["heads"],
        PAPER_CASE["kv_heads"],
        PAPER_CASE["head_dim"],
        PAPER_CASE["dtype_bytes"],
    )
    t = {s: predict(c, *shape, s) for s in ("ring", *TREE_STRATEGIES)}
    best = min(TREE_STRATEGIES, key=t.__getitem__)
    k = PAPER_CASE["paper_speedup"]
    return {
        **PAPER_CASE,
        "ring_s": t["ring"],
        "allreduce3_s": t["allreduce3"],
        "best_tree": best,
        "best_tree_s": t[best],
        "speedup_vs_allreduce3": t["ring"] / t["allreduce3"],
        "speedup_vs_best_tree": t["ring"] / t[best],
        # a per-step cost X outside the model that both methods pay would give (ring+X)/(tree+X) = paper's 8x
        "overhead_for_paper_speedup_s": max(0.0, (t["ring"] - k * t["allreduce3"]) / (k - 1)),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _plots(
    out: Path, cluster: Cluster, records: list[dict[str, Any]], ps: list[int], seqs: list[int], title: str
) -> list[str]:
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    def series(strategy: str, key: str, fixed_key: str, fixed: int) -> tuple[list[int], list[float]]:
        pts = [(r[key], r["seconds"]) for r in records if r["strategy"] == strategy and r[fixed_key] == fixed]
        return [x for x, _ in pts], [v for _, v in pts]

    styles = {"ring": "k-o", "allreduce3": "C0-s", "allreduce2": "C1-^", "allgather": "C2-v", "hierarchical": "C3-D"}
    styles["local"] = "C7--"
    files = []
    for fname, key, fixed_key, fixed, xlabel in (
        ("latency_vs_p.png", "p", "seq", max(seqs), "ranks p"),
        ("latency_vs_seq.png", "seq", "p", max(ps), "context length (tokens)"),
    ):
        fig = Figure(figsize=(6.4, 4.4))
        ax = fig.add_subplot()
        for s, st in styles.items():
            x, v = series(s, key, fixed_key, fixed)
            if x:
                ax.plot(x, [t * 1e3 for t in v], st, label=s, markersize=4)
        ax.set_xscale("log", base=2 if key == "p" else 10)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("predicted decode step (ms)")
        ax.set_title(f"{cluster.name}: {fixed_key} = {fixed:,}\n{title}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        files.append(fname)
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot()
    by = {(r["strategy"], r["p"], r["seq"]): r["seconds"] for r in records}
    for i, s in enumerate(seqs):
        x = [p for p in ps if (("ring", p, s) in by and ("allreduce3", p, s) in by)]
        if x:
            ax.plot(x, [by["ring", p, s] / by["allreduce3", p, s] for p in x], "-o", color=f"C{i % 10}", label=f"{s:,}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks p")
    ax.set_ylabel("Ring / Tree (allreduce3) predicted time")
    ax.set_title(f"{cluster.name}: predicted speedup of Tree over Ring\n{title}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="context tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_p.png", dpi=110)
    files.append("speedup_vs_p.png")
    return files


def run(args: argparse.Namespace) -> int:
    """Handler of ``treeattn simulate``; returns the exit status."""
    cluster = PRESETS[args.preset]
    calib_json = None
    if args.calibrate:
        try:
            data = json.loads(Path(args.calibrate).read_text())
            rows = data["rows"] if isinstance(data, dict) else data
            rep = holdout_report(rows, args.fit_fraction)
            cal = calibrate(rows)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"treeattn simulate: cannot calibrate from {args.calibrate}: {e}", file=sys.stderr)
            return 2
        print(f"## Calibration of `local` from {args.calibrate}\n")
        print(
            f"Holdout: fitted {rep['n_fit']} rows (fraction {args.fit_fraction} per method), "
            f"predicted {rep['n_holdout']} held-back rows; {rep['skipped']} unusable rows skipped.\n"
        )
        if rep["points"]:
            print(
                _md(
                    ["method", "p", "seq", "batch", "heads", "kv_heads", "dim", "measured ms", "predicted ms", "error"],
                    [
                        [x["method"], x["p"], x["seq"], x["batch"], x["heads"], x["kv_heads"], x["dim"]]
                        + [_ms(x["measured_s"]), _ms(x["predicted_s"]), f"{x['rel_err']:+.1%}"]
                        for x in rep["points"]
                    ],
                )
            )
            print(f"\nmedian |error| on held-back rows: {rep['median_abs_rel_err']:.1%}\n")
        print(
            f"Fit on all {cal.n_rows} rows: {_describe_fit(cal.fitted)}; kept at default: "
            f"{', '.join(cal.fixed) or 'none'}; median |error| on its own rows {cal.median_rel_err:.1%}.\n"
        )
        calib_json = {
            "file": str(args.calibrate),
            "fit_fraction": args.fit_fraction,
            "holdout_points": rep["points"],
            "holdout_median_abs_rel_err": rep["median_abs_rel_err"],
            "fitted": cal.fitted,
            "fixed": list(cal.fixed),
            "n_rows": cal.n_rows,
            "skipped": cal.skipped,
            "fit_median_abs_rel_err": cal.median_rel_err,
            "cluster": asdict(cal.cluster),
        }
        if args.preset == "local":
            cluster = cal.cluster
    grid_p, grid_s = PRESET_GRID[args.preset]
    ps = sorted(set(args.p or grid_p))
    seqs = sorted(set(args.seq or grid_s))
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        print(f"treeattn simulate: --heads {args.heads} is not a multiple of --kv-heads {kv_heads}", file=sys.stderr)
        return 2
    dtype = args.dtype or ("float32" if args.preset == "local" else "bfloat16")
    dtype_bytes = DTYPE_BYTES[dtype]
    shape = {"batch": args.batch, "heads": args.heads, "kv_heads": kv_heads, "head_dim": args.dim, "dtype": dtype}
    for p in ps:
        try:
            cluster.placement(p)
        except ValueError as e:
            print(f"treeattn simulate: {e}", file=sys.stderr)
            return 2
    records: list[dict[str, Any]] = []
    table = []
    for p in ps:
        for s in seqs:
            t: dict[str, float | None] = {}
            ring_fits = None
            for strat in STRATEGIES:
                try:
                    b = breakdown(cluster, p, s, args.batch, args.heads, kv_heads, args.dim, dtype_bytes, strat)
                except ValueError:  # hierarchical with unequal nodes
                    t[strat] = None
                    continue
                t[strat] = b["total_s"]
                copies = 2 if strat == "ring" and p > 1 else 1  # Ring holds the incoming block too (paper eq. 8)
                fits = None if cluster.device_mem is None else copies * b["kv_shard_bytes"] <= cluster.device_mem
                ring_fits = fits if strat == "ring" else ring_fits
                records.append(
                    {"preset": cluster.name, "p": p, "seq": s, **shape, "strategy": strat, "seconds": b["total_s"]}
                    | {"compute_s": b["compute_s"], "comm_s": b["comm_s"], "kv_shard_bytes": b["kv_shard_bytes"]}
                    | {"fits_memory": fits}
                )
            trees = {k: v for k, v in t.items() if k in TREE_STRATEGIES and v is not None}
            best = min(trees, key=trees.__getitem__)
            table.append(
                [p, f"{s:,}" + (" †" if ring_fits is False else "")]
                + [_ms(t[k]) for k in STRATEGIES]
                + [_ratio(t["ring"] / t["allreduce3"]), best, _ratio(t["ring"] / trees[best])]
            )
    consts = ", ".join(f"{k} = {_const(k, v)}" for k, v in asdict(cluster).items() if k not in ("notes", "name"))
    print(f"## treeattn simulate: {cluster.name}\n")
    print(f"Constants: {consts}\n")
    print(f"{cluster.notes}\n")
    print(
        f"Shape: batch {args.batch}, {args.heads} query heads / {kv_heads} K/V heads x {args.dim}, K/V {dtype}; "
        "states reduced in float32. Times in ms per decode step.\n"
    )
    print(
        _md(
            ["p", "seq", *STRATEGIES, "ring/allreduce3", "best tree", "ring/best"],
            table,
        )
    )
    if any(r["fits_memory"] is False for r in records):
        print(f"\n† Ring's two K/V blocks per device exceed {cluster.device_mem / 1e9:g} GB of device memory.")
    h = _headline()
    print(
        f"\nPaper headline case (dgx-h100, p = {h['p']} = 16 nodes x 8, {h['seq']:,} tokens, {h['heads']} heads x "
        f"{h['head_dim']} (Fig. 3), batch {h['batch']}, bf16 K/V): Ring {_ms(h['ring_s'])} ms, Tree allreduce3 "
        f"{_ms(h['allreduce3_s'])} ms -> predicted speedup {_ratio(h['speedup_vs_allreduce3'])}x "
        f"({_ratio(h['speedup_vs_best_tree'])}x vs {h['best_tree']}); the paper measured ~{h['paper_speedup']:g}x. "
        f"A {_ms(h['overhead_for_paper_speedup_s'])} ms per-step cost outside this model, paid by both, "
        "would reconcile the two."
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        fields = list(records[0]) if records else []
        with open(out / "simulate.csv", "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=fields)
            wr.writeheader()
            wr.writerows(records)
        title = f"batch {args.batch}, {args.heads}/{kv_heads} heads x {args.dim}, {dtype}"
        pngs = _plots(out, cluster, records, ps, seqs, title)
        import treeattn

        provenance = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.argv),
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "treeattn_version": getattr(treeattn, "__version__", None),
            "git_commit": _git_commit(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "host": platform.platform(),
        }
        doc = {
            "provenance": provenance,
            "preset": args.preset,
            "cluster": asdict(cluster),
            "calibrated": calib_json is not None and args.preset == "local",
            "shape": shape,
            "p": ps,
            "seq": seqs,
            "model": __doc__,
            "rows": records,
            "headline": h,
            "calibration": calib_json,
            "files": ["simulate.csv", *pngs],
        }
        (out / "simulate.json").write_text(json.dumps(doc, indent=1, default=str))
        print(f"\nwrote {out / 'simulate.csv'}, {out / 'simulate.json'}, " + ", ".join(str(out / x) for x in pngs))
    return 0
