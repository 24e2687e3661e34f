"""Distributed decode (tree_decode with every strategy, ring_decode) against the float64
reference, on 1-5 gloo ranks. One launch per world size; each worker loops over many cases.

Every rank generates the same global data from a seeded generator (all shards, the
queries and the new tokens), keeps its own shard, and checks its result against the
reference computed locally over the concatenation of every rank's valid prefix."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from treeattn.launch import launch

STRATEGIES = ["allreduce3", "allreduce2", "allgather", "hierarchical", "auto", "ring"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS = [(8, 8), (12, 4), (8, 1)]
D = 16
TREE = [[1, 0, 0], [1, 1, 0], [1, 0, 1]]  # token 0 the root, tokens 1 and 2 its children
# (B, Tq, new-token mode, ragged kv_lens, Dv, scale); cycled so that every value of every
# factor meets every strategy (9 configs against the 9 dtype x heads cases of a strategy)
CONFIGS = [
    (1, 1, "none", False, D, None),
    (3, 3, "causal", True, D, None),
    (3, 1, "causal", True, D, 0.3),
    (1, 3, "tree", True, D, None),
    (3, 3, "tree", True, 8, None),
    (3, 3, "tree3d", True, D, None),
    (3, 1, "none", True, 8, None),
    (1, 3, "none", True, D, 0.3),
    (3, 3, "none", False, D, None),
]


def _new_mask(mode: str, B: int, Tq: int) -> torch.Tensor | None:
    if mode == "tree":
        return torch.tensor(TREE, dtype=torch.bool)[:Tq, :Tq]
    if mode == "tree3d":  # a different tree per sequence
        masks = [TREE, [[1, 0, 0], [1, 1, 0], [1, 1, 1]], [[1, 0, 0], [0, 1, 0], [0, 0, 1]]]
        return torch.tensor(masks, dtype=torch.bool)[:B, :Tq, :Tq]
    return None


def make_case(seed: int, p: int, dtype, heads, B: int, Tq: int, mode: str, ragged: bool, Dv: int):
    """Global data of one case, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    sizes = torch.randint(0, 13, (p,), generator=g).tolist()
    if p > 1 and seed % 2 == 0:
        sizes[seed % p] = 0  # an empty shard (S_local = 0)
    zero_rank = (seed // 2) % p  # with ragged kv_lens: every sequence of this rank is empty
    q = torch.randn(B, Hq, Tq, D, generator=g).to(dtype)
    ks = [torch.randn(B, Hkv, s, D, generator=g).to(dtype) for s in sizes]
    vs = [torch.randn(B, Hkv, s, Dv, generator=g).to(dtype) for s in sizes]
    if ragged:
        lens = [torch.randint(0, s + 1, (B,), generator=g) for s in sizes]
        lens[zero_rank] = torch.zeros(B, dtype=torch.int64)
    else:
        lens = [None] * p
    new_k = new_v = None
    if mode != "none":
        new_k = torch.randn(B, Hkv, Tq, D, generator=g).to(dtype)
        new_v = torch.randn(B, Hkv, Tq, Dv, generator=g).to(dtype)
    return q, ks, vs, lens, new_k, new_v, _new_mask(mode, B, Tq)


def expected(q, ks, vs, lens, new_k, new_v, new_mask, scale):
    """(float64 reference, plain torch in q's dtype) over, per sequence b, the
    concatenation of every rank's valid prefix followed by the new tokens."""
    from reference import naive_attention, reference

    B, _, Tq, _ = q.shape
    ref, pt = [], []
    for b in range(B):
        kb = [k[b : b + 1, :, : (k.shape[2] if L is None else int(L[b]))] for k, L in zip(ks, lens, strict=True)]
        vb = [v[b : b + 1, :, : (v.shape[2] if L is None else int(L[b]))] for v, L in zip(vs, lens, strict=True)]
        mask = None
        if new_k is not None:
            n_cache = sum(t.shape[2] for t in kb)
            nm = torch.ones(Tq, Tq, dtype=torch.bool).tril() if new_mask is None else new_mask
            nm = nm[b] if nm.ndim == 3 else nm
            mask = torch.cat([torch.ones(Tq, n_cache, dtype=torch.bool), nm], 1).unsqueeze(0)
            kb, vb = kb + [new_k[b : b + 1]], vb + [new_v[b : b + 1]]
        args = (q[b : b + 1], torch.cat(kb, 2), torch.cat(vb, 2))
        ref.append(reference(*args, scale=scale, mask=mask))
        pt.append(naive_attention(*args, scale=scale, mask=mask))
    cat = lambda states: tuple(torch.cat(t, 0) for t in zip(*states, strict=True))  # noqa: E731
    return cat(ref), cat(pt)


def check_close(out, lse, q, ref, pt, what: str) -> None:
    """flash-attn's rule (as reference.assert_within_tolerance): error vs float64 at most 2x
    plain PyTorch's error in the same dtype, plus a tiny floor; for out and for lse."""
    from reference import max_err

    assert out.shape == q.shape[:3] + ref[0].shape[3:], what
    assert out.dtype == q.dtype, f"{what}: out dtype {out.dtype}"
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32, f"{what}: lse {lse.dtype} {tuple(lse.shape)}"
    e_out, pt_out = max_err(out, ref[0]), max_err(pt[0], ref[0])
    assert e_out <= 2 * pt_out + 1e-6, f"{what}: out error {e_out:.3g} > 2 x plain-torch {pt_out:.3g}"
    e_lse, pt_lse = max_err(lse, ref[1]), max_err(pt[1], ref[1])
    assert e_lse <= 2 * pt_lse + 1e-5, f"{what}: lse error {e_lse:.3g} > 2 x plain-torch {pt_lse:.3g}"


def gather_all(out: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's (out, lse) as one flat float32 tensor (bf16/fp16 -> fp32 is exact)."""
    flat = torch.cat([out.float().reshape(-1), lse.reshape(-1)])
    bufs = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, flat)
    return bufs


def decode_worker(strategies: list[str]) -> None:
    import treeattn

    rank, p = dist.get_rank(), dist.get_world_size()
    topologies = [None]
    if p == 4:
        topologies += [treeattn.Topology(2), treeattn.Topology(1)]
    n = 0
    for s_idx, strategy in enumerate(strategies):
        for j, (dtype, heads) in enumerate((d, h) for d in DTYPES for h in HEADS):
            B, Tq, mode, ragged, Dv, scale = CONFIGS[(j + s_idx) % len(CONFIGS)]
            for topo in topologies if strategy == "hierarchical" else [None]:
                n += 1
                seed = 1000 * p + 37 * s_idx + j + (7 if topo is not None else 0)
                q, ks, vs, lens, new_k, new_v, new_mask = make_case(seed, p, dtype, heads, B, Tq, mode, ragged, Dv)
                what = (
                    f"rank {rank}/{p} {strategy} topo={topo} {dtype} heads={heads} B={B} Tq={Tq} new={mode} "
                    f"ragged={ragged} Dv={Dv} scale={scale} sizes={[k.shape[2] for k in ks]} seed={seed}"
                )
                kw = dict(
                    scale=scale,
                    kv_lens=lens[rank],
                    new_k=new_k,
                    new_v=new_v,
                    new_mask=new_mask,
                    return_lse=True,
                )
                if strategy == "ring":
                    out, lse = treeattn.ring_decode(q, ks[rank], vs[rank], **kw)
                else:
                    kw.update(strategy=strategy, topology=topo)
                    with treeattn.metering() as m:
                        out, lse = treeattn.tree_decode(q, ks[rank], vs[rank], **kw)
                    if p == 4 and strategy in ("hierarchical", "auto"):  # the node layout is honoured
                        layout = topo or treeattn.Topology(int(os.environ["LOCAL_WORLD_SIZE"]))
                        two_level = layout.nodes(p) not in (1, p)
                        label = strategy
                        if strategy == "auto":  # the cost model's choice (built-in preset) for this layout
                            b_, hq, tq = q.shape[:3]
                            label = treeattn.comm.choose_strategy(b_ * hq * tq * vs[rank].shape[3] * 4,
                                                                  b_ * hq * tq * 4, p, layout)  # fmt: skip
                        gathers = {"hierarchical": 2 if two_level else 1, "allgather": 1}.get(label, 0)
                        calls = {k: c.get("all_gather", 0) for k, c in m.by_label.items()}
                        assert calls == {label: gathers}, f"{what}: {m.by_label}"
                ref, pt = expected(q, ks, vs, lens, new_k, new_v, new_mask, scale)
                check_close(out, lse, q, ref, pt, what)

                everyone = gather_all(out, lse)
                for r, t in enumerate(everyone):  # documented: "the same on every rank" (ring too)
                    assert torch.equal(t, everyone[rank]), f"{what}: rank {r}'s result differs from this rank's"

                if strategy == "allgather":  # bitwise deterministic across calls
                    kw["return_lse"] = False
                    again = treeattn.tree_decode(q, ks[rank], vs[rank], **kw)
                    assert torch.equal(again, out), f"{what}: second call differs"
    # the loop really covered every strategy x dtype x heads
    assert n == len(strategies) * 9 + (18 if p == 4 and "hierarchical" in strategies else 0)

    # k states per rank (reduce_states(stacked=True), a batched step's prefix and row states):
    # every strategy gives the merge of all p k states, the all-gather bitwise that of the
    # gathered states in rank order; empty (+-inf) and undefined (NaN) states included
    from treeattn.comm.strategies import reduce_states
    from treeattn.ops.packed import merge_packed
    from treeattn.ops.state import merge_states_n

    for i, strategy in enumerate(s for s in strategies if s != "ring"):
        for dtype in (torch.float32, torch.float64):
            g = torch.Generator().manual_seed(77 * i + rank)
            k = 1 + i % 3  # the same on every rank
            out = torch.randn(k, 2, 3, 8, generator=g, dtype=dtype)
            lse = torch.randn(k, 2, 3, generator=g, dtype=dtype) * 20
            pick = torch.randint(0, 10, lse.shape, generator=g)
            special = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
            lse = torch.where(pick < 3, special[pick.clamp(max=2)], lse)
            got = reduce_states(out, lse, strategy=strategy, stacked=True)
            flat = torch.cat([out, lse.unsqueeze(-1)], -1)
            bufs = [torch.empty_like(flat) for _ in range(p)]
            dist.all_gather(bufs, flat)
            every = torch.cat(bufs)  # [p k, 2, 3, 9]
            want = merge_states_n(every[..., :-1], every[..., -1])
            what = f"stacked {strategy} {dtype} k={k} p={p}"
            assert got[0].dtype == dtype and got[0].shape == (2, 3, 8) and got[1].shape == (2, 3), what
            torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-6, msg=what)
            if strategy == "allgather" or p == 1:
                ref = merge_packed(every)
                assert all(torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
                           for x, y in zip(got, ref, strict=True)), what  # fmt: skip


@pytest.mark.parametrize(
    "p,ranks_per_node,strategies",
    [
        pytest.param(1, None, STRATEGIES, id="p1"),
        pytest.param(2, None, STRATEGIES, id="p2"),
        pytest.param(3, None, STRATEGIES, id="p3"),
        pytest.param(4, None, STRATEGIES, id="p4"),
        # LOCAL_WORLD_SIZE=2: "hierarchical"/"auto" default to 2 nodes x 2 ranks
        pytest.param(4, 2, ["hierarchical", "auto"], id="p4-2x2"),
        pytest.param(5, None, STRATEGIES, id="p5"),
    ],
)
def test_decode_matches_reference(p, ranks_per_node, strategies):
    launch(decode_worker, p, (strategies,), timeout=180, collective_timeout=60, ranks_per_node=ranks_per_node)


def test_one_rank_is_the_local_op():
    """tree_decode on one process (no reduction; no new tokens) returns the local op's result
    bitwise, in q's dtype; an unknown strategy is refused even with check=False."""
    import treeattn

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 8, 1, 32, generator=g).to(dtype)
        k, v = torch.randn(2, 2, 50, 32, generator=g).to(dtype), torch.randn(2, 2, 50, 32, generator=g).to(dtype)
        lens = torch.tensor([50, 17])
        out, lse = treeattn.tree_decode(q, k, v, kv_lens=lens, return_lse=True, check=False)
        ref = treeattn.attention_with_lse(q, k, v, kv_lens=lens, check=False)
        assert out.dtype == dtype and torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    with pytest.raises(ValueError, match="strategy must be one of"):
        treeattn.tree_decode(q, k, v, strategy="allreduce4", check=False)
