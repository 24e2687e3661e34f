"""The Triton split-KV kernel (backend "triton") against float64: on CUDA where a GPU is at
hand, on CPU tensors under TRITON_INTERPRET=1 (set by tests/conftest.py without CUDA)."""

import itertools
import os

import pytest
import torch
import triton  # noqa: F401  (the 'gpu' extra, part of `make test`'s install: never skipped)
from test_window_softcap import check, make

from reference import assert_within_tolerance
from treeattn import attention_with_lse
from treeattn.ops import _triton_attn as T


def _devices():
    out = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append("cpu")
    if torch.cuda.is_available():
        out.append("cuda")
    return out or ["none"]


@pytest.fixture(params=_devices())
def dev(request):
    if request.param == "none":
        pytest.fail("neither CUDA nor TRITON_INTERPRET=1: tests/conftest.py sets the latter without a GPU")
    return request.param


@pytest.fixture(params=["dot", "fma"])
def variant(request, monkeypatch):
    """Both ways the kernel takes its products: tl.dot, and multiply-adds over the real rows
    (every dtype up to 8 rows per KV head; beyond, tl.dot)."""
    if request.param == "fma":
        monkeypatch.setattr(T, "FMA_ROWS", dict.fromkeys((torch.float16, torch.bfloat16, torch.float32), 1 << 30))
    else:
        monkeypatch.setattr(T, "FMA_ROWS", {})
    return request.param


def on(dev, *ts):
    return [t.to(dev) for t in ts]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,Tq", [((8, 8), 1), ((16, 4), 2), ((12, 4), 4), ((8, 1), 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_vs_float64_ragged_empty_and_garbage(dev, variant, dtype, heads, Tq, causal):
    """kv_lens with a full, an empty and a short row whose unused slots hold NaN; enough keys
    for several splits (the merge runs)."""
    g = torch.Generator().manual_seed(0)
    S = 700
    q = torch.randn(3, heads[0], Tq, 64, generator=g).to(dtype)
    k = torch.randn(3, heads[1], S, 64, generator=g).to(dtype)
    v = torch.randn(3, heads[1], S, 64, generator=g).to(dtype)
    kv_lens = torch.tensor([S, 0, 33])
    k[2, :, 33:] = float("nan")
    v[2, :, 33:] = float("nan")
    assert T.num_splits(3, heads[1], heads[0] // heads[1] * Tq, S, torch.device(dev)) > 1 or dev == "cuda"
    out, lse = attention_with_lse(*on(dev, q, k, v), kv_lens=kv_lens.to(dev), causal=causal, backend="triton")
    k[2, :, 33:] = 0
    v[2, :, 33:] = 0
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within_tolerance(out.cpu(), lse.cpu(), q, k, v, kv_lens=kv_lens, causal=causal)


@pytest.mark.parametrize(
    "shape,mode,cap",
    list(itertools.product([(1, 8, 2, 1, 80, 48), (2, 6, 3, 4, 128, 128), (3, 4, 1, 2, 32, 32)], ["seq", "row"], [None, 5.0])),
)
def test_windows_softcap_head_dims(dev, variant, shape, mode, cap):
    """kv_start per sequence and per query, softcap, D != Dv and D not a power of two."""
    B, Hq, Hkv, Tq, D, Dv = shape
    q, k, _ = make(B, Hq, Hkv, Tq, 300, D, torch.bfloat16)
    v = torch.randn(B, Hkv, 300, Dv).bfloat16()
    lens = torch.tensor([300, 170, 9][:B])
    start = torch.tensor([0, 150, 5][:B])
    if mode == "row":
        start = (start.view(B, 1) + torch.arange(Tq)).clamp(max=300)
    out, lse = attention_with_lse(*on(dev, q, k, v), kv_start=start.to(dev), kv_lens=lens.to(dev),
                                  causal=True, softcap=cap, backend="triton")  # fmt: skip
    check(out.cpu(), lse.cpu(), q, k, v, kv_lens=lens, causal=True, kv_start=start, softcap=cap)


def test_prefill_rows_per_row_bounds(dev):
    """A causal prefill block as one call: 96 query rows (many row blocks), per-row kv_end."""
    from treeattn.ops.attention import attention_state

    q, k, v = make(1, 6, 2, 96, 96, 64, torch.float32)
    end = (torch.arange(96) + 1).view(1, 96)
    out, lse = attention_state(*on(dev, q, k, v), kv_end=end.to(dev), backend="triton", keep_fp32=True)
    check(out.cpu(), lse.cpu(), q, k, v, causal=True)


def test_nan_contract(dev, variant):
    """A visible NaN key makes its rows NaN; a NaN or inf value reaches only the rows that
    weigh it, in its own dims; an empty row is (0, -inf)."""
    q, k, v = make(1, 2, 1, 3, 600, 32, torch.float32)  # 3 splits: the merge kernel keeps the contract too
    ref_o, ref_l = attention_with_lse(q, k, v, causal=True, backend="torch")
    k2, v2 = k.clone(), v.clone()
    v2[0, 0, 599, 5] = float("nan")  # the last key: only the last query sees it
    v2[0, 0, 598, 7] = float("inf")  # the two last queries see it
    out, lse = attention_with_lse(*on(dev, q, k2, v2), causal=True, backend="triton")
    out, lse = out.cpu(), lse.cpu()
    rows = out.view(2, 3, 32)
    assert rows[:, 2, 5].isnan().all() and rows[:, 1:, 7].isposinf().all()
    assert torch.isfinite(rows[:, 0]).all() and torch.allclose(rows[:, 0], ref_o.view(2, 3, 32)[:, 0], atol=1e-5)
    assert torch.allclose(lse, ref_l, atol=1e-5)  # values never touch the lse
    k2 = k.clone()
    k2[0, 0, 10, 0] = float("nan")  # every row sees key 10
    out, lse = attention_with_lse(*on(dev, q, k2, v), kv_lens=torch.tensor([150], device=dev), backend="triton")
    assert out.isnan().all() and lse.isnan().all()
    out, lse = attention_with_lse(*on(dev, q, k2, v), kv_start=torch.tensor([11], device=dev), backend="triton")
    assert torch.isfinite(out).all()  # the window hides the NaN key
    out, lse = attention_with_lse(*on(dev, q, k, v), kv_lens=torch.tensor([0], device=dev), backend="triton")
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_custom_op_registration(dev):
    """Schema, fake implementation and autograd registration agree (torch.library.opcheck)."""
    q, k, v = on(dev, *make(1, 4, 2, 1, 300, 32, torch.float32))
    hi = torch.tensor([[250, 250]], device=dev)
    torch.library.opcheck(
        torch.ops.treeattn.split_kv_attention.default,
        (q.reshape(1, 2, 2, 32), k, v, None, hi, 0.2, 0.0, False),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_auto_picks_triton_on_cuda_only():
    from treeattn.ops.kernels import pick as _pick_backend

    q = torch.zeros(1, 4, 1, 64)
    assert _pick_backend(q, q, q) != "triton"  # CPU tensors: never, even under the interpreter
    with pytest.raises(ValueError, match="triton"):
        attention_with_lse(q.double(), q.double(), q.double(), backend="triton")


def test_kernel_shapes_fit_the_shared_memory():
    """The K/V pipeline buffers of every config fit: float32 and head dims of 256 get fewer
    stages or smaller key blocks (Triton refuses a launch past 227 KiB on the H100/H200)."""
    for cfg in (T.DECODE_CONFIG, T.PREFILL_CONFIG, T.FMA_CONFIG, dict(BLOCK_N=128, num_warps=8, num_stages=4)):
        for d in (64, 128, 256):
            for size in (2, 4):
                bn, warps, stages = T._config(cfg, d, d, size)
                assert stages * bn * 2 * d * size <= T._SMEM and stages >= 1 and bn >= 16 and warps == cfg["num_warps"]
    assert T._config(dict(BLOCK_N=64, num_warps=4, num_stages=2), 128, 128, 2) == (64, 4, 2)  # bf16 D=128: untouched
    assert [T._merge_block(n) for n in (1, 16, 17, 128, 129, 528)] == [16, 16, 128, 128, 256, 1024]


def test_direct_launch_logic(monkeypatch):
    """Launcher: a key's first call goes through Triton's launch (keywords), later ones through
    the compiled kernel (every argument in signature order); another key compiles again; no key
    (the interpreter) always goes through Triton; a compiled launch that raises turns direct
    launches off for good."""
    from treeattn.ops import _triton_launch as L

    calls = []

    class Compiled:
        def __getitem__(self, grid):
            def run(*args):
                if "fail" in calls:
                    raise TypeError("another calling convention")
                calls.append(("direct", grid, args))

            return run

    class Fn:
        arg_names = ["X", "n", "BLOCK"]

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append(("triton", grid, args, tuple(sorted(kw.items()))))
                return Compiled()

            return run

    monkeypatch.setattr(L, "LEAN", True)
    monkeypatch.setattr(L.Launcher, "ok", True)
    kw = (("BLOCK", 16), ("num_stages", 2), ("num_warps", 4))
    launch = L.Launcher(Fn(), 2, dict(kw))
    launch((2, 1, 1), "a", ("x", 5))
    launch((3, 1, 1), "a", ("x", 7))
    launch((3, 1, 1), "b", ("x", 1))
    launch((3, 1, 1), None, ("x", 7))
    assert calls == [("triton", (2, 1, 1), ("x", 5), kw), ("direct", (3, 1, 1), ("x", 7, 16)),
                     ("triton", (3, 1, 1), ("x", 1), kw), ("triton", (3, 1, 1), ("x", 7), kw)]  # fmt: skip
    calls[:] = ["fail"]
    launch((4, 1, 1), "a", ("x", 9))
    assert not L.Launcher.ok and calls[-1][0] == "triton"
    launch((4, 1, 1), "a", ("x", 9))
    assert calls[-1][0] == "triton"


def test_plan_follows_the_settings(monkeypatch):
    """A call's plan is cached per signature, and a changed setting (the benchmarks sweep them)
    makes a new one."""
    q, k, v = make(1, 4, 2, 1, 300, 32, torch.float32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = on(dev, q.reshape(1, 2, 2, 32), k, v)
    T._PLANS.clear()
    T._split_kv(q, k, v, None, None, 0.2, 0.0, False)
    T._split_kv(q, k[:, :, :200], v[:, :, :200], None, None, 0.2, 0.0, False)  # another S: the same plan
    assert len(T._PLANS) == 1
    monkeypatch.setattr(T, "PROGRAMS_PER_SM", T.PROGRAMS_PER_SM + 1)
    T._split_kv(q, k, v, None, None, 0.2, 0.0, False)
    monkeypatch.setitem(T.DECODE_CONFIG, "num_warps", 8)
    T._split_kv(q, k, v, None, None, 0.2, 0.0, False)
    assert len(T._PLANS) == 3


def test_launch_key_follows_what_triton_specializes():
    """The per-call key changes with everything Triton specializes on that a plan does not fix."""
    buf = torch.zeros(1024)
    a, odd = buf[:512], buf[1:513]  # 16-byte aligned, and not
    base = T.launch_key(3, 700, 240, 1000, a, a, a, a, a)
    assert T.launch_key(3, 710, 240, 1000, a, a, a, a, a) == base  # S: neither 1 nor a multiple of 16
    for other in (T.launch_key(4, 700, 240, 1000, a, a, a, a, a), T.launch_key(3, 704, 240, 1000, a, a, a, a, a),
                  T.launch_key(3, 1, 240, 1000, a, a, a, a, a), T.launch_key(3, 700, 232, 1000, a, a, a, a, a),
                  T.launch_key(3, 700, 240, 1 << 31, a, a, a, a, a), T.launch_key(3, 700, 240, 1000, a, odd, a, a, a),
                  T.launch_key(3, 700, 240, 1000, a, a, a, a, odd)):  # fmt: skip
        assert other != base


def test_output_in_q_dtype_is_the_rounded_float32(dev):
    """An output in q's dtype is the float32 result rounded to nearest even (the interpreter,
    which truncates to bfloat16, casts in torch), with or without the merge."""
    from treeattn.ops.attention import attention_state

    for S in (100, 700):
        q, k, v = on(dev, *make(2, 8, 2, 1, S, 64, torch.bfloat16))
        lens = torch.tensor([S, 3], device=dev)
        out, lse = attention_with_lse(q, k, v, kv_lens=lens, backend="triton", check=False)
        full, lse32 = attention_state(q, k, v, kv_lens=lens, backend="triton", keep_fp32=True)
        assert out.dtype == torch.bfloat16 and torch.equal(out, full.to(torch.bfloat16)) and torch.equal(lse, lse32)


def test_direct_launch_matches_triton_on_cuda():
    """On a GPU: the direct launches (the compiled kernels, no Triton binding) give Triton's
    launches' results bitwise, as a decode loop calls them (one cache, S growing), and are
    the ones in use."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the direct launch runs compiled kernels; the logic is tested on CPU)")
    from treeattn.ops import _triton_launch as L

    class Broken:
        def __getitem__(self, grid):
            raise AssertionError("a launch through Triton")

    T._PLANS.clear()
    lens = torch.tensor([500, 3], device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = on("cuda", *make(2, 8, 2, 1, 900, 64, dtype))
        for S in (700, 710, 740):  # slices of one cache: one plan, one compiled kernel
            a = attention_with_lse(q, k[:, :, :S], v[:, :, :S], kv_lens=lens, backend="triton", check=False)
            L.LEAN = False
            try:
                b = attention_with_lse(q, k[:, :, :S], v[:, :, :S], kv_lens=lens, backend="triton", check=False)
            finally:
                L.LEAN = True
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (dtype, S)
        assert L.Launcher.ok and len(T._PLANS) == 1
        (plan,) = T._PLANS.values()
        assert plan.merges, "the case has several splits"
        plan.fwd.fn = Broken()  # from here only direct launches can run
        for m in plan.merges.values():
            m.fn = Broken()
        c = attention_with_lse(q, k[:, :, :730], v[:, :, :730], kv_lens=lens, backend="triton", check=False)
        assert torch.equal(c[0], a[0]) and torch.equal(c[1], a[1])  # kv_lens <= 500: the same keys
        T._PLANS.clear()
        # keys that differ: S a multiple of 16, then K at a pointer that is not 16-byte aligned
        buf = torch.empty(k.numel() + 1, dtype=dtype, device="cuda")
        k_odd = buf[1:].view(k.shape).copy_(k)
        for kk in (k[:, :, :704], k_odd[:, :, :704], k_odd[:, :, :700]):
            S = kk.shape[2]
            a = attention_with_lse(q, kk, v[:, :, :S], kv_lens=lens, backend="triton", check=False)
            L.LEAN = False
            try:
                b = attention_with_lse(q, kk, v[:, :, :S], kv_lens=lens, backend="triton", check=False)
            finally:
                L.LEAN = True
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (dtype, S)
        T._PLANS.clear()
