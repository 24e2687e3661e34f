"""The one next-token rule (generate, speculative decoding, the server): greedy is the first
argmax; sampling draws from transformers' warped distribution, reproducibly per seed."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from treeattn.decoding.sampler import Sampler


def test_greedy_sampling_and_warpers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins, as torch's argmax
    s = Sampler()
    assert s.pick(logits).tolist() == logits.argmax(-1).tolist() and s.pick(logits)[1] == 7
    assert s.next(logits[1]) == 7
    # the distribution is transformers' warpers in generate's order, in float32
    kw = dict(temperature=0.7, top_k=20, top_p=0.8)
    ref = torch.softmax(TopPLogitsWarper(0.8)(None, TopKLogitsWarper(20)(None, TemperatureLogitsWarper(0.7)(
        None, logits.float()))), -1)  # fmt: skip
    p = Sampler(True, **kw).probs(logits)
    assert p.dtype == torch.float32 and torch.allclose(p, ref) and torch.allclose(p.sum(-1), torch.ones(3))
    assert torch.equal(Sampler(True, **kw).probs(logits[2]), p[2])
    assert int((p[0] > 0).sum()) <= 20  # top-k cut
    # draws: the same seed gives the same tokens, another seed others; only tokens the warpers keep
    a = [Sampler(True, **kw, seed=5).pick(logits).tolist() for _ in range(2)]
    runs = {tuple(Sampler(True, **kw, seed=sd).pick(logits).tolist()) for sd in range(20)}
    assert a[0] == a[1] and len(runs) > 1
    for run in runs:
        assert all(p[i, t] > 0 for i, t in enumerate(run))
    one = Sampler(True, top_k=1, seed=3)
    assert [one.next(logits[0]) for _ in range(5)] == [int(logits[0].argmax())] * 5
    s = Sampler(True, seed=1)
    d = s.draws(torch.tensor([0.0, 0.5, 0.5]), 64)
    assert len(d) == 64 and set(d) == {1, 2} and 0 <= s.rand() < 1
    with pytest.raises(ValueError):
        Sampler(True, temperature=-1.0)
    for bad in (dict(top_p=1.5), dict(top_p=0.0), dict(typical_p=2.0), dict(top_p=float("nan"))):
        with pytest.raises(ValueError, match="must be a float in"):
            Sampler(True, **bad)


@pytest.mark.parametrize("t", [1e-45, 1e-300, 1e-20, 1e-5])
def test_a_tiny_temperature_samples_the_maximum(t):
    """logits / 1e-45 overflow float32 (the softmax was NaN, the server's answer a 500): below
    1e-4 the scores are shifted by their maximum first, the same distribution."""
    logits = torch.tensor([[3.0, 9.0, -2.0, 8.9], [50.0, 1.0, 2.0, 3.0]])
    s = Sampler(True, temperature=t, seed=3)
    p = s.probs(logits)
    assert torch.isfinite(p).all() and torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    assert s.pick(logits).tolist() == [1, 0]
    assert [s.next(x) for x in logits] == [1, 0]


def test_min_p_is_transformers_warper_after_top_p():
    """min-p (the server's ``min_p``, vLLM's extra field) sits where transformers' generate puts
    it: after top-p, before typical-p."""
    from transformers.generation.logits_process import MinPLogitsWarper, TypicalLogitsWarper

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    ref = TypicalLogitsWarper(0.9)(None, MinPLogitsWarper(0.1)(None, TopPLogitsWarper(0.95)(
        None, TemperatureLogitsWarper(0.8)(None, logits.float()))))  # fmt: skip
    p = Sampler(True, temperature=0.8, top_p=0.95, min_p=0.1, typical_p=0.9).probs(logits)
    assert torch.allclose(p, torch.softmax(ref, -1)) and bool((p == 0).any())
    assert torch.equal(Sampler(True, min_p=0.0).probs(logits), Sampler(True).probs(logits))  # 0: off
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_p must be a float in"):
            Sampler(True, min_p=bad)
