"""Communication volume (treeattn.comm.metering) and cross-rank validation, at p = 3.

Meter: the bytes every strategy sends follow the closed forms of treeattn/comm/meter.py and
do not depend on the context length; ring_decode's grow linearly with it.
Validation: a bad or disagreeing input on ONE rank raises ValueError on EVERY rank, fast,
and leaves the process group usable."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import treeattn
from treeattn.launch import launch

P = 3
D = 16
VALIDATE_BYTES = (2 + 240 + 3) * 8  # agree(): one all-gather of 2 + 240 + 3 int64 per rank (flag, message, count, digest)


def make(B=2, Hq=8, Hkv=2, Tq=3, S=5, Dv=D, dtype=torch.float32, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, d, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, d, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
    new_k = torch.randn(B, Hkv, Tq, d, generator=g).to(dtype)
    new_v = torch.randn(B, Hkv, Tq, Dv, generator=g).to(dtype)
    return dict(q=q, k=k, v=v, new_k=new_k, new_v=new_v)


# ---------------------------------------------------------------------------------------
# meter


def meter_worker() -> None:
    import treeattn
    from treeattn.comm import metering

    rank, p = dist.get_rank(), dist.get_world_size()
    B, Hq, Hkv, Tq, Dv = 2, 8, 2, 3, 8
    out_bytes, lse_bytes = B * Hq * Tq * Dv * 4, B * Hq * Tq * 4  # float32 state
    n = out_bytes + lse_bytes  # packed [out | lse]: B*Hq*Tq*(Dv+1)*4

    def ar(nbytes):  # all_reduce: 2 (p-1)/p n
        return round(2 * (p - 1) / p * nbytes)

    expect = {  # strategy -> (calls, bytes sent per rank)
        "allreduce3": ({"all_reduce": 3}, ar(lse_bytes) + ar(out_bytes) + ar(lse_bytes)),
        "allreduce2": ({"all_reduce": 2}, ar(lse_bytes) + ar(n)),
        "allgather": ({"all_gather": 1}, (p - 1) * n),
        "hierarchical": ({"all_gather": 1}, (p - 1) * n),  # one node (LOCAL_WORLD_SIZE=3): allgather
    }
    sent_by_S = {}
    for S in (8, 128):  # 16x the context
        data = make(B, Hq, Hkv, Tq, S, Dv, seed=S + rank)
        for strategy, (calls, sent) in expect.items():
            with metering() as m:
                treeattn.tree_decode(**data, strategy=strategy, check=False)
            what = f"rank {rank} S={S} {strategy}"
            assert dict(m.calls) == calls, f"{what}: {dict(m.calls)}"
            assert m.collectives == sum(calls.values()), what
            assert m.bytes_sent == sent and m.bytes_recv == sent, f"{what}: {m.bytes_sent}/{m.bytes_recv} != {sent}"
            assert m.by_label == {strategy: Counter(calls, bytes_sent=sent, bytes_recv=sent)}, f"{what}: {m.by_label}"
            sent_by_S[S, strategy] = m.bytes_sent

            # check=True adds exactly one small all-gather (the metadata agreement)
            with metering() as m:
                treeattn.tree_decode(**data, strategy=strategy, check=True)
            assert m.calls == Counter(calls) + Counter(all_gather=1), f"{what} check=True: {dict(m.calls)}"
            assert m.bytes_sent == sent + (p - 1) * VALIDATE_BYTES, f"{what} check=True: {m.bytes_sent}"

        with metering() as m:  # auto runs one of the above, labelled with its name
            treeattn.tree_decode(**data, strategy="auto", check=False)
        (chosen,) = m.by_label
        calls, sent = expect[chosen]
        assert dict(m.calls) == calls and m.bytes_sent == sent, f"rank {rank} S={S} auto -> {chosen}: {m}"
    for strategy in expect:
        assert sent_by_S[8, strategy] == sent_by_S[128, strategy], strategy

    # ring_decode: one small all-gather of (S_local, kv_lens), then p-1 hops of a K/V shard
    # (K and V as two messages); equal shards, so every hop carries S * B * Hkv * (D + Dv) elements
    for dtype in (torch.float32, torch.bfloat16):
        kv = {}
        for S in (8, 128):
            data = make(B, Hq, Hkv, Tq, S, Dv, dtype=dtype, seed=S + rank)
            with metering() as m:
                treeattn.ring_decode(**data, kv_lens=torch.full((B,), S - 1), check=False)
            what = f"rank {rank} ring {dtype} S={S}"
            assert dict(m.calls) == {"all_gather": 1, "send": 2 * (p - 1), "recv": 2 * (p - 1)}, (
                f"{what}: {dict(m.calls)}"
            )
            assert m.collectives == 1, what
            info = (p - 1) * (B + 1) * 8
            shard = S * B * Hkv * (D + Dv) * dtype.itemsize
            assert m.bytes_sent == info + (p - 1) * shard, f"{what}: {m.bytes_sent}"
            assert m.bytes_recv == info + (p - 1) * shard, f"{what}: {m.bytes_recv}"
            kv[S] = m.bytes_sent - info
            with metering() as m2:
                treeattn.ring_decode(**data, check=True)
            assert m2.calls == m.calls + Counter(all_gather=1), f"{what} check=True: {dict(m2.calls)}"
            assert m2.bytes_sent == m.bytes_sent + (p - 1) * VALIDATE_BYTES, what
        assert kv[128] == 16 * kv[8], kv


def test_meter_bytes():
    launch(meter_worker, P, timeout=120, collective_timeout=30)


# ---------------------------------------------------------------------------------------
# validation


def _drop(d, *names):
    return {k: v for k, v in d.items() if k not in names}


def _nan_q(d):
    q = d["q"].clone()
    q[0, 0, 0, 0] = float("nan")
    return {**d, "q": q}


# (what is wrong on the bad rank, the text every rank's message must contain, the bad
# rank's call as a function of the good kwargs). Every good call uses strategy="allgather".
MISMATCHES = [
    ("B", lambda d: make(B=3)),
    ("Hq", lambda d: make(Hq=4)),
    ("Hkv", lambda d: make(Hkv=4)),
    ("D", lambda d: make(d=8)),
    ("Dv", lambda d: make(Dv=8)),
    ("Tq", lambda d: make(Tq=1)),
    ("dtype", lambda d: make(dtype=torch.bfloat16)),
    ("scale", lambda d: {**d, "scale": 0.5}),  # vs the default (None) elsewhere
    ("scale", lambda d: {**d, "scale": 0.0}),  # None was sent as 0 (the bits of 0.0): they agreed
    ("strategy", lambda d: {**d, "strategy": "allreduce2"}),
    ("new tokens", lambda d: _drop(d, "new_k", "new_v")),
    ("new_mask", lambda d: {**d, "new_mask": torch.ones(3, 3, dtype=torch.bool).tril()}),  # given vs default
]
LOCAL_ERRORS = [
    ("q not 4-D", "q must be 4-D", lambda d: {**d, "q": d["q"][0]}),
    ("Hq % Hkv", "Hq must be a multiple of Hkv", lambda d: make(Hkv=3)),
    ("NaN in q", "q contains NaN", _nan_q),
    ("kv_lens > S", "kv_lens must lie in", lambda d: {**d, "kv_lens": torch.tensor([6, 0])}),
    ("kv_lens < 0", "kv_lens must lie in", lambda d: {**d, "kv_lens": torch.tensor([-1, 5])}),
    ("kv_lens float", "kv_lens must be an integer", lambda d: {**d, "kv_lens": torch.tensor([5.0, 5.0])}),
    ("new_k without new_v", "new_k and new_v must be given together", lambda d: _drop(d, "new_v")),
    ("new_k shape", "new_k must be [B, Hkv, Tq, D]", lambda d: {**d, "new_k": d["new_k"][:, :, :1]}),
    (
        "new_mask shape",
        "new_mask must be a bool tensor",
        lambda d: {**d, "new_mask": torch.ones(3, 4, dtype=torch.bool)},
    ),
    ("unknown strategy", "strategy must be one of", lambda d: {**d, "strategy": "allreduce4"}),
    ("q not a tensor", "q must be a torch.Tensor", lambda d: {**d, "q": None}),
]


def validation_worker() -> None:
    import treeattn

    rank, p = dist.get_rank(), dist.get_world_size()
    good = make()
    want = treeattn.tree_decode(**good, strategy="allgather")
    want_ring = treeattn.ring_decode(**good)

    cases = [(f"mismatch {f}", f"ranks disagree on {f} (", fn) for f, fn in MISMATCHES]
    cases += [(f"local error: {name}", text, fn) for name, text, fn in LOCAL_ERRORS]
    for i, (what, text, fn) in enumerate(cases):
        for ring in (False, True):
            if ring and "strategy" in what:
                continue  # ring_decode takes no strategy
            bad = (i + ring) % p  # the bad rank moves around
            kw = {**good, "strategy": "allgather"}
            if rank == bad:
                kw = {"strategy": "allgather", **fn(kw)}
            op = treeattn.tree_decode
            if ring:
                kw.pop("strategy")
                op = treeattn.ring_decode
            tag = f"rank {rank}: {'ring' if ring else 'tree'} {what} on rank {bad}"
            t0 = time.monotonic()
            with pytest.raises(ValueError) as ei:
                op(**kw)
            took = time.monotonic() - t0
            assert took < 10, f"{tag}: took {took:.1f} s (hang bound)"
            msg = str(ei.value)
            assert text in msg, f"{tag}: {msg!r}"
            if what.startswith("mismatch"):  # every rank's value is shown
                assert all(f"rank {r}:" in msg for r in range(p)), f"{tag}: {msg!r}"
            elif rank != bad:  # the others name the bad rank
                assert f"rank {bad}:" in msg, f"{tag}: {msg!r}"

            # the group is not broken: a normal call still works
            again = treeattn.ring_decode(**good) if ring else treeattn.tree_decode(**good, strategy="allgather")
            assert torch.equal(again, want_ring if ring else want), f"{tag}: the next call differs"
    # the default scale given explicitly on one rank is the same scale: no disagreement
    kw = {**good, "strategy": "allgather"}
    if rank == 1:
        kw["scale"] = kw["q"].shape[-1] ** -0.5
    assert torch.equal(treeattn.tree_decode(**kw), want)
    dist.barrier()


def test_validation_raises_on_every_rank():
    launch(validation_worker, P, timeout=120, collective_timeout=20)


def topology_mismatch_worker() -> None:
    rank = dist.get_rank()
    q = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(0))
    k = v = torch.randn(1, 2, 5, 8)
    topo = treeattn.Topology(2) if rank == 0 else None
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="ranks_per_node"):
        treeattn.tree_decode(q, k, v, strategy="hierarchical", topology=topo)
    assert time.monotonic() - t0 < 10


def test_topology_mismatch_raises_instead_of_hanging():
    launch(topology_mismatch_worker, 4, timeout=120, collective_timeout=30)
