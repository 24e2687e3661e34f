"""Two-level topology (nodes x ranks per node) and the process groups it needs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import group_or_world, world


@dataclass(frozen=True)
class Topology:
    """Ranks ``n * ranks_per_node .. (n + 1) * ranks_per_node - 1`` of a group share node ``n``
    (the layout torchrun and :mod:`treeattn.launch` produce)."""

    ranks_per_node: int

    def __post_init__(self) -> None:
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {self.ranks_per_node!r}")

    @classmethod
    def from_env(cls) -> Topology | None:
        """From ``LOCAL_WORLD_SIZE`` (set by torchrun and treeattn's launcher), else None."""
        v = os.environ.get("LOCAL_WORLD_SIZE")
        return cls(int(v)) if v else None

    def nodes(self, p: int) -> int:
        if p % self.ranks_per_node:
            raise ValueError(
                f"group size {p} is not a multiple of ranks_per_node={self.ranks_per_node}; "
                "the hierarchical strategy needs equal nodes"
            )
        return p // self.ranks_per_node


_GROUPS: dict[tuple, tuple] = {}


def _timeout(group: dist.ProcessGroup):
    """The parent group's collective timeout (None: torch's default), so sub-groups fail as fast."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        try:
            return group._get_backend(torch.device("cuda")).options._timeout
        except Exception:
            return None


def node_groups(group: dist.ProcessGroup | None, topo: Topology) -> tuple:
    """``(intra, cross)`` groups of this rank: the ranks of its node, and the ranks with its
    local index on every node. Created once per (group, topology), only by member ranks."""
    rank, p = world(group)
    key = (id(group) if group is not None else None, p, topo.ranks_per_node)
    if key not in _GROUPS:
        rpn = topo.ranks_per_node
        nodes = topo.nodes(p)
        g = group_or_world(group)
        glob = [dist.get_global_rank(g, r) for r in range(p)]
        node, local = divmod(rank, rpn)
        kw = dict(use_local_synchronization=True, timeout=_timeout(g))
        intra = dist.new_group([glob[node * rpn + j] for j in range(rpn)], **kw)
        cross = dist.new_group([glob[n * rpn + local] for n in range(nodes)], **kw)
        _GROUPS[key] = (intra, cross)
    return _GROUPS[key]
