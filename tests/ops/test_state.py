import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn import merge_states, merge_states_n
from treeattn.ops.energy import tree_reduce
from treeattn.ops.state import empty_state

D = 8
NEG = float("-inf")


def state_of(scores: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 state of one query over keys with the given scores [R, n] and values [n, D]."""
    if scores.shape[-1] == 0:
        return torch.zeros(scores.shape[0], D, dtype=torch.float64), torch.full(
            (scores.shape[0],), NEG, dtype=torch.float64
        )
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ vals, lse


def _merge_tree(states, shape):
    """Merge a list of states by a random binary tree given as a nested split pattern."""
    if len(states) == 1:
        return states[0]
    cut = shape[0] % (len(states) - 1) + 1
    a = _merge_tree(states[:cut], shape[1:] or [1])
    b = _merge_tree(states[cut:], shape[1:] or [1])
    return merge_states(a[0], a[1], b[0], b[1])


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 60),
    cuts=st.lists(st.integers(0, 60), min_size=0, max_size=15),
    offsets=st.lists(st.floats(-1e4, 1e4), min_size=16, max_size=16),
    tree=st.lists(st.integers(0, 1000), min_size=1, max_size=20),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_partitions_and_trees_equal_one_pass(n, cuts, offsets, tree, seed):
    g = torch.Generator().manual_seed(seed)
    R = 3
    bounds = sorted(min(c, n) for c in cuts)
    edges = [0, *bounds, n]  # 1..16 chunks, empty chunks allowed
    scores = torch.randn(R, n, generator=g, dtype=torch.float64) * 3
    vals = torch.randn(n, D, generator=g, dtype=torch.float64)
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        scores[:, a:b] += offsets[i]  # whole chunks far apart in lse
    full_o, full_l = state_of(scores, vals)
    states = [
        tuple(x.float() for x in state_of(scores[:, a:b], vals[a:b]))
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    out, lse = _merge_tree(states, tree)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (lse.double() - full_l).abs().max() <= 1e-6 * max(1.0, full_l.abs().max().item()) + 1e-5
    # Inputs are float32: an lse of magnitude M is known to ~M * 2^-24, which moves every
    # weight exp(lse_i - lse) by that relative amount. That is the float32 floor.
    out_tol = 1e-5 + 4 * 2**-24 * full_l.abs().max().item() * vals.abs().max().item()
    assert (out.double() - full_o).abs().max() <= out_tol
    # N-ary form agrees too
    o_n, l_n = merge_states_n(torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states]))
    assert (o_n - out).abs().max() <= out_tol and (l_n - lse).abs().max() <= 1e-6 * max(
        1.0, lse.abs().max().item()
    ) + 1e-5


@settings(max_examples=100, deadline=None)
@given(la=st.floats(-1e4, 1e4), lb=st.floats(-1e4, 1e4), lc=st.floats(-1e4, 1e4), seed=st.integers(0, 1000))
def test_commutative_and_associative(la, lb, lc, seed):
    g = torch.Generator().manual_seed(seed)
    o = [torch.randn(4, D, generator=g) for _ in range(3)]
    lse = [torch.full((4,), x) for x in (la, lb, lc)]
    ab = merge_states(o[0], lse[0], o[1], lse[1])
    ba = merge_states(o[1], lse[1], o[0], lse[0])
    assert torch.allclose(ab[0], ba[0], atol=1e-6) and torch.equal(ab[1], ba[1])
    left = merge_states(*ab, o[2], lse[2])
    bc = merge_states(o[1], lse[1], o[2], lse[2])
    right = merge_states(o[0], lse[0], *bc)
    # the intermediate lse is rounded to float32 (ulp ~ |lse| 2^-24): the float32 floor
    tol = 1e-5 + 4 * 2**-24 * max(abs(la), abs(lb), abs(lc)) * max(x.abs().max().item() for x in o)
    assert torch.allclose(left[0], right[0], atol=tol, rtol=0)
    assert torch.allclose(left[1], right[1], rtol=1e-6, atol=1e-5)


def test_identity_and_empty():
    o = torch.randn(2, 3, D)
    l = torch.randn(2, 3)
    e_o, e_l = torch.zeros_like(o), torch.full_like(l, NEG)
    out, lse = merge_states(o, l, e_o, e_l)
    assert torch.equal(out, o) and torch.equal(lse, l)
    out, lse = merge_states(e_o, e_l, o, l)
    assert torch.equal(out, o) and torch.equal(lse, l)
    out, lse = merge_states(e_o, e_l, e_o, e_l)
    assert torch.equal(out, e_o) and torch.isneginf(lse).all() and not out.isnan().any()


@pytest.mark.parametrize("empty", [float("-inf"), float("inf")])
def test_infinite_lse_is_empty(empty):
    """-inf and +inf (flash-attn's mark of a row without keys) are empty, whatever the output."""
    o = torch.randn(5, D)
    l = torch.randn(5)
    junk = torch.full((5, D), float("nan"))
    out, lse = merge_states(o, l, junk, torch.full((5,), empty))
    assert torch.equal(out, o) and torch.equal(lse, l)
    out, lse = merge_states(junk, torch.full((5,), empty), junk, torch.full((5,), empty))
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_nan_lse_propagates():
    """A NaN lse (a row that saw a NaN or inf key) makes exactly that row NaN, in every
    position of the stack and next to empty states; the other rows are untouched."""
    o = torch.randn(4, 5, D)
    l = torch.randn(4, 5)
    l[1, 2] = float("nan")
    l[3] = float("-inf")
    ref_o, ref_l = merge_states_n(o[:3], l[:3])  # state 3 is empty
    out, lse = merge_states_n(o, l)
    bad = torch.zeros(5, dtype=torch.bool)
    bad[2] = True
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert torch.allclose(out[~bad], ref_o[~bad]) and torch.allclose(lse[~bad], ref_l[~bad])
    out, lse = merge_states(o[1], l[1], *empty_state((5, D)))
    assert out[2].isnan().all() and lse[2].isnan() and not out[~bad].isnan().any()


def test_half_inputs_merge_in_float32():
    o = torch.randn(3, D).bfloat16()
    l = torch.randn(3).bfloat16()
    out, lse = merge_states(o, l, o, l)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.allclose(out, o.float()) and torch.allclose(lse, l.float() + math.log(2))


def test_extreme_differences():
    o1, o2 = torch.ones(1, D), -torch.ones(1, D)
    out, lse = merge_states(o1, torch.tensor([1e4]), o2, torch.tensor([-1e4]))
    assert torch.equal(out, o1) and lse.item() == 1e4
    out, lse = merge_states(o1, torch.tensor([5000.0]), o2, torch.tensor([5000.0]))
    assert torch.allclose(out, torch.zeros(1, D)) and abs(lse.item() - (5000 + math.log(2))) < 1e-3


def test_n_ary_empty_and_shape_error():
    out, lse = merge_states_n(torch.zeros(0, 2, D), torch.zeros(0, 2))
    assert out.shape == (2, D) and torch.isneginf(lse).all() and (out == 0).all()
    with pytest.raises(ValueError, match="out.shape"):
        merge_states_n(torch.zeros(3, 2, D), torch.zeros(3, 4))


def test_tree_reduce_depth():
    for p in range(1, 20):
        total, depth = tree_reduce([torch.tensor(float(i)) for i in range(p)], torch.add)
        assert total.item() == p * (p - 1) / 2 and depth == math.ceil(math.log2(p))


def test_bad_arguments_are_named():
    o, l = torch.randn(3, D), torch.randn(3)
    with pytest.raises(ValueError, match=r"merge_states: .* lse_a \(3,\), out_b \(3, 8\), lse_b \(3, 1\)"):
        merge_states(o, l, o, l[:, None])
    out, lse = merge_states(o, l, o[:1], torch.tensor(0.5))  # broadcastable states still merge
    assert out.shape == (3, D) and lse.shape == (3,)
    with pytest.raises(TypeError, match="merge_states: lse_a must be a torch.Tensor, got list"):
        merge_states(o, l.tolist(), o, l)
    with pytest.raises(TypeError, match="torch.stack a list first"):
        merge_states_n([o, o], [l, l])
    with pytest.raises(TypeError, match="merge_states: out_a must be a floating point tensor, got torch.int64"):
        merge_states(o.long(), l, o, l)  # integer outputs would be silently averaged as floats
    with pytest.raises(TypeError, match="floating point"):
        merge_states_n(torch.stack([o, o]), torch.stack([l, l]).int())


@settings(max_examples=100, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["finite", "-inf", "+inf", "nan", "far"]), min_size=2, max_size=2),
    seed=st.integers(0, 2**16),
    half=st.booleans(),
)
def test_merge_into_equals_merge_states(kinds, seed, half):
    """The in-place merge of the prefill's hot path gives merge_states' result bit for bit in
    meaning: empty states (±inf lse, NaN out) count nothing, NaN propagates, far lse are stable."""
    from treeattn.ops.state import merge_into

    g = torch.Generator().manual_seed(seed)
    rows = 6
    states = []
    for kind in kinds:
        out = torch.randn(rows, D, generator=g)
        lse = torch.randn(rows, generator=g) * 3
        pick = torch.rand(rows, generator=g) < 0.5  # the kind applies to some rows only
        special = {"-inf": NEG, "+inf": math.inf, "nan": math.nan, "far": 1e4, "finite": None}[kind]
        if special is not None:
            lse = lse.masked_fill(pick, special)
        if kind in ("-inf", "+inf"):
            out = out.masked_fill(pick[:, None], math.nan)  # an empty state's out is ignored
        states.append((out, lse))
    (oa, la), (ob, lb) = states
    want_o, want_l = merge_states(oa, la, ob, lb)
    acc_o, acc_l, ob0 = oa.clone(), la.clone(), ob.clone()
    merge_into(acc_o, acc_l, ob.to(torch.bfloat16) if half else ob, lb)
    if half:
        want_o, want_l = merge_states(oa, la, ob.to(torch.bfloat16), lb)
    torch.testing.assert_close(acc_l, want_l, equal_nan=True, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc_o, want_o, equal_nan=True, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ob, ob0, equal_nan=True, rtol=0, atol=0)  # the second state is not written


@settings(max_examples=150, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["finite", "-inf", "+inf", "nan", "far", "nan-out"]), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    rows=st.integers(0, 7),
    dv=st.integers(1, 70),
)
def test_merge_packed_equals_merge_states_n(kinds, seed, rows, dv):
    """The packed merge of the all-gather reduction (the C kernel on CPU, when built) is
    merge_states_n: empty states' NaN out ignored, NaN lse propagates to its rows, all-empty
    rows (0, -inf), far lse stable; and it matches the float64 merge."""
    from treeattn.ops._decode_cpu import kernel_available
    from treeattn.ops.packed import merge_packed

    assert kernel_available()  # else this tests the fallback against itself
    g = torch.Generator().manual_seed(seed)
    outs, lses = [], []
    for kind in kinds:
        out = torch.randn(2, rows, dv, generator=g)
        lse = torch.randn(2, rows, generator=g) * 3
        pick = torch.rand(2, rows, generator=g) < 0.5
        special = {"-inf": NEG, "+inf": math.inf, "nan": math.nan, "far": 1e4}.get(kind)
        if special is not None:
            lse = lse.masked_fill(pick, special)
        if kind in ("-inf", "+inf"):
            out = out.masked_fill(pick[..., None], math.nan)  # an empty state's out is ignored
        if kind == "nan-out":  # a value NaN reaches its row's out, not its lse
            out = out.masked_fill(pick[..., None] & (torch.arange(dv) == 0), math.nan)
        outs.append(out)
        lses.append(lse)
    buf = torch.cat([torch.stack(outs), torch.stack(lses)[..., None]], -1).contiguous()
    got_o, got_l = merge_packed(buf)
    want_o, want_l = merge_states_n(buf[..., :-1], buf[..., -1])
    assert got_o.dtype == got_l.dtype == torch.float32 and got_o.shape == (2, rows, dv)
    torch.testing.assert_close(got_l, want_l, equal_nan=True, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_o, want_o, equal_nan=True, rtol=1e-5, atol=1e-6)
    o64, l64 = merge_states_n(buf[..., :-1].double(), buf[..., -1].double())
    torch.testing.assert_close(got_l.double(), l64, equal_nan=True, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_o.double(), o64, equal_nan=True, rtol=1e-5, atol=1e-6)
