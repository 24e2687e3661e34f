"""treeattn.decoding.penalties against transformers' own logits processors on the same history:
repetition_penalty (RepetitionPenaltyLogitsProcessor, prompt and output), logit_bias
(SequenceBiasLogitsProcessor of one-token sequences), min_tokens (MinNewTokensLengthLogitsProcessor)
and OpenAI's presence / frequency penalties (their formula in float64), each alone and all
together in vLLM's order; tentative tokens ahead counted as output; bad values refused."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers.generation.logits_process import (  # noqa: E402
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from treeattn.decoding.penalties import Penalties  # noqa: E402

V = 50


def _openai(x: torch.Tensor, out: list[int], presence: float, frequency: float) -> torch.Tensor:
    c = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V).double()
    return (x.double() - frequency * c - presence * (c > 0).double()).float()


@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_transformers(seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (12,), generator=g).tolist()
    out = torch.randint(0, V, (7,), generator=g).tolist()
    logits = torch.randn(V, generator=g) * 3
    ids = torch.tensor([prompt + out])
    bias = {3: 2.5, 7: -100.0, int(out[0]): 1.0}
    pen = Penalties(prompt, V, repetition=1.3, presence=0.4, frequency=-0.7, logit_bias=bias, min_tokens=9, ends=[2, 5])
    for t in out:
        pen.add(t)
    # transformers' order: the bias, the repetition penalty, min new tokens; then OpenAI's penalties
    want = SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})(ids, logits[None].clone())
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, want)
    want = MinNewTokensLengthLogitsProcessor(len(prompt), 9, [2, 5])(ids, want)
    want = _openai(want[0], out, 0.4, -0.7)
    got = pen(logits)
    assert torch.allclose(got, want, atol=1e-5, rtol=0) and torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(pen(logits), got)  # the state is unchanged by a call
    # each alone
    one = Penalties(prompt, V, repetition=1.3)
    for t in out:
        one.add(t)
    assert torch.equal(one(logits), RepetitionPenaltyLogitsProcessor(1.3)(ids, logits[None].clone())[0])
    # tokens ahead (a draft being verified) count as output
    ahead = Penalties(prompt, V, repetition=1.3, presence=0.4, frequency=-0.7, logit_bias=bias, min_tokens=9, ends=[2, 5])
    for t in out[:4]:
        ahead.add(t)
    assert torch.equal(ahead(logits, out[4:]), got)
    assert not Penalties(prompt, V).active and Penalties(prompt, V, min_tokens=1).active


def test_min_tokens_lifts_after_enough_tokens():
    p = Penalties([1, 2], V, min_tokens=2, ends=[4])
    x = torch.zeros(V)
    assert p(x)[4] == float("-inf")
    p.add(9)
    assert p(x)[4] == float("-inf") and p(x, [9])[4] == 0
    p.add(9)
    assert p(x)[4] == 0


@pytest.mark.parametrize("kw, field", [
    (dict(repetition=0.0), "repetition_penalty"), (dict(presence=2.5), "presence_penalty"),
    (dict(frequency=float("nan")), "frequency_penalty"), (dict(logit_bias={V: 1.0}), "logit_bias"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
    (dict(presence=True), "presence_penalty"),
])  # fmt: skip
def test_bad_values_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        Penalties([1], V, **kw)
