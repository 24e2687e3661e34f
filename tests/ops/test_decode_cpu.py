import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import treeattn.ops._decode_cpu as DC
from reference import assert_within_tolerance, max_err
from treeattn import attention_with_lse
from treeattn.ops._decode_cpu import decode_cpu, decode_torch


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    # one build per session in a private cache dir (the session-wide lib stays loaded)
    d = tmp_path_factory.getbasetemp() / "kcache"
    monkeypatch.setenv("TREEATTN_CACHE_DIR", str(d))


def make(B, Hkv, G, Tq, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, Tq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    return q, k, v


def test_kernel_builds():
    assert DC.kernel_available(), DC.kernel_info()


GRID = list(
    itertools.product(
        [torch.float32, torch.bfloat16, torch.float16],
        [1, 3, 8],  # G
        [64, 80, 128],  # D
        [1, 3, 8],  # Tq
    )
)


@pytest.mark.parametrize("dtype,G,D,Tq", GRID)
def test_grid_vs_float64(dtype, G, D, Tq):
    """attention_with_lse(backend='decode_cpu'), ragged lengths incl. 0, causal and not,
    against the float64 reference with flash-attn's 2x-plain-torch rule."""
    S = 150
    q, k, v = make(3, 2, G, Tq, S, D, dtype, seed=G * 1000 + D + Tq)
    kv_lens = torch.tensor([S, 0, 77])
    for causal in (False, True):
        out, lse = attention_with_lse(q, k, v, kv_lens=kv_lens, causal=causal, backend="decode_cpu")
        assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape
        assert_within_tolerance(out, lse, q, k, v, kv_lens=kv_lens, causal=causal)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def ref_rows(qg, k, v, scale, lo, hi, softcap):
    """float64 [B, H, R] reference with per-row [lo, hi) and softcap."""
    q, k, v = qg.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(k.shape[2])
    vis = (j >= lo[:, None, :, None]) & (j < hi[:, None, :, None])
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.masked_fill(~vis.any(2).unsqueeze(-1), 0.0), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_lo_hi_softcap_threads(dtype, threads, softcap, monkeypatch):
    monkeypatch.setattr(DC, "_MIN_BYTES_PER_THREAD", 0)  # let 2 threads split a small S
    B, H, R, S, D = 2, 3, 6, 3000, 64
    g = torch.Generator().manual_seed(threads + (softcap is None))
    qg = torch.randn(B, H, R, D, generator=g) * 2
    k = torch.randn(B, H, S, D, generator=g).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    lo = torch.randint(0, S // 2, (B, R), generator=g)
    hi = torch.randint(S // 2, S + 1, (B, R), generator=g)
    hi[0, 0], lo[1, 2], hi[1, 2] = lo[0, 0], -5, 10_000  # an empty row; out-of-range bounds clip
    k_nan, v_nan = k.clone(), v.clone()
    vis = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        for r in range(R):
            vis[b, max(0, lo[b, r]) : min(S, hi[b, r])] = True
    k_nan[~vis.view(B, 1, S, 1).expand_as(k)] = float("nan")
    v_nan[~vis.view(B, 1, S, 1).expand_as(v)] = float("nan")
    o, l = decode_cpu(qg, k_nan, v_nan, 0.125, lo, hi, softcap, threads=threads)
    ro, rl = ref_rows(qg, k, v, 0.125, lo.clamp(0, S), hi.clamp(0, S), softcap)
    # plain torch in the same dtype, as the error yardstick
    po, pl = decode_torch(qg.to(dtype), k, v, 0.125, lo, hi, softcap)
    tol_o = 2 * max(max_err(po.to(dtype), ro), 1e-6) + 1e-6
    assert max_err(o, ro) <= tol_o
    assert max_err(l, rl) <= 2 * max(max_err(pl, rl), 1e-6) + 1e-5
    assert torch.isneginf(l[0, :, 0]).all() and (o[0, :, 0] == 0).all()
    # bitwise the same with clean keys (nothing outside [lo, hi) was used)
    o2, l2 = decode_cpu(qg, k, v, 0.125, lo, hi, softcap, threads=threads)
    assert torch.equal(o, o2) and torch.equal(l, l2)


def test_gap_between_row_ranges_is_never_read():
    """Rows see [0, 100) and [200, 300): keys 100..199 hold NaN and are not read."""
    for dtype in (torch.float32, torch.bfloat16):
        qg = torch.randn(1, 2, 2, 32)
        k, v = torch.randn(1, 2, 300, 32).to(dtype), torch.randn(1, 2, 300, 32).to(dtype)
        lo, hi = torch.tensor([[0, 200]]), torch.tensor([[100, 300]])
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 100:200] = float("nan")
        v2[:, :, 100:200] = float("nan")
        o, l = decode_cpu(qg, k2, v2, 0.2, lo, hi)
        ro, rl = ref_rows(qg, k, v, 0.2, lo, hi, None)
        assert torch.isfinite(o).all()
        assert max_err(o, ro) < 1e-2 and max_err(l, rl) < 1e-4


@pytest.mark.parametrize("dtype,R", [(torch.float32, 4), (torch.bfloat16, 1), (torch.bfloat16, 4)])
def test_threads_split_matches_one_thread(monkeypatch, dtype, R):
    monkeypatch.setattr(DC, "_MIN_BYTES_PER_THREAD", 0)
    monkeypatch.setattr(DC, "_SPLIT", 64)
    qg = torch.randn(1, 1, R, 64)
    k, v = torch.randn(1, 1, 5000, 64).to(dtype), torch.randn(1, 1, 5000, 64).to(dtype)
    o1, l1 = decode_cpu(qg, k, v, 0.1, threads=1)
    for t in (2, 3, 7):
        o, l = decode_cpu(qg, k, v, 0.1, threads=t)
        assert torch.equal(o, o1) and torch.equal(l, l1)  # the same splits, merged in the same order
    ro, rl = ref_rows(qg, k, v, 0.1, torch.zeros(1, R, dtype=torch.long), torch.full((1, R), 5000), None)
    assert max_err(o1, ro) < 1e-5 and max_err(l1, rl) < 1e-5


@pytest.mark.parametrize("dtype,R", [(torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 3), (torch.bfloat16, 8)])
def test_a_sequences_bits_do_not_depend_on_threads_other_sequences_or_padding(monkeypatch, dtype, R):
    """A sequence of 2,300 keys (three splits of 1,024) alone on one thread, then alone and in
    calls of 3 and 5 sequences, S padded to 3,600, on 1-3 threads: the same bits (a batched
    server's rows read their keys as one request alone does, with any number of threads)."""
    monkeypatch.setattr(DC, "_MIN_BYTES_PER_THREAD", 0)
    monkeypatch.setattr(DC, "_SPLIT", 1024)
    g = torch.Generator().manual_seed(R)
    n, S = 2300, 3600
    q = torch.randn(5, 1, R, 64, generator=g)
    k, v = (torch.randn(5, 1, S, 64, generator=g).to(dtype) for _ in range(2))
    lo = torch.zeros(5, R, dtype=torch.long)
    hi = torch.tensor([n, 3000, 300, 3600, 1100]).view(5, 1).expand(5, R).contiguous()
    lo[:, -1] = 700  # the last row starts in the first split and ends in the third
    o1, l1 = decode_cpu(q[:1], k[:1, :, :n], v[:1, :, :n], 0.125, lo[:1], hi[:1], threads=1)
    for B in (1, 3, 5):
        for t in (1, 2, 3):
            o, l = decode_cpu(q[:B], k[:B], v[:B], 0.125, lo[:B], hi[:B], threads=t)
            assert torch.equal(o[:1], o1) and torch.equal(l[:1], l1), (B, t)
    ro, rl = ref_rows(q[:1], k[:1, :, :n], v[:1, :, :n], 0.125, lo[:1], hi[:1], None)
    assert max_err(o1, ro) < (1e-2 if dtype == torch.bfloat16 else 1e-5) and max_err(l1, rl) < 1e-4


@pytest.mark.parametrize("dtype,R", [(torch.float32, 4), (torch.bfloat16, 1), (torch.bfloat16, 4)])
@pytest.mark.parametrize("fallback", [False, True])
def test_nan_key_in_one_split_poisons_its_rows(monkeypatch, dtype, R, fallback):
    """A NaN key in one thread's part of S (or in the pure-PyTorch fallback) makes the rows
    that see it NaN after the merge of the parts; rows that do not see it stay exact."""
    monkeypatch.setattr(DC, "_MIN_BYTES_PER_THREAD", 0)
    monkeypatch.setattr(DC, "_SPLIT", 64)
    if fallback:
        monkeypatch.setattr(DC, "_state", {})
        monkeypatch.setenv("TREEATTN_NO_CKERNEL", "1")
    qg = torch.randn(1, 2, R, 64)
    k, v = torch.randn(1, 2, 5000, 64).to(dtype), torch.randn(1, 2, 5000, 64).to(dtype)
    k[0, 0, 3900, 7] = float("nan")
    lo, hi = torch.zeros(1, R, dtype=torch.long), torch.full((1, R), 5000)
    hi[0, 0] = 3900  # row 0 stops just before the NaN key
    ro, rl = ref_rows(qg[:, 1:], k[:, 1:], v[:, 1:], 0.1, lo, hi, None)
    for t in (1, 3):
        o, l = decode_cpu(qg, k, v, 0.1, lo, hi, threads=t)
        assert o[0, 0, 1:].isnan().all() and l[0, 0, 1:].isnan().all()
        assert torch.isfinite(o[0, 0, 0]).all() and torch.isfinite(l[0, 0, 0])
        assert max_err(o[:, 1:], ro) < 1e-2 and max_err(l[:, 1:], rl) < 1e-4
    k[0, 0, 4000:] = float("nan")  # a whole split of NaN keys: its running max stays -inf
    for t in (1, 3):
        o, l = decode_cpu(qg, k, v, 0.1, lo, hi, threads=t)
        assert o[0, 0, 1:].isnan().all() and l[0, 0, 1:].isnan().all() and torch.isfinite(l[0, 0, 0])


def test_strided_cache_slices_and_empty():
    """k/v as slices of a larger [B, S, H, D] cache (strided over S and H), and S = 0."""
    cache_k, cache_v = torch.randn(2, 500, 4, 64), torch.randn(2, 500, 4, 64)
    k, v = cache_k.transpose(1, 2)[:, :, :300], cache_v.transpose(1, 2)[:, :, :300]
    qg = torch.randn(2, 4, 3, 64)
    o, l = decode_cpu(qg, k, v, 0.1)
    o2, l2 = decode_cpu(qg, k.contiguous(), v.contiguous(), 0.1)
    assert torch.allclose(o, o2, atol=1e-6) and torch.allclose(l, l2, atol=1e-6)
    o, l = decode_cpu(qg, k[:, :, :0], v[:, :, :0], 0.1)
    assert (o == 0).all() and torch.isneginf(l).all()


def test_value_dim_differs_and_float64_falls_back():
    qg = torch.randn(1, 2, 2, 64)
    k, v = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 48)
    o, l = decode_cpu(qg, k, v, 0.1)
    ro, rl = ref_rows(qg, k, v, 0.1, torch.zeros(1, 2, dtype=torch.long), torch.full((1, 2), 100), None)
    assert o.shape == (1, 2, 2, 48) and max_err(o, ro) < 1e-5 and max_err(l, rl) < 1e-5
    o, l = decode_cpu(qg.double(), k.double(), v.double(), 0.1)
    assert o.dtype == torch.float64 and max_err(o, ro) < 1e-12


def test_fallback_forced(monkeypatch):
    monkeypatch.setattr(DC, "_state", {})
    monkeypatch.setenv("TREEATTN_NO_CKERNEL", "1")
    assert not DC.kernel_available() and "TREEATTN_NO_CKERNEL" in DC.kernel_info()
    q, k, v = make(2, 2, 3, 2, 90, 64, torch.bfloat16, seed=4)
    kv_lens = torch.tensor([90, 0])
    out, lse = attention_with_lse(q, k, v, kv_lens=kv_lens, causal=True, backend="decode_cpu")
    assert_within_tolerance(out, lse, q, k, v, kv_lens=kv_lens, causal=True)


def test_no_compiler_falls_back(monkeypatch):
    monkeypatch.setattr(DC, "_state", {})
    monkeypatch.setattr(DC, "_compiler", lambda: None)
    assert not DC.kernel_available() and "no C compiler" in DC.kernel_info()
    q, k, v = make(1, 2, 2, 1, 50, 64, torch.float32)
    out, lse = attention_with_lse(q, k, v, backend="decode_cpu")
    assert_within_tolerance(out, lse, q, k, v)


def test_compile_cache_reused(tmp_path):
    """A fresh process builds into an empty cache dir; a second one loads the same file
    without compiling (no new file, mtime unchanged)."""
    code = "import treeattn.ops._decode_cpu as D; assert D.kernel_available(), D.kernel_info(); print(D.kernel_info())"
    env = dict(os.environ, TREEATTN_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TREEATTN_NO_CKERNEL", None)
    r1 = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r1.returncode == 0, r1.stderr
    files = sorted(Path(tmp_path).iterdir())
    assert len(files) == 1 and files[0].suffix == ".so"  # no temp files left behind
    mtime = files[0].stat().st_mtime_ns
    r2 = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0 and r2.stdout == r1.stdout
    assert sorted(Path(tmp_path).iterdir()) == files and files[0].stat().st_mtime_ns == mtime


def test_auto_picks_decode_cpu_for_decode_shapes():
    from treeattn.ops.kernels import pick as _pick_backend

    q, k, v = make(1, 8, 4, 1, 10, 64, torch.float32)
    assert _pick_backend(q, k, v) == "decode_cpu"
    q, k, v = make(1, 1, 8, 128, 10, 64, torch.float32)  # prefill-sized (1024 rows): GEMM kernel
    assert _pick_backend(q, k, v) == "flash_cpu"
    from treeattn.ops import kernel_features

    q, k, v = make(1, 3, 3, 16, 10, 64, torch.float32)  # 48 rows per KV head: a batched step of 16 rows
    assert _pick_backend(q, k, v) == ("decode_cpu" if "avx512" in kernel_features() else "flash_cpu")
    q, k, v = make(1, 3, 3, 17, 10, 64, torch.float32)  # 51, with bounds of their own
    assert _pick_backend(q, k, v) == "flash_cpu"
    q, k, v = make(1, 3, 3, 256, 10, 64, torch.float32)  # 768 seeing every key: a 256-token chunk reading a prefix
    assert _pick_backend(q, k, v, plain=True) == ("decode_cpu" if "avx512" in kernel_features() else "flash_cpu")
    q, k, v = make(1, 3, 3, 257, 10, 64, torch.float32)  # 771: past the widest measured
    assert _pick_backend(q, k, v, plain=True) == "flash_cpu"


def test_dense_mask_not_taken():
    from treeattn.ops.attention import attention_state

    q, k, v = make(1, 2, 2, 2, 40, 32, torch.float32)
    mask = torch.rand(1, 2, 40) > 0.3
    with pytest.raises(ValueError, match="no dense mask"):
        attention_state(q, k, v, mask=mask, backend="decode_cpu")
    out, lse = attention_state(q, k, v, mask=mask, backend="auto")  # auto routes around it
    assert_within_tolerance(out, lse, q, k, v, mask=mask)


def test_portable_build_without_native_flags(monkeypatch):
    """The generic C path (no -march=native: no AVX2 intrinsics) gives the same results."""
    monkeypatch.setattr(DC, "_state", {})
    monkeypatch.setattr(DC, "_FLAG_SETS", (["-O2"],))
    assert DC.kernel_available(), DC.kernel_info()
    for dtype, G, Tq, causal in [
        (torch.float32, 3, 2, True),
        (torch.bfloat16, 8, 1, False),
        (torch.float16, 1, 4, True),
    ]:
        q, k, v = make(2, 2, G, Tq, 200, 80, dtype, seed=G + Tq)
        kv_lens = torch.tensor([200, 31])
        out, lse = attention_with_lse(q, k, v, kv_lens=kv_lens, causal=causal, backend="decode_cpu")
        assert_within_tolerance(out, lse, q, k, v, kv_lens=kv_lens, causal=causal)


@pytest.mark.parametrize("R,D", [(4, 128), (6, 128), (8, 64), (12, 128)])
def test_bf16_queries_keep_float32_accuracy(R, D):
    """bf16 q with bf16 K/V (the AVX512-BF16 path where the CPU has it, else AVX2): the float32
    output stays float32-accurate (float32 weights times widened V); rounding the weights to
    one bf16 each, as flash-attn does for P.V, would give errors around 1e-4 here."""
    g = torch.Generator().manual_seed(R)
    B, H, S = 2, 2, 1000
    qg = (torch.randn(B, H, R, D, generator=g) * 2).to(torch.bfloat16)
    k = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
    lo = torch.tensor([[0] * R, [5] * R])
    hi = torch.tensor([[S] * R, [S - 7 - r for r in range(R)]])  # uniform rows, then ragged ones
    ref_o, ref_l = ref_rows(qg, k, v, D**-0.5, lo, hi, None)
    outs = []
    for q in (qg, qg.float()):  # bf16 q (dot products on bf16 pairs), float32 q (widened K)
        out, lse = decode_cpu(q, k, v, D**-0.5, lo, hi)
        assert (out.double() - ref_o).abs().max() < 1e-5, DC.kernel_features()
        assert (lse.double() - ref_l).abs().max() < 2e-5
        outs.append(out)
    # where the kernel has AVX512-BF16, bf16 queries really take the other path (other rounding)
    assert torch.equal(outs[0], outs[1]) != ("avx512bf16" in DC.kernel_features())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_groups_head_dims_and_tails(dtype):
    """The 4-row group path (AVX-512 where the CPU has it): head dims over one 128-float
    register tile and partial tiles, row counts with a remainder row, with three (run padded
    to a fourth row of zeros), key ranges that end mid-group and mid-block, rows that differ
    within a block; float64 reference."""
    S = 1000
    for D, R in [(32, 4), (96, 5), (160, 8), (256, 4), (192, 6), (64, 7), (96, 11), (64, 3)]:
        g = torch.Generator().manual_seed(D + R)
        qg = torch.randn(3, 2, R, D, generator=g).to(dtype)
        k = torch.randn(3, 2, S, D, generator=g).to(dtype)
        v = torch.randn(3, 2, S, D, generator=g).to(dtype)
        lo = torch.tensor([[0] * R, [5] * R, [3 * r for r in range(R)]])
        hi = torch.tensor([[S] * R, [S - 7] * R, [S - 61 - 5 * r for r in range(R)]])
        ref_o, ref_l = ref_rows(qg, k, v, D**-0.5, lo, hi, None)
        for q in (qg, qg.float()):
            out, lse = decode_cpu(q, k, v, D**-0.5, lo, hi)
            assert (out.double() - ref_o).abs().max() < 2e-5, (D, R, q.dtype)
            assert (lse.double() - ref_l).abs().max() < 2e-5, (D, R, q.dtype)


@pytest.mark.parametrize("D,Dv,R", [(16, 16, 2), (48, 16, 7), (16, 80, 1), (128, 48, 3), (48, 48, 1), (16, 16, 1)])
def test_bf16_tile_shapes(D, Dv, R):
    """bf16 K/V (the register tiles and the 1-row loop on AVX2-only CPUs): 16-dim tails, value
    dim != key dim, row counts off the 4- and 2-row tiles, uniform and differing rows; float64
    reference."""
    g = torch.Generator().manual_seed(D + Dv + R)
    B, H, S = 2, 2, 700
    qg = torch.randn(B, H, R, D, generator=g)
    k = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, H, S, Dv, generator=g).to(torch.bfloat16)
    lo = torch.tensor([[0] * R, [3 * r for r in range(R)]])
    hi = torch.tensor([[S] * R, [S - 9 - 70 * r for r in range(R)]])
    ref_o, ref_l = ref_rows(qg, k, v, D**-0.5, lo, hi, None)
    out, lse = decode_cpu(qg, k, v, D**-0.5, lo, hi)
    assert (out.double() - ref_o).abs().max() < 2e-5
    assert (lse.double() - ref_l).abs().max() < 2e-5


def test_bf16_tiles_where_measured():
    """The bf16 register tiles are built exactly for AVX2 CPUs without AVX-512 (where they were
    measured faster); test_grid_vs_float64 and test_row_groups_head_dims_and_tails run them there
    (uniform blocks, and blocks whose rows differ, which switch the accumulators' order)."""
    f = DC.kernel_features()
    assert ("bf16tiles" in f) == ("avx2" in f and "avx512" not in f), f


def test_auto_bf16_row_limit_follows_kernel_features(monkeypatch):
    from treeattn.ops.kernels import _DECODE_MAX_ROWS_BF16DP
    from treeattn.ops.kernels import pick as _pick_backend

    q, k, v = make(1, 2, 64, 1, 10, 128, torch.bfloat16)  # 64 rows per KV head
    monkeypatch.setattr(DC, "kernel_features", lambda: frozenset({"avx2", "avx512bf16"}))
    assert _pick_backend(q, k, v) == "decode_cpu"
    assert _pick_backend(*make(1, 2, 64, 1, 10, 80, torch.bfloat16)) == "flash_cpu"  # D % 32 != 0
    assert _pick_backend(*make(1, 1, 2 * _DECODE_MAX_ROWS_BF16DP, 1, 10, 128, torch.bfloat16)) == "flash_cpu"
    monkeypatch.setattr(DC, "kernel_features", lambda: frozenset({"avx2"}))
    assert _pick_backend(q, k, v) == "flash_cpu"


@pytest.mark.skipif("avx512" not in DC.kernel_features(), reason="row groups of 4 need the AVX-512 build")
@pytest.mark.parametrize("dtype,softcap,D", [(torch.float32, None, 64), (torch.float32, 30.0, 128),
                                             (torch.bfloat16, None, 64), (torch.bfloat16, 30.0, 128)])  # fmt: skip
def test_a_rows_bits_do_not_depend_on_the_other_rows_bounds(dtype, softcap, D):
    """GQA groups of 3 (a token's 3 rows, as a tail of its own): a token's result alone equals,
    bitwise, its result among tokens of other key ranges (windows, ends mid-block, a range
    nobody else has), in float32 and (with AVX512-BF16) bfloat16."""
    if dtype == torch.bfloat16 and "avx512bf16" not in DC.kernel_features():
        pytest.skip("bf16 row groups need AVX512-BF16")
    S, G, m = 700, 3, 7
    g = torch.Generator().manual_seed(D)
    k, v = (torch.randn(1, 2, S, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, 2, G, m, D, generator=g).to(dtype)  # rows g * m + i
    lo = torch.randint(0, S, (m,), generator=g)
    hi = torch.minimum(lo + torch.randint(1, S, (m,), generator=g), torch.tensor(S))
    lo[2], hi[2] = 0, S
    lo[3], hi[3] = lo[4], hi[4]
    out, lse = decode_cpu(q.reshape(1, 2, G * m, D), k, v, D**-0.5, lo.repeat(G)[None], hi.repeat(G)[None], softcap)
    out, lse = out.reshape(1, 2, G, m, D), lse.reshape(1, 2, G, m)
    for i in range(m):
        o1, l1 = decode_cpu(q[:, :, :, i], k, v, D**-0.5, lo[i].repeat(G)[None], hi[i].repeat(G)[None], softcap)
        assert torch.equal(o1, out[:, :, :, i]) and torch.equal(l1, lse[:, :, :, i]), (i, int(lo[i]), int(hi[i]))


@pytest.mark.skipif("avx512" not in DC.kernel_features(), reason="row groups of 4 need the AVX-512 build")
@pytest.mark.parametrize("dtype,D,Dv", [(torch.float32, 64, 64), (torch.float32, 128, 128), (torch.float32, 80, 80),
                                        (torch.float32, 64, 128), (torch.bfloat16, 64, 64),
                                        (torch.bfloat16, 128, 128)])  # fmt: skip
@pytest.mark.parametrize("ragged", [False, True])
def test_a_rows_bits_do_not_depend_on_how_many_rows_share_the_call(dtype, D, Dv, ragged):
    """Each of 9 rows alone (R = 1: MHA, one token) equals, bitwise, itself in calls of 2..9
    rows (tail rows after groups of 4, 2-3 rows, with and without the bf16 pad), every row
    seeing all keys or rows of their own ranges: a request of a GQA group of 1 or 2 gets the
    same bits batched as alone."""
    if dtype == torch.bfloat16 and "avx512bf16" not in DC.kernel_features():
        pytest.skip("bf16 row groups need AVX512-BF16")
    S, m = 700, 9
    g = torch.Generator().manual_seed(D + Dv)
    k, v = torch.randn(1, 2, S, D, generator=g).to(dtype), torch.randn(1, 2, S, Dv, generator=g).to(dtype)
    q = torch.randn(1, 2, m, D, generator=g).to(dtype)
    lo, hi = torch.zeros(m, dtype=torch.long), torch.full((m,), S)
    if ragged:
        lo = torch.randint(0, S, (m,), generator=g)
        hi = torch.minimum(lo + torch.randint(1, S, (m,), generator=g), torch.tensor(S))
        lo[2], hi[2] = 0, S
    alone = [decode_cpu(q[:, :, i : i + 1], k, v, D**-0.5, lo[i : i + 1][None], hi[i : i + 1][None]) for i in range(m)]
    for R in range(2, m + 1):
        out, lse = decode_cpu(q[:, :, :R], k, v, D**-0.5, lo[:R][None], hi[:R][None])
        for i in range(R):
            o1, l1 = alone[i]
            assert torch.equal(out[:, :, i : i + 1], o1) and torch.equal(lse[:, :, i : i + 1], l1), (R, i)
    ro, rl = ref_rows(q, k, v, D**-0.5, lo[None], hi[None], None)
    assert max_err(out, ro) < (1e-2 if dtype == torch.bfloat16 else 1e-5) and max_err(lse, rl) < 1e-4


@pytest.mark.skipif("avx512" not in DC.kernel_features(), reason="row groups of 4 need the AVX-512 build")
@pytest.mark.parametrize("qdtype,kdtype,D", [(torch.float32, torch.bfloat16, 64), (torch.bfloat16, torch.bfloat16, 48),
                                             (torch.float32, torch.float32, 40)])  # fmt: skip
def test_outside_the_groups_calls_of_3_rows_or_more_still_agree(qdtype, kdtype, D):
    """Where the groups of 4 do not run (bf16 K/V with float32 queries, head dims the groups do
    not take), tail rows run padded: a row's bits are the same in every call of 3 or more rows."""
    S, m = 300, 8
    g = torch.Generator().manual_seed(D)
    k, v = (torch.randn(1, 2, S, D, generator=g).to(kdtype) for _ in range(2))
    q = torch.randn(1, 2, m, D, generator=g).to(qdtype)
    full, lse = decode_cpu(q, k, v, D**-0.5)
    for R in range(3, m):
        o, l = decode_cpu(q[:, :, :R], k, v, D**-0.5)
        assert torch.equal(o, full[:, :, :R]) and torch.equal(l, lse[:, :, :R]), R


def test_no_rows_no_sequences_no_heads_and_zero_dv():
    """Empty calls give empty results (torch's empty tensors have no data pointer); Dv = 0 is
    a ValueError, not a failed allocation."""
    for shape in ((1, 2, 0, 64), (0, 2, 4, 64), (1, 0, 4, 64), (1, 2, 3, 64)):
        q, k = torch.randn(*shape), torch.randn(shape[0], shape[1], 10, 64)
        o, l = decode_cpu(q, k, k, 0.125)
        assert o.shape == shape and l.shape == shape[:3]
    with pytest.raises(ValueError, match="bad arguments"):
        decode_cpu(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 0), 0.125)


@pytest.mark.parametrize("R", [1, 4])
def test_a_negative_zero_stays_negative_in_a_wider_call(R, monkeypatch):
    """A row's output bits, sign of zero included, are the same alone (one split) and in a
    call whose padded S has many (the merge assigns the first split's part: 0 + -0.0 = +0.0)."""
    monkeypatch.setattr(DC, "_SPLIT", 1024)
    D, L, S = 64, 900, 5000
    q = torch.zeros(1, 1, R, D)
    q[..., 0] = 1
    k, v = torch.zeros(1, 1, L, D), torch.zeros(1, 1, L, D)
    k[0, 0, 0, 0] = 20.0  # key 0 takes all the weight: the others' -1e-45 values underflow to -0.0
    v[0, 0, :, 0] = -1e-45
    v[0, 0, 0, 0] = -0.0
    o1, l1 = decode_cpu(q, k, v, 1.0, threads=1)
    assert torch.signbit(o1[0, 0, 0, 0])
    k2, v2 = torch.zeros(2, 1, S, D), torch.zeros(2, 1, S, D)
    k2[0, :, :L], v2[0, :, :L] = k[0], v[0]
    o2, l2 = decode_cpu(torch.cat([q, q]), k2, v2, 1.0, None, torch.tensor([[L] * R, [S] * R]), threads=1)
    assert torch.equal(o1.view(torch.int32), o2[:1].view(torch.int32)) and torch.equal(l1, l2[:1])
