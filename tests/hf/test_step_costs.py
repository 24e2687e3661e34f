"""The one step-cost model and the one verification of speculative decoding (decoding.step_costs,
decoding.speculative.follow), shared by generate's DraftPolicy and the server's BatchDrafts."""

import pytest
import torch

pytest.importorskip("transformers")

from treeattn.decoding.draft_policy import DraftPolicy  # noqa: E402
from treeattn.decoding.speculative import follow  # noqa: E402
from treeattn.decoding.step_costs import BETA0, Rate, StepCosts, expected_tokens  # noqa: E402
from treeattn.serve.drafts import BatchDrafts, verify  # noqa: E402


def test_step_costs_measure_interpolate_and_extrapolate():
    c = StepCosts()
    assert c.estimate(3) is None and c.relative(3) == 1.0 + 2 * BETA0  # the prior until a plain step
    c.observe(1, 0.1)
    assert c.estimate(3) == pytest.approx(0.1 * (1 + 2 * BETA0)) and c.relative(3) == pytest.approx(1 + 2 * BETA0)
    c.observe(5, 0.2)
    assert c.estimate(3) == pytest.approx(0.15) and c.estimate(9) == pytest.approx(0.3)  # between; beyond: the slope
    c.observe(5, 0.3)  # an EMA: 0.7 of the past
    assert c.seconds[5] == pytest.approx(0.23) and 5 in c and 4 not in c
    r = Rate()
    r.observe(0, 1.0)
    assert r.value == 0.0
    r.observe(4, 0.4)
    r.observe(1, 0.2)
    assert r.value == pytest.approx(0.7 * 0.1 + 0.3 * 0.2)
    assert expected_tokens(0.5, 3) == pytest.approx(1.875) and expected_tokens(0.9, 0) == 1.0


def test_generate_and_the_server_weigh_steps_alike():
    pol, batch = DraftPolicy(8), BatchDrafts()
    for n, s in ((1, 0.10), (2, 0.13), (6, 0.2), (2, 0.12), (1, 0.11)):
        pol.observe_step(n, s)
        batch.observe_step(n, s)
    for T in range(1, 12):
        assert pol.step_cost(T) == pytest.approx(batch.step_cost(T) / batch.step_cost(1)), T


@pytest.mark.parametrize("seed", range(6))
def test_the_server_verifies_a_chain_as_generate_verifies_a_tree(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 7, generator=g)
    greedy = [int(x) for x in logits.argmax(-1)]
    draft = greedy[:seed % 4] + [(greedy[seed % 4] + 1) % 7]  # accepted up to a wrong token
    choose = lambda x: int(x.argmax())  # noqa: E731
    emitted = verify(logits, draft[:4], choose)
    path, nxt = follow(logits, [-1] + draft[:4], list(range(-1, len(draft[:4]))), choose)
    assert emitted == greedy[: len(emitted)] and emitted[-1] == nxt and len(emitted) == len(path)
    assert len(emitted) == min(seed % 4, 4) + 1
