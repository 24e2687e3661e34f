"""The draft-length policy of speculative decoding (treeattn.decoding.draft_policy), simulated:
whatever the true acceptance rate and the true cost of a wider step, adaptive drafting
commits tokens at least 98 % as fast as plain decoding, and where drafts are good and wide
steps cheap it is far faster; short n-gram matches are not trusted until they pay."""

from __future__ import annotations

import random

import pytest
import torch

from treeattn.decoding.draft_policy import DraftPolicy, evidence
from treeattn.decoding.prompt_lookup import Draft, PromptLookup, _cut, _trie


def simulate(alpha: float, beta: float, kind, steps: int = 3000, k: int = 5, seed: int = 0,
             noise: float = 0.03) -> float:  # fmt: skip
    """Tokens per unit time of adaptive drafting against plain decoding (1.0): a step of T
    tokens costs (1 + beta (T - 1)) times a plain one, with multiplicative noise, and each
    drafted token is accepted with probability ``alpha`` (until the first rejection)."""
    rng = random.Random(seed)
    pol = DraftPolicy(k)
    tokens = time = 0.0
    for _ in range(steps):
        d = pol.depth(kind, k)
        acc = 0
        while acc < d and rng.random() < alpha:
            acc += 1
        cost = (1 + beta * d) * (1 + noise * (2 * rng.random() - 1))
        pol.observe_step(1 + d, cost)
        pol.observe_acceptance(kind, d, acc)
        tokens += 1 + acc
        time += cost
    return tokens / time


@pytest.mark.parametrize("kind", [1, 2, 3, 6, "model"])
@pytest.mark.parametrize("beta", [0.0, 0.03, 0.1, 0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.2, 0.5, 0.9, 1.0])
def test_never_much_slower_than_plain(alpha, beta, kind):
    speed = simulate(alpha, beta, kind)
    assert speed >= 0.98, f"alpha {alpha} beta {beta} {kind}: {speed:.3f}x plain"
    # where the expected gain of the best fixed depth is large, most of it is found
    best = max((1 - alpha ** (d + 1)) / (1 - alpha) / (1 + beta * d) if alpha < 1 else (d + 1) / (1 + beta * d)
               for d in range(6))  # fmt: skip
    if best > 1.3 and (kind != 1 or alpha >= 0.5):
        assert speed >= 0.8 * best, f"alpha {alpha} beta {beta} {kind}: {speed:.2f}x plain, best fixed {best:.2f}x"


def test_good_drafts_on_cheap_steps_go_deep_and_bad_ones_stop():
    pol = DraftPolicy(5)
    pol.observe_step(1, 0.1)
    pol.observe_step(6, 0.125)  # 5 % per extra token (a CPU)
    assert pol.depth(3, 5) > 0  # a 3-gram match is drafted on the prior
    assert pol.depth(1, 5) == 0  # a 1-gram match is not
    for _ in range(10):
        pol.observe_acceptance(3, 5, 5)
    assert pol.depth(3, 5) == 5 and pol.depth(3, 2) == 2  # within the cap
    for _ in range(20):
        pol.observe_acceptance(3, 5, 0)
    assert 0 < pol.depth(3, 5) < 5  # fewer after rejections
    for _ in range(20):
        pol.observe_acceptance(3, 5, 0)
    assert pol.depth(3, 5) == 0
    got = [pol.depth(3, 5) for _ in range(40)]  # given up: a one-token probe every 16 steps
    assert sorted(set(got)) == [0, 1] and 2 <= got.count(1) <= 3, got


def test_expensive_wide_steps_are_not_drafted():
    pol = DraftPolicy(5)
    pol.observe_step(1, 0.1)
    pol.observe_step(2, 0.2)  # a second token doubles the step
    for _ in range(10):
        pol.observe_acceptance("model", 1, 1)
    assert pol.depth("model", 5) == 0 or pol.value("model", pol.depth("model", 5)) > 1.02
    pol.observe_drafting(1, 0.5)  # and the draft model is slow
    assert pol.depth("model", 5) == 0


def test_cut_keeps_the_nodes_down_to_a_depth():
    d = Draft(tokens=[10, 11, 12, 20, 21, 13], parents=[-1, 0, 1, -1, 3, 2], match=3)
    c = _cut(d, 2)
    assert (c.tokens, c.parents, c.match) == ([10, 11, 20, 21], [-1, 0, -1, 2], 3)
    assert _cut(d, 0).tokens == [] and _cut(d, 9).tokens == d.tokens and _cut(d, 9).parents == d.parents


def test_lookup_takes_the_match_that_agrees_furthest_back():
    """Of the earlier places where the last 3 tokens occur, the draft continues the one whose
    context agrees furthest back (the earliest among equals), and says how far: the evidence."""
    a = [1, 2, 3, 4, 5, 6, 7]
    hist = [9, 8, 5, 6, 7, 40, 41] + [11, 4, 5, 6, 7, 50, 51] + [0, 3, 4, 5, 6, 7, 60, 61] + [2, 3, 4, 5, 6, 7]
    d = PromptLookup().propose(torch.tensor(hist), 2, 1)
    assert d.tokens == [60, 61] and d.match == 5  # "3 4 5 6 7" agrees 5 back; the others 3 and 4
    assert PromptLookup(max_context=4).propose(torch.tensor(hist), 2, 1).match == 4  # capped
    d = PromptLookup().propose(torch.tensor(hist), 2, 3)  # three continuations, by agreement: 5, 4, then 3
    assert d.tokens[:2] == [60, 61] and sorted(d.tokens) == [40, 41, 50, 51, 60, 61] and d.match == 5
    d = PromptLookup().propose(torch.tensor([5, 6, 7, 1] + [5, 6, 7, 2] + [5, 6, 7]), 1, 1)
    assert d.tokens == [1] and d.match == 3  # equals: the earliest, as transformers
    d = PromptLookup().propose(torch.tensor(a + [0] + a), 3, 1)  # the whole text repeats: 7 back, the start
    assert d.tokens == [0, 1, 2] and d.match == 7
    assert PromptLookup().propose(torch.tensor([1, 2, 3]), 2, 1).tokens == []


def test_lookup_follows_a_quote_past_an_edit():
    """A quote that changed a word (inserted, dropped or replaced up to 2 tokens) and went on
    quoting is followed once the match agrees, across the edit, 10 tokens back: ``match`` that
    length and ``resumed`` set; fewer, or an edit of 3 tokens, is a short match as before."""
    doc = list(range(100, 140))  # the document: 40 distinct tokens, then the answer quotes it
    q = doc[5:16]  # 105 .. 115: 8 tokens, the edit, then 3
    for edited, match in (
        (q[:8] + [7] + q[8:], 11),  # a word inserted (... 112 7 113 114 115)
        (q[:8] + [7, 8] + q[8:], 11),  # two tokens inserted
        (q[:8] + q[9:], 10),  # a word dropped (... 112 114 115)
        (q[:8] + [7] + q[9:], 10),  # a word replaced
        (q[:8] + [7, 8, 9] + q[8:], None),  # a 3-token insertion: another text, a 3-token match
        (q[1:8] + [7] + q[8:], 10),  # 7 + 3 agree
        (q[2:8] + [7] + q[8:], None),  # 6 + 3 = 9 < 10
    ):
        d = PromptLookup().propose(torch.tensor([1, 2] + doc + [3] + edited), 3, 1)
        assert d.tokens == [116, 117, 118], edited  # the document after the quote, either way
        assert (d.resumed, d.match) == ((True, match) if match else (False, 3)), edited


def _scan(history: list[int], k: int, width: int, max_ngram: int = 3, max_context: int = 16, resume: bool = True):
    """The lookup as a scan of the whole history (PromptLookup before its index): the oracle.
    ``resume=False``: as it was before it looked past an edit."""
    h = torch.tensor(history, dtype=torch.int64)
    L = len(h)
    for n in range(min(max_ngram, L - 1), 0, -1):
        hits = torch.nonzero((h[: L - 1].unfold(0, n, 1) == h[L - n :]).all(1)).flatten().tolist()
        ctx = []
        for i in hits:
            c = n
            for m in range(n + 1, max_context + 1):
                if i - (m - n) < 0 or L - m < 0 or history[i - (m - n)] != history[L - m]:
                    break
                c += 1
            ctx.append(c)
        if (
            resume and hits and n >= 2 and max(ctx) < 6 and len(hits) <= 64
        ):  # a quote that resumed past one edit of <= 2 tokens
            past = []
            for c, i in zip(ctx, hits, strict=True):
                a, b, e = L - c - 1, i + n - c - 1, 0
                for da in range(3):
                    for db in range(3):
                        t = 0
                        while (
                            (da or db)
                            and c + t < max_context
                            and 0 <= b - db - t < a - da - t
                            and history[b - db - t] == history[a - da - t]
                        ):
                            t += 1
                        e = max(e, t)
                past.append(c + e)
            if max(past) >= 10:
                ctx = past
        conts, match = [], None
        for m, i in sorted(zip(ctx, hits, strict=True), key=lambda x: -x[0]):
            c = history[i + n : i + n + k]
            if c and c not in conts:
                conts.append(c)
                match = m if match is None else match
            if len(conts) == width:
                break
        if conts:
            return conts, match
    return [], None


def test_lookup_of_edited_quotes_is_the_scan():
    """Answers that quote a document with edits (1-3 tokens inserted, dropped or replaced) and
    then other text: the index gives the scan's drafts and matches, resumed quotes included."""
    g, resumed = torch.Generator().manual_seed(1), 0

    def rnd(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    for trial in range(200):
        vocab = 6 + trial % 40
        doc = torch.randint(0, vocab, (rnd(20, 80),), generator=g).tolist()
        a = rnd(0, len(doc) - 12)
        quote = doc[a : a + rnd(8, 24)]
        for _ in range(rnd(1, 3)):  # edits
            at, cut, put = rnd(0, len(quote)), rnd(0, 3), rnd(0, 3)
            quote = quote[:at] + torch.randint(0, vocab, (put,), generator=g).tolist() + quote[at + cut :]
        hist = doc + torch.randint(0, vocab, (rnd(0, 4),), generator=g).tolist() + quote
        lk = PromptLookup(max_context=8 + trial % 12)
        for end in range(len(hist) - len(quote) + 2, len(hist) + 1):
            d = lk.propose(hist[:end], 4, 1)
            conts, match = _scan(hist[:end], 4, 1, lk.max_ngram, lk.max_context)
            assert d.tokens == (conts[0] if conts else []), (trial, end)
            assert (d.match if d.tokens else None) == match, (trial, end)
            resumed += d.resumed
            if not d.resumed:  # no edit looked past: the draft it gave before it looked
                conts, match = _scan(hist[:end], 4, 1, lk.max_ngram, lk.max_context, resume=False)
                assert d.tokens == (conts[0] if conts else []) and (d.match if d.tokens else None) == match
    assert resumed > 20  # resumed quotes were exercised


def test_lookup_index_is_the_scan():
    """The incremental n-gram index gives the scan's drafts: histories that grow a few tokens at
    a time, are cut back or replaced (indexed afresh), over small vocabularies (many matches),
    every width, depth and n-gram limit; tensors and lists alike."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        vocab = 3 + trial % 9
        lk = PromptLookup(max_ngram=1 + trial % 4, max_context=4 + trial % 14)
        hist = torch.randint(0, vocab, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        for step in range(40):
            r = int(torch.randint(0, 10, (1,), generator=g))
            if r == 0:  # cut back (a rewind): indexed afresh
                hist = hist[: len(hist) // 2]
            elif r == 1:  # another sequence of the same length
                hist = torch.randint(0, vocab, (len(hist),), generator=g).tolist()
            else:
                hist = hist + torch.randint(0, vocab, (1 + r % 3,), generator=g).tolist()
            k, width = 1 + step % 6, 1 + step % 3
            d = lk.propose(hist if step % 2 else torch.tensor(hist, dtype=torch.int64), k, width)
            conts, match = _scan(hist, k, width, lk.max_ngram, lk.max_context)
            want = _trie(conts) if conts else Draft()
            assert (d.tokens, d.parents) == (want.tokens, want.parents), (trial, step, hist)
            assert (d.match if d.tokens else None) == match


def test_evidence_of_long_matches_drafts_and_short_ones_wait():
    """Before a wide step was measured (a plain step only), a match agreeing 6 or more tokens
    back is drafted on its prior, one of 3 to 5 is not (a coincidental phrase: it waits for
    wide steps measured cheap, or drafts that paid); the buckets share their counts."""
    assert [evidence(n) for n in (1, 2, 3, 4, 5, 6, 32)] == [1, 2, 3, 4, 4, 6, 6] and evidence("model") == "model"
    pol = DraftPolicy(5)
    pol.observe_step(1, 0.1)
    assert pol.depth(6, 5) > 0 and pol.depth(20, 5) > 0
    assert pol.depth(3, 5) == pol.depth(4, 5) == pol.depth(5, 5) == 0
    pol.observe_step(2, 0.103)  # wide steps measured cheap (3 % a token): a 4-5 token match pays now
    assert pol.depth(5, 5) > 0
    for _ in range(10):
        pol.observe_acceptance(32, 5, 0)  # quotes that stopped: counted under 6, whatever the length
    assert pol.alpha(7) == pol.alpha(6) < 0.2 and pol.alpha(3) > 0.3
    for _ in range(20):
        pol.observe_step(2, 0.15)  # wide steps turn out costly
    assert pol.depth(6, 5) == 0


def test_a_drafted_steps_cost_includes_committing_it(monkeypatch):
    """The policy's cost of a drafted step is the step and its :meth:`Session.keep` (the kept
    tokens' K/V stored into the cache), not the forward alone: a keep slowed by 0.2 s shows."""
    from treeattn.decoding.sampler import Sampler
    from treeattn.decoding.speculative import Speculator
    from treeattn.hf.presets import build_model
    from treeattn.runtime import Session

    m = build_model("tiny-llama", None, torch.float64, seed=0)[0]
    s = Session(m)
    base = torch.randint(0, m.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    s.extend(torch.cat([base, base], 1))  # prompt lookup matches 12 tokens back from here on
    sp = Speculator(PromptLookup(), 3, 1, Sampler(), adaptive=True)
    seen = []
    real_observe = sp.policy.observe_step
    monkeypatch.setattr(sp.policy, "observe_step", lambda T, sec: (seen.append((T, sec)), real_observe(T, sec)))
    real_keep = s.keep

    def slow_keep(*a, **k):
        import time

        time.sleep(0.2)
        return real_keep(*a, **k)

    monkeypatch.setattr(s, "keep", slow_keep)
    for _ in range(4):  # the pending token always continues the repeated text: drafts after the first step
        sp.step(s, int(base[0, len(s) % 12]), 20)
    drafted = [sec for T, sec in seen if T > 1]
    assert drafted and min(drafted) >= 0.2, seen
    assert all(sec < 0.2 for T, sec in seen if T == 1), seen  # a plain step keeps nothing
