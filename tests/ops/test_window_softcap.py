"""attention_with_lse with kv_start (sliding-window lower bound) and softcap vs float64."""

import itertools

import pytest
import torch

from reference import max_err
from treeattn import attention_with_lse
from treeattn.ops.attention import attention_state


def make(B, Hq, Hkv, Tq, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, D, generator=g).to(dtype) * 2  # larger scores: the softcap matters
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k, v


def plain(q, k, v, *, kv_lens=None, causal=False, kv_start=None, softcap=None, scale=None):
    """Plain attention in the inputs' dtype (float64 inputs: the reference); (0, -inf) rows."""
    B, Hq, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    L = torch.full((B,), S) if kv_lens is None else kv_lens
    hi = L.view(B, 1, 1, 1) + (torch.arange(Tq).view(1, 1, Tq, 1) - Tq + 1 if causal else 0)
    lo = torch.zeros(B, 1, Tq, 1, dtype=torch.int64)
    if kv_start is not None:
        lo = (kv_start.view(B, 1, 1, 1) if kv_start.ndim == 1 else kv_start.view(B, 1, Tq, 1)).expand(B, 1, Tq, 1)
    j = torch.arange(S)
    s = s.masked_fill(~((j >= lo) & (j < hi)), float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, lse


def check(out, lse, q, k, v, **kw):
    ref_o, ref_l = plain(q.double(), k.double(), v.double(), **kw)
    pt_o, pt_l = plain(q, k, v, **kw)
    e, pe = max_err(out, ref_o), max_err(pt_o, ref_o)
    assert e <= 2 * pe + 1e-6, f"out error {e:.3g} > 2 x plain-torch {pe:.3g}"
    e, pe = max_err(lse, ref_l), max_err(pt_l, ref_l)
    assert e <= 2 * pe + 1e-5, f"lse error {e:.3g} > 2 x plain-torch {pe:.3g}"
    empty = torch.isneginf(ref_l)
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())


# (B, Hq, Hkv, Tq, causal, ragged, start mode, softcap)
GRID = list(
    itertools.product(
        [(1, 8, 2), (3, 6, 3), (2, 4, 1)],
        [1, 2, 4],
        [False, True],  # causal
        [False, True],  # ragged kv_lens
        ["none", "seq", "row", "hidden"],  # kv_start: absent, [B], [B, Tq], rows with nothing visible
        [None, 5.0],
    )
)


def starts(mode, B, Tq, S, lens, g):
    if mode == "none":
        return None
    if mode == "seq":
        return torch.randint(0, S + 1, (B,), generator=g).clamp(max=S)
    if mode == "row":  # a sliding window per query: start grows with the query
        base = torch.randint(0, max(1, S - Tq), (B, 1), generator=g)
        return (base + torch.arange(Tq)).clamp(max=S)
    st = torch.zeros(B, Tq, dtype=torch.int64)  # every key hidden for query 0 (start = the length)
    st[:, 0] = lens if lens is not None else S
    st[:, 1:] = 3
    return st


@pytest.mark.parametrize("backend", ["torch", "flash_cpu", "auto"])
def test_grid_float32(backend):
    S, D = 29, 16
    for n, ((B, Hq, Hkv), Tq, causal, ragged, mode, cap) in enumerate(GRID):
        q, k, v = make(B, Hq, Hkv, Tq, S, D, seed=n)
        g = torch.Generator().manual_seed(1000 + n)
        lens = torch.tensor([S, 0, 11][:B]) if ragged else None
        if ragged and B == 1:
            lens = torch.tensor([13])
        st = starts(mode, B, Tq, S, lens, g)
        kw = dict(kv_lens=lens, causal=causal, kv_start=st, softcap=cap)
        out, lse = attention_with_lse(q, k, v, backend=backend, **kw)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        try:
            check(out, lse, q, k, v, **kw)
        except AssertionError as e:
            raise AssertionError(f"case {n}: B,Hq,Hkv={B, Hq, Hkv} Tq={Tq} causal={causal} lens={lens} "
                                 f"start={st} cap={cap}: {e}") from None  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "flash_cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("cap", [None, 20.0, 2.0])
def test_dtypes(backend, dtype, cap):
    q, k, v = make(3, 8, 2, 3, 300, 64, dtype=dtype, seed=4)
    lens = torch.tensor([300, 0, 170])
    st = torch.tensor([[250, 251, 252], [0, 0, 0], [170, 5, 100]])  # sequence 2, query 0: nothing visible
    out, lse = attention_with_lse(q, k, v, kv_lens=lens, causal=True, kv_start=st, softcap=cap, backend=backend)
    assert out.dtype == dtype
    check(out, lse, q, k, v, kv_lens=lens, causal=True, kv_start=st, softcap=cap)


def test_skipped_keys_are_never_read():
    """Keys below kv_start (and at/after kv_lens) may hold NaN: they are neither computed
    nor allowed to leak through 0 x NaN, on either backend."""
    q, k, v = make(2, 4, 2, 2, 40, 16, seed=9)
    st, lens = torch.tensor([10, 25]), torch.tensor([30, 40])
    clean = attention_with_lse(q, k, v, kv_lens=lens, kv_start=st, backend="torch")
    kb, vb = k.clone(), v.clone()
    kb[0, :, :10], vb[0, :, :10] = float("nan"), float("inf")
    kb[1, :, :25], vb[1, :, :25] = float("inf"), float("nan")
    kb[0, :, 30:], vb[0, :, 30:] = float("nan"), float("nan")
    for backend in ("torch", "flash_cpu"):
        for cap in (None, 3.0):
            ref = attention_with_lse(q, k, v, kv_lens=lens, kv_start=st, softcap=cap, backend="torch")
            out, lse = attention_with_lse(q, kb, vb, kv_lens=lens, kv_start=st, softcap=cap, backend=backend)
            assert torch.isfinite(out).all() and torch.isfinite(lse).all(), backend
            torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(clean[0]).all()


def test_window_on_long_context_reads_only_the_window(monkeypatch):
    """A window of 64 keys out of 20000: the kernel sees a 64-key slice (no full-S work)."""
    import treeattn.ops.dispatch as A

    seen = []
    real = A._chunked

    def spy(qg, k, *a, **kw):
        seen.append(k.shape[2])
        return real(qg, k, *a, **kw)

    monkeypatch.setattr(A, "_chunked", spy)
    q, k, v = make(1, 4, 2, 1, 20000, 16, seed=2)
    st = torch.tensor([20000 - 64])
    out, lse = attention_with_lse(q, k, v, kv_start=st, softcap=30.0, backend="torch")
    assert seen == [64]
    check(out, lse, q, k, v, kv_start=st, softcap=30.0)
    # every key hidden: the empty state without a kernel call
    out, lse = attention_with_lse(q, k, v, kv_start=torch.tensor([20000]), backend="torch")
    assert seen == [64] and bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_internal_kv_end_and_mask():
    """The prefill's per-query upper bound (kv_end) and a dense mask combine with kv_start."""
    q, k, v = make(2, 6, 3, 5, 23, 16, seed=5)
    st = torch.tensor([[0, 2, 4, 6, 8], [3, 3, 3, 3, 3]])
    end = torch.tensor([[5, 7, 9, 11, 13], [2, 23, 23, 10, 0]])
    m = torch.rand(1, 5, 23, generator=torch.Generator().manual_seed(1)) > 0.3
    j = torch.arange(23)
    vis = (j >= st[:, :, None]) & (j < end[:, :, None]) & m
    for backend in ("torch", "flash_cpu"):
        for cap in (None, 4.0):
            out, lse = attention_state(q, k, v, kv_start=st, kv_end=end, mask=m, softcap=cap, backend=backend)
            # reference: dense mask [B, Tq, S]
            qd, kd, vd = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
            s = (qd @ kd.transpose(-1, -2)) * 16**-0.5
            if cap:
                s = torch.tanh(s / cap) * cap
            s = s.masked_fill(~vis[:, None], float("-inf"))
            rl = torch.logsumexp(s, -1)
            ro = torch.softmax(s, -1).nan_to_num(0.0) @ vd
            assert max_err(out, ro) < 1e-5 and max_err(lse, rl) < 1e-5, backend


def test_bad_arguments():
    q, k, v = make(2, 4, 2, 3, 10, 16)
    with pytest.raises(ValueError, match="kv_start must be an integer tensor"):
        attention_with_lse(q, k, v, kv_start=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_start must be an integer tensor"):
        attention_with_lse(q, k, v, kv_start=torch.zeros(2))
    with pytest.raises(ValueError, match=r"kv_start must lie in \[0, S=10\]"):
        attention_with_lse(q, k, v, kv_start=torch.tensor([0, 11]))
    with pytest.raises(TypeError, match="kv_start"):
        attention_with_lse(q, k, v, kv_start=[0, 1])
    for bad in (0.0, -1.0, float("inf"), True, "5"):
        with pytest.raises(ValueError, match="softcap"):
            attention_with_lse(q, k, v, softcap=bad)
