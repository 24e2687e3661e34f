"""``auto`` with a profile on 4 gloo ranks (2 "nodes" x 2): the slow inter-node profile makes it
run ``hierarchical``; ranks must agree on the profile; a bad profile on one rank fails on all."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from treeattn.cost import PRESETS
from treeattn.launch import launch


def worker(tmp: str) -> None:
    import treeattn
    from treeattn.cost import save_profile

    rank, p = dist.get_rank(), dist.get_world_size()
    slow = replace(PRESETS["local"], name="slow-inter", inter_alpha=2e-3, inter_beta=10e6)
    path = os.path.join(tmp, "slow.json")
    if rank == 0:
        save_profile(path, slow)
    dist.barrier()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=g)
    kv = [torch.randn(2, 2, 4, 3 + r, 16, generator=g) for r in range(p)]
    k, v = kv[rank]
    topo = treeattn.Topology(2)

    def used(**kw) -> set[str]:
        with treeattn.metering() as m:
            out = treeattn.tree_decode(q, k, v, topology=topo, **kw)
        return out, set(m.by_label)

    ref, labels = used(strategy="allgather")
    for kw in ({"profile": path}, {"profile": slow}):
        out, labels = used(**kw)
        assert labels == {"hierarchical"}, (kw, labels)
        torch.testing.assert_close(out, ref)
    out, labels = used()  # built-in local preset: one fast link, a flat collective
    assert labels != {"hierarchical"}, labels
    os.environ["TREEATTN_PROFILE"] = path
    assert used()[1] == {"hierarchical"}
    del os.environ["TREEATTN_PROFILE"]

    # ranks disagreeing on the model: every rank raises before any payload collective
    other = replace(slow, inter_beta=20e6)
    try:
        treeattn.tree_decode(q, k, v, topology=topo, profile=slow if rank else other)
    except ValueError as e:
        assert "cost model" in str(e), e
    else:
        raise AssertionError("disagreeing profiles were accepted")
    # one rank's profile file is missing: every rank raises, naming the file and the rank
    missing = os.path.join(tmp, "missing.json")
    try:
        treeattn.tree_decode(q, k, v, topology=topo, profile=missing if rank == 1 else path)
    except ValueError as e:
        assert "missing.json" in str(e) and (rank == 1 or "rank 1" in str(e)), e
    else:
        raise AssertionError("missing profile was accepted")
    # a non-auto strategy ignores the profile
    treeattn.tree_decode(q, k, v, topology=topo, strategy="allgather", profile=missing)


def test_auto_with_profile_on_two_nodes(tmp_path):
    launch(worker, 4, (str(tmp_path),), timeout=120, collective_timeout=30)
