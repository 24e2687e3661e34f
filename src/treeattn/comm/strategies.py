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
- ``auto``: the cheapest by the cost model (:mod:`treeattn.cost`): a calibrated profile when
  given (``profile=`` or ``$TREEATTN_PROFILE``), else the built-in preset of the backend.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import STRATEGIES  # the choices' one definition, in the settings
from ..cost.model import Cluster, choose, reduction_costs
from ..cost.profile import resolve
from ..ops.packed import merge_packed
from . import meter
from .collectives import all_gather, all_reduce, gather_merge, group_or_world, world
from .topology import Topology, node_groups


@dataclass(frozen=True)
class LinkModel:
    """Overrides of a cost model's link constants (kept for compatibility; prefer a
    :class:`~treeattn.cost.Cluster` or a profile). None keeps the model's value: ``alpha``/``beta``
    are the intra-node latency per step (s) and bandwidth (B/s), ``inter_*`` the inter-node ones."""

    alpha: float | None = None
    beta: float | None = None
    inter_alpha: float | None = None
    inter_beta: float | None = None

    def apply(self, cluster: Cluster) -> Cluster:
        kw = {"intra_alpha": self.alpha, "intra_beta": self.beta}
        kw |= {"inter_alpha": self.inter_alpha, "inter_beta": self.inter_beta}
        return replace(cluster, **{k: v for k, v in kw.items() if v is not None})


def _cluster(link: LinkModel | None, profile: Any, backend: str | None = None) -> tuple[Cluster, str]:
    cluster, source = resolve(profile, backend)
    return (cluster, source) if link is None else (link.apply(cluster), f"{source} with {link}")


def _ranks_per_node(p: int, topology: Topology | None) -> int:
    return p if topology is None else topology.ranks_per_node


def strategy_costs(
    out_bytes: int,
    lse_bytes: int,
    p: int,
    topology: Topology | None = None,
    link: LinkModel | None = None,
    *,
    profile: Any = None,
) -> dict[str, float]:
    """Modelled seconds of each strategy reducing one float32 state (``out_bytes`` +
    ``lse_bytes`` per rank) over ``p`` ranks laid out by ``topology`` (None: one node),
    collectives and merges, by :func:`treeattn.cost.reduction_costs`. ``profile``: a profile
    path, a :class:`~treeattn.cost.Cluster` or None (``$TREEATTN_PROFILE``, else the built-in
    ``local`` preset); ``link`` overrides its link constants. ``hierarchical`` on unequal
    nodes costs ``inf``."""
    if p <= 1:
        return dict.fromkeys(STRATEGIES[1:], 0.0)
    cluster, _ = _cluster(link, profile)
    return reduction_costs(cluster, out_bytes, lse_bytes, p, _ranks_per_node(p, topology))


def choose_strategy(
    out_bytes: int,
    lse_bytes: int,
    p: int,
    topology: Topology | None = None,
    link: LinkModel | None = None,
    *,
    profile: Any = None,
) -> str:
    """The strategy with the least modelled cost (:func:`strategy_costs`); ties go to the fewest collectives."""
    cluster, _ = _cluster(link, profile)
    return choose(cluster, out_bytes, lse_bytes, p, _ranks_per_node(p, topology))


def reduce_states(
    out: Tensor,
    lse: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    topology: Topology | None = None,
    profile: Any = None,
    stacked: bool = False,
) -> tuple[Tensor, Tensor]:
    """Merge this rank's state with every other rank's state in ``group``.

    Args:
        out: ``[..., Dv]`` any float dtype (made float32; float64 stays float64). lse:
            ``out.shape[:-1]``.
        stacked: ``out [k, ..., Dv]``, ``lse [k, ...]`` are ``k`` states of this rank (over
            disjoint keys: e.g. a shared prefix and a sequence's own tokens), all merged. With
            the all-gather strategy every rank's ``k`` go in the one exchange and one merge
            (rank by rank, each rank's in their order); otherwise they are merged here first.
        strategy: one of :data:`STRATEGIES`. topology: for ``hierarchical``/``auto``;
            default from ``LOCAL_WORLD_SIZE``.
        profile: the cost model of ``auto``: a profile path, a :class:`~treeattn.cost.Cluster`,
            a :class:`~treeattn.cost.Profile` or None (``$TREEATTN_PROFILE``, else the built-in
            preset of the group's backend). Every rank must pass the same model
            (:func:`~treeattn.tree_decode` checks that; this function does not).

    Raises:
        ValueError: unknown strategy, or ``stacked`` states of other shapes;
            :class:`~treeattn.cost.ProfileError` for a bad profile.

    Returns:
        The merged ``(out, lse)`` (without the ``k`` dimension when ``stacked``), float32
        (float64 for float64 states), identical on every rank.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if stacked and (out.ndim < 2 or out.shape[:-1] != lse.shape or out.shape[0] < 1):
        raise ValueError(f"stacked states need out [k, ..., Dv] and lse [k, ...], k >= 1, got out "
                         f"{tuple(out.shape)} and lse {tuple(lse.shape)}")  # fmt: skip
    _, p = world(group)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    out, lse = (x if x.dtype == acc else x.to(acc) for x in (out, lse))
    if p > 1 and topology is None and strategy in ("auto", "hierarchical"):
        topology = Topology.from_env()
    if p > 1 and strategy == "auto":
        one = lse.numel() // out.shape[0] if stacked else lse.numel()  # the sizes of one state
        strategy = _auto(profile, group, one * out.shape[-1] * 4, one * 4, p, _ranks_per_node(p, topology))
    if stacked:
        if p > 1 and strategy == "allgather":
            with meter.label(strategy):
                return _allgather(out, lse, group, stacked=True)
        out, lse = merge_packed(torch.cat([out, lse.unsqueeze(-1)], -1))
    if p == 1:
        return out, torch.where(lse == float("inf"), float("-inf"), lse)  # NaN (undefined) propagates
    with meter.label(strategy):  # the all-gather merges treat +inf as empty themselves
        if strategy == "allgather":
            return _allgather(out, lse, group)
        if strategy == "hierarchical":
            return _hierarchical(out, lse, group, topology)
        lse = torch.where(lse == float("inf"), float("-inf"), lse)
        return _allreduce(out, lse, group, packed=strategy == "allreduce2")


_AUTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> {call key: strategy}


def _auto(profile: Any, group, out_bytes: int, lse_bytes: int, p: int, rpn: int) -> str:
    """``auto``'s choice, computed once per group, cost model and sizes (a decode step asks
    once per layer)."""
    key = (profile, os.environ.get("TREEATTN_PROFILE"), out_bytes, lse_bytes, p, rpn)
    try:
        memo = _AUTO.setdefault(group_or_world(group), {})
        hit = memo.get(key)
    except TypeError:  # an unhashable profile: no memo
        memo, hit = None, None
    if hit is None:
        hit = choose(auto_model(profile, group)[0], out_bytes, lse_bytes, p, rpn)
        if memo is not None:
            memo[key] = hit
    return hit


def auto_model(profile: Any = None, group: dist.ProcessGroup | None = None) -> tuple[Cluster, str]:
    """``(cluster, description)`` of the cost model ``auto`` uses for ``profile`` on ``group``."""
    try:
        backend = dist.get_backend(group) if dist.is_initialized() else None
    except (RuntimeError, ValueError):
        backend = None
    return resolve(profile, backend)


def _allgather(out: Tensor, lse: Tensor, group, stacked: bool = False) -> tuple[Tensor, Tensor]:
    got = gather_merge(out, lse, group, stacked)  # ranks of one host: one compiled call
    if got is not None:
        return got
    buf = all_gather(torch.cat([out, lse.unsqueeze(-1)], -1), group)
    return merge_packed(buf.flatten(0, 1) if stacked else buf)


def _hierarchical(out: Tensor, lse: Tensor, group, topology: Topology | None) -> tuple[Tensor, Tensor]:
    _, p = world(group)
    if topology is None or topology.ranks_per_node in (1, p):
        return _allgather(out, lse, group)
    intra, cross = node_groups(group, topology)
    out, lse = _allgather(out, lse, intra)
    return _allgather(out, lse, cross)


def _allreduce(out: Tensor, lse: Tensor, group, packed: bool) -> tuple[Tensor, Tensor]:
    m = all_reduce(torch.where(torch.isnan(lse), float("-inf"), lse), dist.ReduceOp.MAX, group)
    m = torch.where(torch.isinf(m), 0.0, m)  # every rank empty: lse stays -inf below
    w = torch.exp(lse - m)  # 0 empty, NaN undefined (a NaN lse): it reaches every rank's sums
    num = torch.where(w.unsqueeze(-1) == 0, 0.0, out * w.unsqueeze(-1))
    if packed:
        buf = all_reduce(torch.cat([num, w.unsqueeze(-1)], -1), dist.ReduceOp.SUM, group)
        num, den = buf[..., :-1], buf[..., -1]
    else:
        num = all_reduce(num, dist.ReduceOp.SUM, group)
        den = all_reduce(w, dist.ReduceOp.SUM, group)
    return num / torch.where(den > 0, den, 1.0).unsqueeze(-1), m + torch.log(den)
