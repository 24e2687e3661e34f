"""The server's drafting decisions (treeattn.serve.drafts), without a server: how deep each
request drafts from measured step costs, acceptance and a draft model's drafting time, and
the draft model's per-request caches (taken, forked, given back, bounded)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from treeattn.decoding.draft_policy import PROBE  # noqa: E402
from treeattn.decoding.speculative import DraftModel  # noqa: E402
from treeattn.hf.presets import build_model  # noqa: E402
from treeattn.serve.drafts import MODEL, BatchDrafts, DraftPool, RowDrafts  # noqa: E402


def _confident(kind) -> RowDrafts:
    rd = RowDrafts(5)
    for _ in range(20):
        rd.observe(kind, 5, 5)  # every drafted token accepted
    return rd


def test_choose_weighs_step_costs_acceptance_and_drafting_time():
    b = BatchDrafts()
    rd = _confident(3)
    assert b.choose(2, [(rd, 5, 3)]) == [0]  # nothing measured: a plain step first
    for n in range(1, 12):
        b.observe_step(n, 0.1 + 0.001 * n)  # wide steps cost next to nothing
    assert b.choose(2, [(rd, 5, 3)]) == [5]
    weak = RowDrafts(5)
    for _ in range(20):
        weak.observe(3, 5, 0)  # every draft rejected
    assert b.choose(2, [(weak, 5, 3)]) == [0]
    # a draft model: the same acceptance pays while drafting is cheap, not when it costs more than it brings
    m = _confident(MODEL)
    assert b.choose(2, [(m, 5, MODEL)]) == [5]
    b.observe_drafting(5, 5.0)  # 1 s per drafted token against 0.1 s per step
    assert b.choose(2, [(m, 5, MODEL)]) == [0]
    # a kind given up on gets a one-token probe now and then; a draft model too expensive to
    # catch up with does not
    assert [1] in [b.choose(2, [(weak, 5, 3)]) for _ in range(PROBE + 1)]
    assert all(b.choose(2, [(m, 5, MODEL)]) == [0] for _ in range(3 * PROBE))
    # ... until its probe's cost (two drafted tokens: 2 s) is 5 % of the steps waited (0.1 s each)
    assert [1] in [b.choose(2, [(m, 5, MODEL)]) for _ in range(420)]
    b.observe_drafting(5, 0.005)  # the EMA comes back down as drafting gets cheap
    for _ in range(30):
        b.observe_drafting(5, 0.005)
    assert b.choose(2, [(m, 5, MODEL)]) == [5]
    assert BatchDrafts(fixed=True).choose(2, [(weak, 4, 3), (m, 2, MODEL)]) == [4, 2]


def test_draft_pool_forks_reuses_and_bounds_its_caches(monkeypatch):
    model = build_model("tiny-llama", None, torch.float32, 0)[0]
    pool = DraftPool(model, tokens=118)
    doc = list(range(3, 60))
    a = pool.take(doc + [7, 8])
    a.propose(torch.tensor(doc + [7, 8]), 3, 1)
    assert a.ids == doc + [7, 8] and a.cache.get_seq_length() == len(doc) + 2
    b = pool.take(doc + [9])  # shares the document with a running request's cache: a copy of that part
    assert b is not a and b.ids == doc and b.cache.get_seq_length() == len(doc)
    assert a.cache.get_seq_length() == len(doc) + 2  # the original is untouched
    want = DraftModel(model).propose(torch.tensor(doc + [9]), 3, 1).tokens  # the same draft as a cold cache
    assert b.propose(torch.tensor(doc + [9]), 3, 1).tokens == want
    pool.give(a)
    pool.give(b)
    assert pool.busy == [] and len(pool.idle) == 2 and pool.held() == 59 + 58
    c = pool.take(doc + [9, 5])  # the idle cache sharing the most
    assert c is b
    d = pool.take([1, 2, 3])  # shares nothing: a new cache, room made by dropping the oldest idle one
    assert d is not a and d.ids == [] and pool.idle == []
    assert pool.take(list(range(200))) is None  # no room for another 200 tokens beside the running ones
    pool.give(c)
    pool.give(d)
    assert pool.held() <= 118 and set(pool.idle) == {c, d}
    rd = RowDrafts(4, drafters=pool)
    assert rd.offer(doc, 3) == (3, MODEL) and rd.offer(doc, 9) == (4, MODEL) and rd.offer(doc, 0) == (0, MODEL)
    assert rd.offer(list(range(pool.max_pos - 2)), 4) == (2, MODEL)  # within the draft model's positions
    assert rd.draft(doc, 0) == [] and rd.model is None  # nothing drafted: no cache taken
    assert len(rd.draft(doc, 2)) == 2 and rd.model in pool.busy
    rd.release()
    assert rd.model is None and pool.busy == []
    # a draft model that raises (rank 0 alone): that request stops drafting, its cache is forgotten
    rd = RowDrafts(4, drafters=pool)

    def broken(self, *a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(DraftModel, "propose", broken)
    assert rd.draft(doc, 2) == [] and rd.failed and rd.model is None and pool.busy == []
    assert rd.offer(doc, 3) == (0, MODEL)


def test_a_long_prompt_reaches_the_draft_model_a_chunk_per_step():
    """A prompt the draft model has not seen runs ``chunk`` tokens per step without a draft
    (the batch's steps go on), then the request drafts what a cold cache would."""
    model = build_model("tiny-llama", None, torch.float32, 0)[0]
    pool = DraftPool(model, tokens=1000, chunk=20)
    hist = list(range(3, 60))  # 57 tokens
    rd = RowDrafts(4, drafters=pool)
    seen = []
    for _ in range(2):
        assert rd.draft(hist, 3) == []
        seen.append((len(rd.model.ids), rd.model.cache.get_seq_length()))
    assert seen == [(20, 20), (40, 40)]
    want = DraftModel(model).propose(torch.tensor(hist), 3, 1).tokens
    assert rd.draft(hist, 3) == want  # the last 17 tokens fit one step: run with the draft
    b = RowDrafts(4, drafters=pool)  # another question about the same text: a copy, no chunks
    assert b.draft(hist[:50] + [7], 3) == DraftModel(model).propose(torch.tensor(hist[:50] + [7]), 3, 1).tokens


def test_catching_up_takes_a_bounded_share_of_the_step():
    """With the batch's cost model, a prompt reaches the draft model 16 tokens first (its rate
    measured), then as many a step as fit 5 % of the step's time, all requests together; a
    request whose draft model has caught up drafts whatever the budget."""
    from treeattn.serve.drafts import BatchDrafts

    model = build_model("tiny-llama", None, torch.float32, 0)[0]
    pool = DraftPool(model, tokens=10_000, chunk=256)
    batch = BatchDrafts()
    batch.observe_step(2, 0.2)
    hist = list(range(3, 300))
    a, b = RowDrafts(4, drafters=pool), RowDrafts(4, drafters=pool)
    batch.choose(2, [])
    assert a.draft(hist, 3, batch) == [] and len(a.model.ids) == 16 and batch.catchup.value > 0
    batch.catchup.value = 0.001  # 1 ms a token: 5 % of a 0.2 s step is 10 tokens
    batch.choose(2, [])
    assert a.draft(hist, 3, batch) == [] and len(a.model.ids) == 26
    assert b.draft(hist[:200] + [5], 3, batch) == [] and len(b.model.ids) == 26  # a copy of a's; the budget is spent
    batch.catchup.value = 1.0  # a draft model slower than the steps: no catching up at all
    batch.choose(2, [])
    assert a.draft(hist, 3, batch) == [] and len(a.model.ids) == 26
    c = RowDrafts(4, drafters=pool)
    c.model = DraftModel(model)
    c.model.advance(hist, len(hist))  # caught up: drafts even with the budget spent
    assert c.draft(hist, 3, batch) == DraftModel(model).propose(torch.tensor(hist), 3, 1).tokens
