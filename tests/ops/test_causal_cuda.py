"""A square causal block through aten's flash kernel on CUDA (``ops.causal.SQUARE_FLASH``, off
until ``benchmarks/gpu_kernel.py --sections prefill`` measures it faster): which blocks it takes
(host checks, on fake CUDA tensors), and on a GPU its states against float64."""

import pytest
import torch
from test_window_softcap import check, make
from torch._subclasses.fake_tensor import FakeTensorMode

from treeattn.ops import causal as C


def test_square_flash_takes_only_square_causal_half_blocks():
    end = torch.arange(1, 17)
    mode = FakeTensorMode()

    def qkv(T=16, S=16, dtype=torch.bfloat16, D=64, Hkv=2):  # fake CUDA tensors: shapes, dtype, device
        with mode:
            mk = lambda h, n: torch.empty(1, h, n, D, dtype=dtype, device="cuda")  # noqa: E731
            return mk(8, T), mk(Hkv, S), mk(Hkv, S)

    assert C._square_flash(*qkv(), None, end, None)
    assert C._square_flash(*qkv(dtype=torch.float16), None, end, None)
    assert not C._square_flash(*qkv(dtype=torch.float32), None, end, None)  # float32: aten's efficient kernel
    assert not C._square_flash(*qkv(), torch.zeros(16, dtype=torch.int64), end, None)  # a window
    assert not C._square_flash(*qkv(), None, end + 1, None)  # a key more than a square
    assert not C._square_flash(*qkv(S=17), None, end + 1, None)  # keys before the block
    assert not C._square_flash(*qkv(), None, end, 30.0)  # softcap
    assert not C._square_flash(*qkv(D=72 * 4), None, end, None)  # head dim > 256
    assert not C._square_flash(*qkv(Hkv=3), None, end, None)  # heads not grouped evenly
    q, k, v = make(1, 8, 2, 16, 16, 64, torch.bfloat16)
    assert not C._square_flash(q, k, v, None, end, None)  # CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_square_flash_vs_float64_cuda(dtype, heads, monkeypatch):
    monkeypatch.setattr(C, "SQUARE_FLASH", True)
    q, k, v = make(2, heads[0], heads[1], 200, 200, 64, dtype)
    end = torch.arange(1, 201)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    assert C._square_flash(qc, kc, vc, None, end, None)
    out, lse = C.causal_block_states(qc, kc, vc, None, end, None, None, "auto")
    assert out.dtype == lse.dtype == torch.float32
    check(out.cpu(), lse.cpu(), q, k, v, causal=True)
