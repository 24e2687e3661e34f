"""The CUDA decode path reads nothing from the device (no .item(), .tolist(), bool(tensor),
.cpu()): run under FakeTensorMode with fake CUDA tensors, which works on this CPU-only build,
runs the CUDA ops' meta kernels (and the Triton op's fake implementation), and raises
DataDependentOutputException on any device-to-host read."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode

import treeattn
from treeattn import attention_with_lse

_getitem = torch.Tensor.__getitem__


def _basic_getitem(t, idx):
    """Python indexing of a fake CUDA tensor fails on a CPU-only build (its device guard is not
    linked in); basic indexing (ints, slices, ..., None) goes through the aten ops instead,
    which run their meta kernels as usual. Tensor indices keep the original path."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if t.device.type != "cuda" or any(isinstance(i, torch.Tensor) or isinstance(i, list) for i in idx):
        return _getitem(t, idx)
    n_real = sum(i is not None and i is not Ellipsis for i in idx)
    out, d = t, 0
    for i in idx:
        if i is Ellipsis:
            d += t.ndim - n_real
        elif i is None:
            out = out.unsqueeze(d)
            d += 1
        elif isinstance(i, int):
            out = torch.ops.aten.select(out, d, i)
        else:
            start, stop, step = i.indices(out.shape[d])
            out = torch.ops.aten.slice(out, d, start, max(start, stop), step)
            d += 1
    return out


# the other Python bindings that hit the same missing guard, routed to their aten ops
_PATCHES = {"__getitem__": _basic_getitem, "__invert__": lambda t: torch.bitwise_not(t)}


@contextlib.contextmanager
def FakeTensorMode():
    saved = {name: getattr(torch.Tensor, name) for name in _PATCHES}
    for name, fn in _PATCHES.items():
        setattr(torch.Tensor, name, fn)
    try:
        with _FakeTensorMode() as m:
            yield m
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


CALLS = {
    "decode": dict(),
    "ragged": dict(kv_lens=True),
    "spec rows, causal": dict(Tq=4, causal=True, kv_lens=True),
    "window per seq": dict(kv_start="seq", kv_lens=True),
    "window per row + softcap": dict(Tq=3, causal=True, kv_start="row", softcap=30.0),
}


def fake_inputs(Tq=1, kv_lens=False, kv_start=None, causal=False, softcap=None, dtype=torch.bfloat16):
    B, Hq, Hkv, S, D = 2, 8, 2, 4096, 64
    dev = "cuda"
    q = torch.empty(B, Hq, Tq, D, dtype=dtype, device=dev)
    k = torch.empty(B, Hkv, S, D, dtype=dtype, device=dev)
    v = torch.empty(B, Hkv, S, D, dtype=dtype, device=dev)
    kw = dict(causal=causal, softcap=softcap)
    if kv_lens:
        kw["kv_lens"] = torch.empty(B, dtype=torch.int64, device=dev)
    if kv_start == "seq":
        kw["kv_start"] = torch.empty(B, dtype=torch.int64, device=dev)
    elif kv_start == "row":
        kw["kv_start"] = torch.empty(B, Tq, dtype=torch.int64, device=dev)
    return q, k, v, kw


@pytest.mark.parametrize("case", list(CALLS))
def test_attention_with_lse(case):
    spec = CALLS[case]
    with FakeTensorMode():
        q, k, v, kw = fake_inputs(**spec)
        out, lse = attention_with_lse(q, k, v, check=False, **kw)
        assert out.shape == q.shape and out.device.type == "cuda" and lse.dtype == torch.float32


# fused_cuda: aten's flash and efficient kernels (meta), ragged calls and softcap on the chunked torch path
@pytest.mark.parametrize(
    "spec", [dict(), dict(Tq=4, causal=True), dict(dtype=torch.float32), dict(kv_lens=True), dict(softcap=30.0)]
)
def test_fused_cuda(spec):
    backend = "fused_cuda"
    with FakeTensorMode():
        q, k, v, kw = fake_inputs(**spec)
        out, lse = attention_with_lse(q, k, v, backend=backend, check=False, **kw)
        assert out.shape == q.shape and out.device.type == "cuda" and lse.dtype == torch.float32


def test_auto_is_the_triton_op():
    """On (fake) CUDA tensors auto runs the Triton custom op, not a fallback."""
    pytest.importorskip("triton")
    seen = []
    from treeattn.ops import _triton_attn as T

    real = T.split_kv_attention

    def spy(*a):
        seen.append(a[0].shape)
        return real(*a)

    T.split_kv_attention = spy
    try:
        with FakeTensorMode():
            q, k, v, kw = fake_inputs(kv_lens=True)
            attention_with_lse(q, k, v, check=False, **kw)
    finally:
        T.split_kv_attention = real
    assert seen == [torch.Size([2, 2, 4, 64])]  # [B, Hkv, G*Tq, D]: the G heads of a KV head folded


@pytest.mark.parametrize("case", list(CALLS))
@pytest.mark.parametrize("method", ["tree", "ring"])
def test_tree_and_ring_decode_p1(case, method):
    """tree_decode/ring_decode at p = 1 with check=False, with and without new tokens."""
    spec = CALLS[case]
    fn = treeattn.tree_decode if method == "tree" else treeattn.ring_decode
    with FakeTensorMode():
        q, k, v, kw = fake_inputs(**spec)
        kw.pop("causal")
        Tq = q.shape[2]
        out = fn(q, k, v, check=False, **kw)
        assert out.shape == q.shape
        nk = torch.empty(q.shape[0], k.shape[1], Tq, k.shape[3], dtype=k.dtype, device="cuda")
        mask = torch.ones(Tq, Tq, dtype=torch.bool, device="cuda").tril()
        out, lse = fn(q, k, v, new_k=nk, new_v=nk, new_mask=mask, check=False, return_lse=True, **kw)
        assert out.shape == q.shape and lse.shape == q.shape[:3]


def test_the_guard_catches_a_host_read():
    """The harness itself: a host read of a fake CUDA tensor raises."""
    with FakeTensorMode():
        q, k, v, kw = fake_inputs(kv_lens=True)
        with pytest.raises(DataDependentOutputException):
            bool((kw["kv_lens"] > 0).all())
        with pytest.raises(DataDependentOutputException):
            attention_with_lse(q, k, v, check=True, **kw)  # check=True validates values: one sync


def test_cuda_dispatch_follows_the_measurements():
    """auto on CUDA (the table above ops.kernels._cuda_backend): the Triton kernel, except
    plain half-precision calls over >= 64 (sequence, KV head) pairs (aten_flash measured
    faster) and plain float32 calls with many rows per KV head (aten's efficient kernel)."""
    from treeattn.ops.kernels import pick as _pick_backend

    def pick(B, dtype, Tq=1, **kw):
        q = torch.empty(B, 32, Tq, 128, dtype=dtype, device="cuda")
        k = torch.empty(B, 8, 1024, 128, dtype=dtype, device="cuda")
        return _pick_backend(q, k, k, **kw)

    bf, f32 = torch.bfloat16, torch.float32
    with FakeTensorMode():
        assert pick(1, bf, plain=True) == "triton"
        assert pick(8, bf, plain=True) == "fused_cuda"
        assert pick(8, bf, plain=False) == "triton"  # ragged (kv_lens), windows, softcap
        assert pick(8, bf, Tq=4, plain=True, causal_rows=True) == "triton"
        assert pick(8, f32, plain=True) == "triton"  # 4 rows per KV head
        assert pick(1, f32, Tq=64, plain=True, causal_rows=True) == "fused_cuda"  # a prefill block
        assert pick(1, f32, Tq=64, plain=False) == "triton"
        # the aten_flash pick reads nothing from the device either
        q = torch.empty(8, 32, 1, 128, dtype=bf, device="cuda")
        k = torch.empty(8, 8, 4096, 128, dtype=bf, device="cuda")
        out, lse = attention_with_lse(q, k, k, check=False)
        assert out.shape == q.shape
