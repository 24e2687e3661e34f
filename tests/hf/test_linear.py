"""Packed linear layers (treeattn.hf.linear), with treeattn's compiled kernel and with oneDNN's:
the same model within float32 rounding, a row's output independent of its batch, undone
bitwise, and what the CLI's --linear flag does."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

import treeattn.hf.linear as hl
from treeattn.hf.linear import _ATTR, pack_linears, packing_available, unpack_linears
from treeattn.ops.linear_cpu import linear_available, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not packing_available(), reason="neither the compiled kernel nor oneDNN here")
KERNELS = [
    pytest.param("treeattn", marks=pytest.mark.skipif(not linear_available(), reason="no AVX-512 C kernel here")),
    pytest.param("onednn", marks=pytest.mark.skipif(not hl._onednn(), reason="this PyTorch build has no oneDNN")),
]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Which kernel pack_linears takes: treeattn's where it is loaded, else oneDNN's."""
    if request.param == "onednn":
        monkeypatch.setattr(hl, "linear_available", lambda: False)
    return request.param


def _packed(m) -> bool:
    return hasattr(m, _ATTR)  # what pack_linears marks (unpack_linears removes)


def _llama(tied: bool, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_matches_and_unpacks_bitwise(tied, kernel):
    m = _llama(tied)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ids = torch.randint(0, 300, (3, 11))
    with torch.no_grad():
        ref = m(ids).logits
    linears = sum(type(x) is nn.Linear for x in m.modules())
    assert pack_linears(m) == linears == 2 * 7 + 1
    assert pack_linears(m) == 0  # idempotent
    up = m.model.layers[0].mlp.up_proj
    assert _packed(up) and _packed(m.lm_head)
    assert (up.weight.is_mkldnn, up.weight.ndim) == ((False, 1) if kernel == "treeattn" else (True, 2))
    assert (m.lm_head.weight.ndim == 2 and not m.lm_head.weight.is_mkldnn) is tied  # a tied head stays dense
    assert (m.lm_head.weight is m.model.embed_tokens.weight) is tied
    with torch.no_grad():
        got = m(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # autograd (an input that requires grad) takes the dense path and flows
    emb = m.model.embed_tokens(ids).detach().requires_grad_()
    m(inputs_embeds=emb).logits.sum().backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all()
    assert unpack_linears(m) == linears
    assert not any(p.is_mkldnn or p.ndim == 1 and p.numel() > 96 for p in m.parameters())
    assert not any(_packed(x) for x in m.modules())
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_does_not_depend_on_its_batch(threads, kernel):
    """MKL's GEMM gives row 0 different bits at different batch sizes; the packed layer never,
    one row included (oneDNN's one-row kernel differs on some shapes: SmolLM2's down
    projection 1536 -> 576, 4096 -> 1024)."""
    torch.manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, o in [(576, 1536), (1536, 576), (576, 192), (4096, 1024), (64, 96), (70, 100)]:
            lin = nn.Linear(i, o)
            x = torch.randn(300, i)
            with torch.no_grad():
                plain = lin(x[:40])
                assert pack_linears(lin) == 1
                alone = torch.cat([lin(x[r : r + 1]) for r in range(300)])
                for m in [*range(1, 41), 64, 299, 300]:
                    assert torch.equal(lin(x[:m]), alone[:m]), (i, o, m)
                torch.testing.assert_close(alone[:40], plain, rtol=1e-5, atol=1e-5)
                assert torch.equal(lin(x[None, :7]), alone[None, :7])  # [B, T, in] inputs too
                assert torch.equal(lin(x[None, None, 5]), alone[None, None, 5])  # one row as [1, 1, in]
    finally:
        torch.set_num_threads(before)


def test_other_dtypes_and_devices_are_left_alone():
    m = _llama(False, torch.float64)
    assert pack_linears(m) == 0 and not any(_packed(x) for x in m.modules())
    assert pack_linears(nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16))) == 0
    assert pack_linears(nn.Sequential(nn.Linear(4, 4, device="meta"))) == 0


@pytest.mark.parametrize("flag,packed", [([], True), (["--linear", "torch"], False)])
def test_cli_linear_flag(flag, packed):
    from treeattn.cli.model import add_model_args, rank_model

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    a = ap.parse_args(["--preset", "tiny-llama", *flag])
    model, _ = rank_model(a, None)
    assert any(_packed(m) for m in model.modules()) is packed


@pytest.mark.skipif(not linear_available(), reason="no AVX-512 C kernel here")
def test_treeattn_kernel_against_float64():
    """Every shape class of the tile (whole and partial 64-output groups, 1-6 rows and more, K
    beyond and within one block of 64), strided rows and no bias: within float32 rounding of
    float64, no worse than twice MKL's error; 2 threads give 1 thread's bits."""
    g = torch.Generator().manual_seed(3)
    before = torch.get_num_threads()
    try:
        for n, k in [(1, 1), (16, 64), (17, 65), (64, 576), (100, 70), (1536, 576), (576, 1536), (200, 130)]:
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            wp = pack_weight(w)
            x = torch.randn(40, k + 5, generator=g)[:, 2 : 2 + k]  # rows with a stride of k + 5
            ref = x.double() @ w.double().T
            torch.set_num_threads(1)
            y = packed_linear(x, wp, n)
            yb = packed_linear(x[None], wp, n, b)[0]
            torch.set_num_threads(2)
            assert torch.equal(packed_linear(x, wp, n), y)
            err, mkl = (y.double() - ref).abs().max(), ((x @ w.T).double() - ref).abs().max()
            assert err <= 2 * mkl + 1e-7, (n, k, err, mkl)
            assert torch.equal(yb, y + b)  # the bias is added after the sum
            assert torch.equal(hl.unpack_weight(wp, n, k), w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(packed_linear(torch.ones(3, 0), pack_weight(torch.ones(5, 0)), 5, torch.arange(5.0)),
                       torch.arange(5.0).expand(3, 5))  # no inputs: the bias  # fmt: skip
    assert packed_linear(torch.ones(0, 3), pack_weight(torch.ones(5, 3)), 5).shape == (0, 5)
    assert torch.equal(packed_linear(torch.ones(3), pack_weight(torch.ones(5, 3)), 5), torch.full((5,), 3.0))
    with pytest.raises(ValueError, match="float32"):
        packed_linear(torch.ones(2, 3, dtype=torch.float64), pack_weight(torch.ones(4, 3)), 4)
    for bad in (torch.ones(4, dtype=torch.float64), torch.ones(1), torch.ones(4, dtype=torch.float16)):
        with pytest.raises(ValueError, match="bias"):
            packed_linear(torch.ones(2, 3), pack_weight(torch.ones(4, 3)), 4, bad)
    with pytest.raises(ValueError, match="packed float32"):
        packed_linear(torch.ones(2, 3), pack_weight(torch.ones(4, 3)).double(), 4)
    with pytest.raises(ValueError, match="not a packed float32 \\[17, 3\\]"):
        packed_linear(torch.ones(2, 3), pack_weight(torch.ones(4, 3)), 17)


@pytest.mark.skipif(not linear_available(), reason="no AVX-512 C kernel here")
def test_treeattn_packed_layer_copies_and_trains_its_bias():
    """A deep copy holds each packed weight once and computes what the original does; a bias
    that requires grad takes the dense path outside no_grad, and its gradient flows."""
    import copy

    torch.manual_seed(2)
    lin = nn.Linear(70, 100)
    x = torch.randn(5, 70)
    ref = lin(x).detach()
    pack_linears(lin)
    twin = copy.deepcopy(lin)
    packed = getattr(twin, hl._ATTR)[0]
    assert packed is twin.weight and packed.data_ptr() != lin.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(twin(x), lin(x))
        torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    lin(x).sum().backward()  # the bias requires grad (the weight does not: packed)
    assert lin.bias.grad is not None and torch.equal(lin.bias.grad, torch.full((100,), 5.0))
