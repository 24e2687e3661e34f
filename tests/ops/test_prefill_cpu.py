"""The float32 AVX-512 prefill kernel (``treeattn.ops._prefill_cpu``) against float64 attention
on the full K/V (flash-attn's 2x rule), its fallbacks, and its use by ``causal_states``."""

from __future__ import annotations

import pytest
import torch

import treeattn.parallel.prefill as P
from reference import max_err, naive_attention, reference
from treeattn.ops import _prefill_cpu as PC
from treeattn.ops import causal as CA
from treeattn.ops._decode_cpu import kernel_features

pytestmark = pytest.mark.skipif(
    "prefill512" not in kernel_features(), reason="the prefill kernel needs AVX-512 and a C compiler"
)


def bounds(kind: str, T: int, S: int, g: torch.Generator):
    i = torch.arange(T)
    if kind == "none":
        return None, None
    end = (S - T + i + 1).clamp(0, S)  # causal, the queries at the end
    if kind == "causal":
        return None, end
    if kind == "window":
        return (end - 40).clamp(0, S), end
    lo = torch.randint(0, S + 1, (T,), generator=g)  # random ranges, some empty (lo >= hi)
    return lo, torch.randint(0, S + 1, (T,), generator=g)


def check(out, lse, q, k, v, lo, hi):
    T, S = q.shape[2], k.shape[2]
    j = torch.arange(S)
    vis = torch.ones(T, S, dtype=torch.bool)
    if lo is not None:
        vis &= j[None, :] >= lo[:, None]
    if hi is not None:
        vis &= j[None, :] < hi[:, None]
    vis = vis.expand(q.shape[0], T, S)
    ro, rl = reference(q, k, v, mask=vis)
    po, pl = naive_attention(q, k, v, mask=vis)
    e, ep = max_err(out, ro), max_err(po, ro)
    assert e <= 2 * ep + 1e-6, f"out error {e:.3g} > 2 x plain torch {ep:.3g}"
    e, ep = max_err(lse, rl), max_err(pl, rl)
    assert e <= 2 * ep + 1e-5, f"lse error {e:.3g} > 2 x plain torch {ep:.3g}"
    empty = ~vis.any(-1)  # [B, T]: exactly 0 and -inf
    assert bool((out.permute(0, 2, 1, 3)[empty] == 0).all())
    assert bool(torch.isneginf(lse.permute(0, 2, 1)[empty]).all())


@pytest.mark.parametrize("heads,D,Dv", [((9, 3), 64, 64), ((4, 4), 80, 128), ((8, 2), 128, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_against_float64(monkeypatch, heads, D, Dv, threads):
    """Every bound kind, row blocks and key blocks with tails, strided K/V (slices of a larger
    cache), two sequences, 1 and 2 threads."""
    monkeypatch.setattr(PC, "_MIN_WORK", 0)
    monkeypatch.setattr(PC, "_MIN_FILL", 0)
    g = torch.Generator().manual_seed(D + Dv + heads[0])
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for T in (1, 33, 70):
            for S in (1, 97, 300):
                q = torch.randn(2, heads[0], T, D, generator=g) * 2
                kbig = torch.randn(2, heads[1], S + 9, D, generator=g)
                vbig = torch.randn(2, heads[1], S + 9, Dv, generator=g)
                k, v = kbig[:, :, 4 : 4 + S], vbig[:, :, 4 : 4 + S]
                for kind in ("none", "causal", "window", "random"):
                    lo, hi = bounds(kind, T, S, g)
                    st = PC.prefill_states(q, k, v, lo, hi, None, None, "auto")
                    assert st is not None, (T, S, kind)
                    assert st[0].shape == (2, heads[0], T, Dv) and st[0].dtype == torch.float32
                    check(*st, q, k, v, lo, hi)
    finally:
        torch.set_num_threads(n)


def test_fallbacks_and_nonfinite(monkeypatch):
    monkeypatch.setattr(PC, "_MIN_WORK", 0)
    monkeypatch.setattr(PC, "_MIN_FILL", 0)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 6, 40, 64, generator=g), torch.randn(1, 2, 90, 64, generator=g), torch.randn(1, 2, 90, 64)
    end = torch.arange(40) + 51
    run = lambda *a, **kw: PC.prefill_states(*a, **kw)  # noqa: E731
    assert run(q, k, v, None, end, None, None, "auto") is not None
    assert run(q.double(), k.double(), v.double(), None, end, None, None, "auto") is None
    assert run(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, end, None, None, "auto") is None
    assert run(q, k, v, None, end, None, 5.0, "auto") is None  # softcap
    assert run(q, k, v, None, end, None, None, "flash_cpu") is None  # an explicit backend
    assert run(q, k, v[..., :48], None, end, None, None, "auto") is None  # Dv % 64
    monkeypatch.setattr(PC, "_MIN_WORK", 10**9)
    assert run(q, k, v, None, end, None, None, "auto") is None  # too small to pay off
    monkeypatch.setattr(PC, "_MIN_WORK", 0)
    monkeypatch.setattr(PC, "_MIN_FILL", 0.8)
    assert run(q, k, v, None, end, None, None, "auto") is None  # 40 of 64 rows real
    assert run(q[:, :, :32], k, v, None, end[:32], None, None, "auto") is not None
    monkeypatch.setenv("TREEATTN_PREFILL_KERNEL", "0")
    assert run(q[:, :, :32], k, v, None, end[:32], None, None, "auto") is None
    monkeypatch.delenv("TREEATTN_PREFILL_KERNEL")
    monkeypatch.setattr(PC, "_MIN_FILL", 0)
    assert run(q, k[..., :32], v, None, end, None, None, "auto") is None  # head dims differ
    assert run(q, k, v[:, :, :80], None, end, None, None, "auto") is None  # fewer values than keys
    assert run(q, k[:, :1], v, None, end, None, None, "auto") is None  # kv heads differ
    qg = q.clone().requires_grad_()
    assert run(qg, k, v, None, end, None, None, "auto") is None  # autograd: PyTorch's path
    with torch.no_grad():
        assert run(qg, k, v, None, end, None, None, "auto") is not None
    bad = k.clone()
    bad[0, 1, 60] = float("nan")  # a key some rows see: PyTorch's path
    assert run(q, bad, v, None, end, None, None, "auto") is None
    bad = v.clone()
    bad[0, 0, 60] = float("nan")  # a value only the later rows see: PyTorch's path
    assert run(q, k, bad, None, end, None, None, "auto") is None
    lo, hi = torch.zeros(40, dtype=torch.int64), end.clone()
    lo[3], hi[5], hi[6] = 2**32 + 1, -5, 2**33  # out of [0, S]: empty, empty, all keys
    st = run(q, k, v, lo, hi, None, None, "auto")
    check(*st, q, k, v, lo.clamp(0, 90), hi.clamp(0, 90))
    lo[:], hi[:] = 5, 5  # no row reads a key: nothing to check for finiteness
    bad = v.clone()
    bad[:] = float("nan")
    o, lse = run(q, k, bad, lo, hi, None, None, "auto")
    assert bool((o == 0).all()) and bool(torch.isneginf(lse).all())
    qt = torch.randn(1, 40, 6, 64, generator=g).transpose(1, 2)  # non-contiguous q
    kt = torch.randn(1, 2, 64, 90, generator=g).transpose(2, 3)  # keys with stride(-1) != 1
    check(*run(qt, kt, v, None, end, None, None, "auto"), qt, kt, v, None, end)
    bad = v.clone()
    bad[0, 0, 89:] = float("inf")  # beyond every row's end: never read, the kernel runs
    st = run(q, k, bad, None, end - 2, None, None, "auto")
    assert st is not None and bool(torch.isfinite(st[0]).all())
    check(*st, q, k, v, None, end - 2)
    qn = q.clone()
    qn[0, 4, 7] = float("nan")  # a NaN query row: NaN out and lse for that row only
    o, lse = run(qn, k, v, None, end, None, None, "auto")
    assert bool(o[0, 4, 7].isnan().all()) and bool(lse[0, 4, 7].isnan())
    o[0, 4, 7], lse[0, 4, 7] = 0.0, 0.0
    assert bool(torch.isfinite(o).all() and torch.isfinite(lse).all())


@pytest.mark.parametrize("kind,window", [("contiguous", None), ("contiguous", 37), ("interleaved", None)])
def test_causal_states_takes_the_kernel(monkeypatch, kind, window):
    """A prefill chunk (queries at positions [96, 224) over keys [0, 224) of one rank's shard)
    goes to the kernel in one call, and equals both the float64 reference and PyTorch's path."""
    from treeattn.cache import Placement

    pl = Placement(kind, 2, 4)
    pos = pl.prompt_positions(0, 448)
    kpos, qpos = pos[pos < 224], pos[(pos >= 96) & (pos < 224)]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, len(qpos), 64, generator=g)
    k, v = torch.randn(1, 3, len(kpos), 64, generator=g), torch.randn(1, 3, len(kpos), 64, generator=g)
    monkeypatch.setattr(PC, "_MIN_WORK", 0)
    monkeypatch.setattr(PC, "_MIN_FILL", 0)
    calls, real = [], CA.prefill_states

    def spy(*a):
        st = real(*a)
        calls.append(st is not None)
        return st

    monkeypatch.setattr(CA, "prefill_states", spy)
    out, lse = P.causal_states(q, k, v, qpos, kpos, window=window)
    assert calls == [True]
    vis = kpos[None, :] <= qpos[:, None]
    if window is not None:
        vis &= kpos[None, :] > qpos[:, None] - window
    ro, rl = reference(q, k, v, mask=vis[None])
    po, pl_ = naive_attention(q, k, v, mask=vis[None])
    assert max_err(out, ro) <= 2 * max_err(po, ro) + 1e-6
    assert max_err(lse, rl) <= 2 * max_err(pl_, rl) + 1e-5
    monkeypatch.setattr(CA, "prefill_states", lambda *a: None)  # PyTorch's path: the same result
    o2, l2 = P.causal_states(q, k, v, qpos, kpos, window=window)
    assert max_err(out, o2) < 1e-5 and max_err(lse, l2) < 1e-5
