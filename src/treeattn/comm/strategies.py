"""Reduce attention states ``(out, lse)`` over a process group.

Every strategy is exact and leaves the same merged state on every rank, float32:

- ``allreduce3``: the seed paper's Algorithm 3 — all-reduce max of lse, then sum of the
  rescaled numerator, then sum of the denominator (3 collectives).
- ``allreduce2``: all-reduce max, then one all-reduce of a packed ``[numerator | denominator]``.
- ``allgather``: one all-gather of packed ``[out | lse]`` and a local merge in rank order
  (1 collective; bitwise deterministic and identical on every rank).
- ``hierarchical``: all-gather + merge inside each node, then all-gather + merge among the
  ranks with the same local index across nodes (2 collectives, the slow inter-node one
  carries one state per node). With one node or one rank per node it is ``allgather``.
- ``auto``: the cheapest by :func:`choose_strategy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.state import merge_states_n
from . import meter
from .collectives import all_gather, all_reduce, world
from .topology import Topology, node_groups

STRATEGIES: tuple[str, ...] = ("auto", "allreduce3", "allreduce2", "allgather", "hierarchical")


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta constants of the cost model ``t = k * alpha + bytes / beta`` used by
    ``auto``. Defaults: 30 µs per collective and 10 GB/s, roughly NVLink-less intra-node;
    ``inter_*`` apply to the cross-node step of ``hierarchical``."""

    alpha: float = 30e-6
    beta: float = 10e9
    inter_alpha: float = 60e-6
    inter_beta: float = 5e9


def strategy_costs(
    out_bytes: int, lse_bytes: int, p: int, topology: Topology | None = None, link: LinkModel = LinkModel()
) -> dict[str, float]:
    """Modelled seconds of each strategy for one state (``out_bytes`` + ``lse_bytes`` per
    rank, float32) over ``p`` ranks, with ring algorithms (gloo's, and NCCL's for large
    groups): an all-gather costs ``(p-1)`` latency steps and ``(p-1) n`` bytes; an all-reduce
    ``2 (p-1)`` steps and ``2 (p-1)/p n`` bytes. With a multi-node ``topology``, flat
    collectives pay the inter-node constants and ``hierarchical`` pays intra-node constants
    for its first step only."""
    if p <= 1:
        return dict.fromkeys(STRATEGIES[1:], 0.0)

    def ag(n: int, q: int, a: float, b: float) -> float:
        return (q - 1) * (a + n / b)

    def ar(n: int, a: float, b: float) -> float:
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n / b

    multi = topology is not None and 1 < topology.ranks_per_node < p and p % topology.ranks_per_node == 0
    a, b = (link.inter_alpha, link.inter_beta) if multi else (link.alpha, link.beta)
    state = out_bytes + lse_bytes
    costs = {
        "allreduce3": 2 * ar(lse_bytes, a, b) + ar(out_bytes, a, b),
        "allreduce2": ar(lse_bytes, a, b) + ar(state, a, b),
        "allgather": ag(state, p, a, b),
    }
    if multi:
        r = topology.ranks_per_node
        costs["hierarchical"] = ag(state, r, link.alpha, link.beta) + ag(state, p // r, a, b)
    else:
        costs["hierarchical"] = costs["allgather"]
    return costs


def choose_strategy(
    out_bytes: int, lse_bytes: int, p: int, topology: Topology | None = None, link: LinkModel = LinkModel()
) -> str:
    """The strategy with the least modelled cost; ties go to the fewest collectives."""
    costs = strategy_costs(out_bytes, lse_bytes, p, topology, link)
    order = ["allgather", "hierarchical", "allreduce2", "allreduce3"]
    return min(order, key=lambda s: (costs[s], order.index(s)))


def reduce_states(
    out: Tensor,
    lse: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    topology: Topology | None = None,
) -> tuple[Tensor, Tensor]:
    """Merge this rank's state with every other rank's state in ``group``.

    Args:
        out: ``[..., Dv]`` any float dtype (made float32). lse: ``out.shape[:-1]``.
        strategy: one of :data:`STRATEGIES`. topology: for ``hierarchical``/``auto``;
            default from ``LOCAL_WORLD_SIZE``.

    Returns:
        The merged ``(out, lse)``, float32, identical on every rank.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    _, p = world(group)
    out = out.float()
    lse = torch.where(torch.isfinite(lse), lse.float(), float("-inf"))
    if p == 1:
        return out, lse
    topology = topology if topology is not None else Topology.from_env()
    if strategy == "auto":
        strategy = choose_strategy(out.numel() * 4, lse.numel() * 4, p, topology)
    with meter.label(strategy):
        if strategy == "allgather":
            return _allgather(out, lse, group)
        if strategy == "hierarchical":
            return _hierarchical(out, lse, group, topology)
        return _allreduce(out, lse, group, packed=strategy == "allreduce2")


def _allgather(out: Tensor, lse: Tensor, group) -> tuple[Tensor, Tensor]:
    buf = all_gather(torch.cat([out, lse.unsqueeze(-1)], -1), group)
    return merge_states_n(buf[..., :-1], buf[..., -1])


def _hierarchical(out: Tensor, lse: Tensor, group, topology: Topology | None) -> tuple[Tensor, Tensor]:
    _, p = world(group)
    if topology is None or topology.ranks_per_node in (1, p):
        return _allgather(out, lse, group)
    intra, cross = node_groups(group, topology)
    out, lse = _allgather(out, lse, intra)
    return _allgather(out, lse, cross)


def _allreduce(out: Tensor, lse: Tensor, group, packed: bool) -> tuple[Tensor, Tensor]:
    m = all_reduce(lse.clone(), dist.ReduceOp.MAX, group)
    m = torch.where(torch.isinf(m), 0.0, m)  # every rank empty: lse stays -inf below
    w = torch.exp(lse - m)
    num = torch.where(w.unsqueeze(-1) > 0, out * w.unsqueeze(-1), 0.0)
    if packed:
        buf = all_reduce(torch.cat([num, w.unsqueeze(-1)], -1), dist.ReduceOp.SUM, group)
        num, den = buf[..., :-1], buf[..., -1]
    else:
        num = all_reduce(num, dist.ReduceOp.SUM, group)
        den = all_reduce(w, dist.ReduceOp.SUM, group)
    return num / torch.where(den > 0, den, 1.0).unsqueeze(-1), m + torch.log(den)
