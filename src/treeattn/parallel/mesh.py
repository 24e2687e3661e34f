"""The ranks as a 2-D mesh, TPA x KVP (TensorRT-LLM's Helix layout): ``tpa`` slices of the
attention heads, each slice's K/V sharded along the sequence over its ``kvp = p / tpa`` ranks.
Rank ``r`` holds head slice ``r // kvp`` and sequence shard ``r % kvp``. The weights outside
attention are split over all ``p`` ranks (:mod:`treeattn.hf.tensor_parallel`).

The mesh is a :class:`torch.distributed.device_mesh.DeviceMesh` with dimensions ``("tpa",
"kvp")``; its ``kvp`` process group is the group the attention reduces over (Tree or Ring)
and the sharded cache is placed over. With ``tpa = 1`` no group is created: the sequence
group is the whole group, today's KV-parallel layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import world


@dataclass(frozen=True)
class Mesh:
    """Where this rank sits in the TPA x KVP mesh."""

    group: dist.ProcessGroup | None  # every rank: the weights' split, the agreements
    seq: dist.ProcessGroup | None  # this rank's KVP group: its head slice's sequence shards
    tpa: int  # head slices
    kvp: int  # sequence shards per slice
    head_slice: int  # this rank's slice, in [0, tpa)
    seq_rank: int  # this rank's shard within the slice, in [0, kvp)

    def heads(self, n: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of ``n`` heads (``n % tpa == 0``)."""
        per = n // self.tpa
        return self.head_slice * per, (self.head_slice + 1) * per

    def head_cuts(self, n: int) -> list[int]:
        """The ``kvp + 1`` cut points of a slice's ``n`` query heads over its KVP ranks: after
        the Tree reduction each holds heads ``[cuts[j], cuts[j + 1])`` of the slice (contiguous,
        the first ``n % kvp`` one more), and multiplies their columns of the output projection."""
        per = n // self.tpa
        q, r = divmod(per, self.kvp)
        return [j * q + min(j, r) for j in range(self.kvp + 1)]


def mesh_problem(group: dist.ProcessGroup | None, tpa, kv_heads: int) -> str | None:
    """Why ``tpa`` head slices cannot be made over ``group`` (None: they can)."""
    _, p = world(group)
    if type(tpa) is not int or tpa < 1:
        return f"tpa must be an int >= 1, got {tpa!r}"
    if p % tpa or kv_heads % tpa:
        return f"tpa = {tpa} must divide the ranks ({p}) and the model's KV heads ({kv_heads})"
    if tpa > 1 and group is not None and group is not dist.group.WORLD and world(group)[1] != dist.get_world_size():
        return f"tpa = {tpa} needs the default (world) process group: the mesh's groups are made from it"
    return None


def make_mesh(group: dist.ProcessGroup | None, tpa: int, device_type: str = "cpu") -> Mesh:
    """Collective over ``group`` when ``tpa > 1`` (every rank calls it alike, after
    :func:`mesh_problem` was agreed to be None)."""
    rank, p = world(group)
    kvp = p // tpa
    if tpa == 1:
        return Mesh(group, group, 1, p, 0, rank)
    from torch.distributed.device_mesh import DeviceMesh

    dm = DeviceMesh(device_type, torch.arange(p).view(tpa, kvp), mesh_dim_names=("tpa", "kvp"))
    return Mesh(group, dm.get_group("kvp"), tpa, kvp, rank // kvp, rank % kvp)
