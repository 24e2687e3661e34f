"""The LM head split over the ranks' vocabulary (treeattn.hf._head) at p = 2 and 3: the logits
every rank gets equal the whole head's, bitwise with packed linears, within rounding for a
plain head (MKL's GEMM over a slice); vocabularies that are not a multiple of the slices
(a rank with an empty slice), tied and untied heads with a bias, rows gathered in several
pieces, and the heads that are run whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

from treeattn.launch import launch  # noqa: E402


def _llama(vocab: int, tied: bool, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def head_worker() -> None:
    import treeattn.hf._head as H
    import treeattn.parallel.vocab as VP
    from treeattn.hf.linear import pack_linears, packing_available
    from treeattn.hf.model import lm_logits
    from treeattn.ops.linear_cpu import linear_available

    rank, p = dist.get_rank(), dist.get_world_size()
    for vocab, tied, dtype, packed, bias in [(300, True, torch.float32, False, False),
                                             (100, False, torch.float32, False, True),  # p = 3: rank 2 holds none
                                             (1000, False, torch.float64, False, True),
                                             (300, True, torch.float32, True, False),
                                             (1000, False, torch.float32, True, True)]:  # fmt: skip
        what = f"p={p} vocab={vocab} tied={tied} {dtype} packed={packed} bias={bias}"
        m = _llama(vocab, tied, dtype)
        if bias:
            m.lm_head.bias = nn.Parameter(torch.randn(vocab, dtype=dtype))
        if packed:
            if not (packing_available() and linear_available()):
                continue
            pack_linears(m)
        g = torch.Generator().manual_seed(7)
        for rows, small in [(1, None), (5, None), (9, 64 * 4 * 3)]:  # the last: 3 rows per gather
            hidden = torch.randn(rows, 64, generator=g).to(dtype)
            if small is not None:
                VP.SMALL, old = small, VP.SMALL
            with torch.no_grad():
                got = lm_logits(m, hidden, None, split=True)
                want = lm_logits(m, hidden)
            if small is not None:
                VP.SMALL = old
            assert got.shape == want.shape == (rows, vocab) and got.dtype == want.dtype, what
            if packed:  # every logit the same sum
                assert torch.equal(got, want), f"{what} rows={rows}: {(got - want).abs().max():.3g}"
            else:  # MKL blocks a slice as it likes
                tol = 1e-12 if dtype == torch.float64 else 1e-5
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=what)
            every = [torch.empty_like(got) for _ in range(p)]
            dist.all_gather(every, got)
            assert all(torch.equal(e, got) for e in every), f"{what}: ranks differ"
    # run whole: one rank's group, and a head that is not an nn.Linear
    m = _llama(300, True)
    hidden = torch.randn(2, 64)
    alone = [dist.new_group([r]) for r in range(p)]  # every rank creates every group, in order
    assert H.split_head(m, hidden, alone[rank]) is None
    assert H.split_head(m, hidden, None) is None  # autograd records here
    with torch.no_grad():
        assert H.split_head(m, hidden, None) is not None
        m.lm_head = nn.Sequential(m.lm_head)
        assert H.split_head(m, hidden, None) is None


@pytest.mark.parametrize("p", [2, 3])
def test_split_head_equals_whole(p):
    launch(head_worker, p, (), timeout=300)
