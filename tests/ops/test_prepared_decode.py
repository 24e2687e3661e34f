"""prepare_decode: attention_state's decode_cpu call with the rows' bounds worked out once, run on
other q/k/v of the same shapes (a batched step's layers), gives attention_state's bits, and the
torch kernel's result within rounding (the bounds are right)."""

import itertools

import torch

from treeattn.ops._bounds import prepare_decode
from treeattn.ops.attention import attention_state

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _qkv(B, Hq, Hkv, Tq, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((Hq, Tq), (Hkv, S), (Hkv, S))]


def test_prepared_decode_call_is_attentions():
    g = torch.Generator().manual_seed(0)
    bounds = ("none", "lens", "uniform", "zero", "start", "end", "causal", "start+end")
    ran = 0
    for (B, Hq, Hkv, Tq, S), how, dtype, cap in itertools.product(
        [(1, 9, 3, 1, 300), (3, 9, 3, 2, 70), (2, 4, 4, 3, 40)], bounds, DTYPES, [None, 20.0]
    ):
        kw = {}
        if how in ("lens", "uniform", "zero"):
            n = {"lens": torch.randint(0, S + 1, (B,), generator=g), "uniform": torch.full((B,), S // 2),
                 "zero": torch.zeros(B, dtype=torch.int64)}[how]  # fmt: skip
            kw["kv_lens"] = n
        if "start" in how:
            kw["kv_start"] = torch.randint(0, S, (B, Tq), generator=g)
        if "end" in how:
            kw["kv_end"] = torch.randint(1, S + 1, (B, Tq), generator=g)
        if how == "causal":
            kw["causal"] = True
        q, k, v = _qkv(B, Hq, Hkv, Tq, S, 64, dtype, 1)
        call = prepare_decode(q, k, v, softcap=cap, backend="decode_cpu", **kw)
        assert call is not None
        for layer in range(2):  # other tensors of the same shapes: the step's later layers
            q, k, v = _qkv(B, Hq, Hkv, Tq, S, 64, dtype, 2 + layer)
            want = attention_state(q, k, v, scale=0.125, softcap=cap, keep_fp32=True, backend="decode_cpu", **kw)
            got = call(q, k, v, 0.125, keep_fp32=True)
            for x, y in zip(got, want, strict=True):
                assert x.dtype == y.dtype and torch.equal(x, y), (B, Hq, Tq, how, dtype, cap)
            ref = attention_state(q, k, v, scale=0.125, softcap=cap, keep_fp32=True, backend="torch", **kw)  # another kernel
            tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
            for x, y in zip(got, ref, strict=True):
                assert torch.equal(torch.isneginf(x), torch.isneginf(y))  # rows that see no key
                torch.testing.assert_close(x.nan_to_num(0, 0, 0), y.nan_to_num(0, 0, 0), atol=tol, rtol=tol)
            got = call(q, k, v, None)  # the default scale, q's dtype out
            want = attention_state(q, k, v, softcap=cap, backend="decode_cpu", **kw)
            assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(got, want, strict=True))
            ran += 1
    assert ran == 3 * len(bounds) * len(DTYPES) * 2 * 2


def test_prepare_decode_is_none_where_attention_runs_another_kernel():
    q, k, v = _qkv(1, 8, 8, 200, 300, 64, torch.float32, 0)  # 200 rows with bounds: auto takes flash_cpu
    assert prepare_decode(q, k, v, kv_lens=torch.tensor([250]), causal=True) is None
    q, k, v = _qkv(1, 9, 3, 1, 300, 64, torch.float32, 0)
    assert prepare_decode(q, k, v, kv_lens=torch.tensor([250])) is not None  # a decode step: decode_cpu
    assert prepare_decode(q, k, v, backend="torch") is None
