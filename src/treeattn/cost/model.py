"""The cost model of one decode step: a two-level cluster and the time of every strategy.

One decoding query attends to ``seq`` tokens sharded over ``p`` ranks (``ceil(seq/p)`` on
the fullest rank, which gates the step):

- **Attention** is memory-bound: ``attn_alpha + kv_bytes / (device_mem_bw · attn_efficiency)``
  with ``kv_bytes = batch · kv_heads · ceil(seq/p) · 2 · dim · dtype_bytes``. Merging ``k``
  float32 states reads ``k · state`` bytes at the same bandwidth. More ranks on a node than
  ``compute_slots`` (CPU ranks on few cores) slow compute by ``ranks_per_node / compute_slots``.
- **Collectives** follow :mod:`treeattn.cost.formulas`, plus ``collective_alpha`` per call.
  Flat collectives on more than one node run at the inter-node constants (a synchronous step
  lasts as long as its slowest link).
- **Tree strategies** (states float32): ``allreduce3`` (all-reduce lse max, numerator,
  denominator), ``allreduce2`` (max, then packed numerator|denominator), ``allgather``
  (packed out|lse, merge p states), ``hierarchical`` (all-gather + merge in each node, then
  among the ranks with the same local index) and ``auto`` (the cheapest by :func:`choose`
  with the same cluster).
- **Ring**: an all-gather of shard lengths, ``p - 1`` K/V hops overlapped with attention
  (:func:`~treeattn.cost.formulas.ring_pass`), a merge of p states.
- **local**: attention over the own shard only, the lower bound.

The model is written once over numbers that may be linear tracers (:class:`Lin`), so the
calibration sees exactly the features the predictions use.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from ..dtypes import BYTES
from . import formulas as F

#: What :func:`predict` times: the local step alone, each Tree reduction, ``auto`` and Ring (the
#: reductions alone are :data:`TREE_STRATEGIES`; the API's choices are ``treeattn.config.STRATEGIES``).
PREDICTED: tuple[str, ...] = ("local", "allreduce3", "allreduce2", "allgather", "hierarchical", "auto", "ring")
TREE_STRATEGIES: tuple[str, ...] = ("allreduce3", "allreduce2", "allgather", "hierarchical")
#: ``auto``'s tie-break: fewest collectives first.
PREFERENCE: tuple[str, ...] = ("allgather", "hierarchical", "allreduce2", "allreduce3")
DTYPE_BYTES: dict[str, int] = BYTES  # (treeattn.dtypes: the one table)
STATE_BYTES = 4  # attention states (out, lse) are reduced in float32


@dataclass(frozen=True)
class Cluster:
    """Hardware constants of the cost model. Times in seconds, bandwidths in bytes/second.

    Attributes:
        name: preset or profile name.
        nodes: nodes available (``p`` may not exceed ``nodes * devices_per_node`` in predictions).
        devices_per_node: ranks per node; ranks fill nodes in order (torchrun layout).
        intra_alpha, intra_beta: latency per collective step / per-device bandwidth inside a node.
        inter_alpha, inter_beta: the same across nodes (NIC bandwidth per device).
        device_mem_bw: device memory bandwidth; attn_efficiency: the fraction decode attention reaches.
        collective_alpha: fixed cost of every collective call and p2p hop (launch, sync).
        attn_alpha: fixed cost of one attention call.
        p2p_alpha, p2p_beta: one intra-node ring hop; None: ``collective_alpha + intra_alpha`` / ``intra_beta``.
        allreduce_algo: ``"ring"``, ``"tree"`` or ``"auto"`` (the cheaper, as NCCL's tuner).
        allgather_algo: ``"ring"``, ``"rd"`` (recursive doubling) or ``"auto"``.
        compute_slots: ranks per node that can compute at once (0: every rank has its device).
        device_mem: device memory (bytes) for the "fits" column only; None: unchecked.
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

    def fingerprint(self) -> int:
        """A 63-bit hash of every constant that changes a prediction (not ``name``/``notes``),
        so ranks can agree on the model with one integer."""
        return _fingerprint(self)


@functools.lru_cache(maxsize=16)
def _fingerprint(c: Cluster) -> int:
    d = {k: v for k, v in asdict(c).items() if k not in ("name", "notes")}
    return int.from_bytes(hashlib.sha256(json.dumps(d, sort_keys=True).encode()).digest()[:8], "big") >> 1


class Lin:
    """A number and its coefficients on named model parameters; +, scalar *, comparisons by value."""

    __slots__ = ("v", "c")

    def __init__(self, v: float, c: dict[str, float]) -> None:
        self.v = v
        self.c = c

    def __add__(self, o: Any) -> Lin:
        if isinstance(o, Lin):
            c = dict(self.c)
            for k, x in o.c.items():
                c[k] = c.get(k, 0.0) + x
            return Lin(self.v + o.v, c)
        return Lin(self.v + o, self.c)

    __radd__ = __add__

    def __mul__(self, k: float) -> Lin:
        return Lin(self.v * k, {n: x * k for n, x in self.c.items()})

    __rmul__ = __mul__

    def __lt__(self, o: Any) -> bool:
        return self.v < value(o)

    def __gt__(self, o: Any) -> bool:
        return self.v > value(o)

    def __le__(self, o: Any) -> bool:
        return self.v <= value(o)

    def __ge__(self, o: Any) -> bool:
        return self.v >= value(o)


def value(x: Any) -> float:
    return x.v if isinstance(x, Lin) else float(x)


#: The model's linear parameters; calibration fits (a subset of) them.
PARAMS = (
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
COMPUTE_PARAMS = ("attn_alpha", "inv_attn_bw")


def linear_params(c: Cluster) -> dict[str, float | None]:
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


def traced(c: Cluster) -> dict[str, Any]:
    return {k: None if v is None else Lin(v, {k: 1.0}) for k, v in linear_params(c).items()}


def _slow(c: Cluster, r: int) -> float:
    return max(1.0, r / c.compute_slots) if c.compute_slots else 1.0


def _allgather(c: Cluster, ca: Any, n: float, q: int, a: Any, ib: Any) -> Any:
    return ca + F.pick(c.allgather_algo, F.ag_ring(n, q, a, ib), F.ag_rd(n, q, a, ib))


def reduction_time(c: Cluster, P: dict[str, Any], p: int, r: int, out_b: float, lse_b: float, strategy: str) -> Any:
    """Seconds of reducing one state (``out_b + lse_b`` bytes per rank) over ``p`` ranks,
    ``r`` per node, with a tree ``strategy``: its collectives plus its merges.

    Raises:
        ValueError: ``hierarchical`` on unequal nodes (``p % r``).
    """
    if p <= 1:
        return 0.0
    nodes = -(-p // r)
    multi = nodes > 1
    state = out_b + lse_b
    slow = _slow(c, r)
    ca = P["collective_alpha"]
    a, ib = (P["inter_alpha"], P["inter_inv_beta"]) if multi else (P["intra_alpha"], P["intra_inv_beta"])

    def mem(nbytes: float) -> Any:
        return (slow * nbytes) * P["inv_attn_bw"]

    def ar(n: float) -> Any:
        return ca + F.pick(c.allreduce_algo, F.ar_ring(n, p, a, ib), F.ar_tree(n, p, a, ib))

    def ag(n: float, q: int, a_: Any, ib_: Any) -> Any:
        return _allgather(c, ca, n, q, a_, ib_)

    if strategy == "allreduce3":
        return ar(lse_b) + ar(out_b) + ar(lse_b) + mem(2 * state)
    if strategy == "allreduce2":
        return ar(lse_b) + ar(state) + mem(2 * state)
    if strategy == "hierarchical" and multi and r > 1:
        if p % r:
            raise ValueError(f"hierarchical needs equal nodes: p = {p} is not a multiple of {r} ranks per node")
        intra = ag(state, r, P["intra_alpha"], P["intra_inv_beta"])
        return intra + ag(state, nodes, a, ib) + mem((r + nodes) * state)
    if strategy in ("allgather", "hierarchical"):  # hierarchical on one node / one rank per node = allgather
        return ag(state, p, a, ib) + mem(p * state)
    raise ValueError(f"not a tree strategy: {strategy!r}")


def reduction_costs(c: Cluster, out_b: float, lse_b: float, p: int, r: int | None = None) -> dict[str, float]:
    """Modelled seconds of every tree strategy (``hierarchical`` is ``inf`` on unequal nodes)."""
    r = p if r is None else r
    P = linear_params(c)
    costs = {}
    for s in TREE_STRATEGIES:
        try:
            costs[s] = value(reduction_time(c, P, p, r, out_b, lse_b, s))
        except ValueError:
            costs[s] = float("inf")
    return costs


def choose(c: Cluster, out_b: float, lse_b: float, p: int, r: int | None = None) -> str:
    """The tree strategy with the least modelled cost; ties go to the fewest collectives."""
    costs = reduction_costs(c, out_b, lse_b, p, r)
    return min(PREFERENCE, key=lambda s: (costs[s], PREFERENCE.index(s)))


def check_shape(p: int, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> None:
    for name, v in (("p", p), ("seq", seq), ("batch", batch), ("heads", heads), ("kv_heads", kv_heads)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim < 1 or dtype_bytes < 1:
        raise ValueError(f"head_dim and dtype_bytes must be >= 1, got {head_dim}, {dtype_bytes}")


def kv_shard_bytes(p: int, seq: int, batch: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V bytes on the fullest rank."""
    return batch * kv_heads * -(-seq // p) * 2 * head_dim * dtype_bytes


def step_time(
    c: Cluster, P: dict[str, Any], p: int, seq: int, batch: int, heads: int, kv_heads: int,
    head_dim: int, dtype_bytes: int, strategy: str, ranks_per_node: int | None = None,
) -> Any:  # fmt: skip
    """Seconds of one decode step (float or :class:`Lin`), parameters ``P`` in linear form.
    ``ranks_per_node``: the layout (default: ranks fill the cluster's nodes in order)."""
    if strategy not in PREDICTED:
        raise ValueError(f"strategy must be one of {PREDICTED}, got {strategy!r}")
    check_shape(p, seq, batch, heads, kv_heads, head_dim, dtype_bytes)
    if ranks_per_node is None:
        r, nodes = c.placement(p)
    else:
        r = min(p, ranks_per_node)
        nodes = -(-p // r)
    slow = _slow(c, r)
    kv = kv_shard_bytes(p, seq, batch, kv_heads, head_dim, dtype_bytes)
    out_b, lse_b = batch * heads * head_dim * STATE_BYTES, batch * heads * STATE_BYTES
    attn = slow * (P["attn_alpha"] + kv * P["inv_attn_bw"])
    if strategy == "local" or p == 1:
        return attn
    if strategy == "auto":
        strategy = choose(c, out_b, lse_b, p, r)
    if strategy != "ring":
        return attn + reduction_time(c, P, p, r, out_b, lse_b, strategy)
    # ring: shard lengths all-gather, p - 1 overlapped hops, merge of p states
    if nodes > 1:
        a, ib = P["inter_alpha"], P["inter_inv_beta"]
        hop_a, hop_ib = P["collective_alpha"] + a, ib
    else:
        a, ib = P["intra_alpha"], P["intra_inv_beta"]
        hop_a = P["p2p_alpha"] if P["p2p_alpha"] is not None else P["collective_alpha"] + a
        hop_ib = P["p2p_inv_beta"] if P["p2p_inv_beta"] is not None else ib
    lens = _allgather(c, P["collective_alpha"], (batch + 1) * 8, p, a, ib)
    merge = (slow * p * (out_b + lse_b)) * P["inv_attn_bw"]
    return lens + F.ring_pass(p, hop_a + kv * hop_ib, attn) + merge


def breakdown(
    cluster: Cluster, p: int, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int,
    dtype_bytes: int, strategy: str, ranks_per_node: int | None = None,
) -> dict[str, float]:  # fmt: skip
    """Like :func:`predict`, split along the critical path: ``total_s``, ``compute_s`` (attention
    and merges) and ``comm_s`` (everything else), seconds; also ``kv_shard_bytes`` of the fullest rank."""
    t = step_time(
        cluster, traced(cluster), p, seq, batch, heads, kv_heads, head_dim, dtype_bytes, strategy, ranks_per_node
    )
    vals = linear_params(cluster)
    compute = sum(t.c.get(k, 0.0) * vals[k] for k in COMPUTE_PARAMS) if isinstance(t, Lin) else 0.0
    total = value(t)
    return {
        "total_s": total,
        "compute_s": compute,
        "comm_s": total - compute,
        "kv_shard_bytes": kv_shard_bytes(p, seq, batch, kv_heads, head_dim, dtype_bytes),
    }


def predict(
    cluster: Cluster, p: int, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int,
    dtype_bytes: int, strategy: str, ranks_per_node: int | None = None,
) -> float:  # fmt: skip
    """Predicted seconds of one decode step (one query token per sequence).

    Args:
        cluster: hardware constants (a preset, a profile's or a fitted one).
        p: ranks the KV cache is sharded over; seq: total context tokens.
        batch, heads, kv_heads, head_dim: query batch, query heads, K/V heads, head size.
        dtype_bytes: bytes per K/V element (2 for bf16).
        strategy: one of :data:`PREDICTED`.
        ranks_per_node: the node layout; default: ranks fill ``cluster``'s nodes in order.

    Raises:
        ValueError: unknown strategy, bad shape, ``p`` beyond the cluster, or ``hierarchical``
            with unequal nodes.
    """
    return value(
        step_time(
            cluster,
            linear_params(cluster),
            p,
            seq,
            batch,
            heads,
            kv_heads,
            head_dim,
            dtype_bytes,
            strategy,
            ranks_per_node,
        )  # fmt: skip
    )
