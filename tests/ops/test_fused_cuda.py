import subprocess
import sys

import pytest
import torch

from reference import assert_within_tolerance
from treeattn import attention_with_lse
from treeattn.ops import _fused_cuda as F

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_import_pulls_in_nothing_cuda_only():
    code = "import sys, treeattn.ops._fused_cuda, treeattn.ops.attention; assert 'flash_attn' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_plan():
    h, f32 = torch.bfloat16, torch.float32
    assert F.plan(h, 128, 128, 4, 1, False, True, None, True) == "flash_attn"
    assert F.plan(h, 128, 128, 4, 4, True, True, 30.0, True) == "flash_attn"  # native softcap
    assert F.plan(h, 128, 128, 4, 1, False, False, None, False) == "aten_flash"
    assert F.plan(h, 128, 128, 4, 1, False, True, None, False) == "torch"  # ragged: aten ignores seqlen_k
    assert F.plan(h, 128, 128, 4, 4, True, False, None, False) == "aten_efficient"  # causal rows
    assert F.plan(f32, 128, 128, 1, 1, False, False, None, True) == "aten_efficient"
    assert F.plan(f32, 128, 128, 1, 1, False, False, 30.0, False) == "torch"
    assert F.plan(h, 100, 100, 1, 1, False, False, None, False) == "torch"  # D % 8


def test_fix_empty_tells_empty_rows_from_undefined_ones():
    """The kernels' lse for a row without keys (+inf, NaN) becomes (0, -inf); a non-finite
    lse on a row that has keys (a NaN or inf score) becomes (NaN, NaN); finite rows stay."""
    inf, nan = float("inf"), float("nan")
    lse = torch.tensor([[[inf, nan, 1.5, inf, nan, 2.0]]])  # [B=1, H=1, R=6]
    out = torch.full((1, 1, 6, 4), 7.0)
    hi = torch.tensor([[0, 0, 5, 5, 5, 5]])  # rows 0, 1 see no key
    o, l = F._fix_empty(out, lse, hi)
    assert torch.isneginf(l[0, 0, :2]).all() and (o[0, 0, :2] == 0).all()
    assert l[0, 0, 3:5].isnan().all() and o[0, 0, 3:5].isnan().all()
    assert l[0, 0, 2] == 1.5 and l[0, 0, 5] == 2.0 and (o[0, 0, [2, 5]] == 7).all()
    o, l = F._fix_empty(out, lse, None)  # every row sees keys
    assert torch.equal(l.isnan(), ~torch.isfinite(lse)) and torch.equal(o.isnan().all(-1), ~torch.isfinite(lse))


def test_cpu_tensors_rejected_and_auto_avoids_it():
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64)
    assert not F.fused_cuda_supported(q, k, v)
    with pytest.raises(ValueError, match="CUDA"):
        attention_with_lse(q, k, v, backend="fused_cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,Tq", [((8, 8), 1), ((12, 4), 4), ((8, 1), 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_vs_float64(dtype, heads, Tq, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads[0], Tq, 64, generator=g).to(dtype)
    k = torch.randn(3, heads[1], 200, 64, generator=g).to(dtype)
    v = torch.randn(3, heads[1], 200, 64, generator=g).to(dtype)
    kv_lens = torch.tensor([200, 0, 33])
    k[2, :, 33:] = float("nan")
    v[2, :, 33:] = float("nan")
    out, lse = attention_with_lse(
        q.cuda(), k.cuda(), v.cuda(), kv_lens=kv_lens.cuda(), causal=causal, backend="fused_cuda"
    )
    k[2, :, 33:] = 0
    v[2, :, 33:] = 0
    assert_within_tolerance(out.cpu(), lse.cpu(), q, k, v, kv_lens=kv_lens, causal=causal)
