"""Drafts, and the drafter that needs no model: a :class:`Draft` is a chain or a token tree
after the pending token, and :class:`PromptLookup` proposes one from the sequence itself (the
continuation of its latest n-gram found earlier: a document the answer quotes, or the answer's
own repetitions). :mod:`treeattn.decoding.speculative` verifies drafts in one step; the batched
server (:mod:`treeattn.serve.drafts`) drafts with the same lookup."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from .draft_policy import QUOTE

# prompt lookup: a short match whose agreement goes on this far past one edit is a quote that resumed
# (benchmarks/draft_replay.py's answers: from 6 on, 4 of the 7 such drafts made were rejected at
# once, paraphrases past a common phrase; the ones of 10 and more were quotes)
RESUMED = 10
_EDIT = 2  # prompt lookup: the most tokens one edit of a quote inserts, drops or changes
_RESUME_HITS = 64  # a last n-gram found at more earlier places (a common one) is not looked past an edit at


@dataclass
class Draft:
    """Tokens after the pending token: ``parents[i]`` indexes ``tokens`` (-1: the pending
    token). For drafts sampled from a draft model: ``q [n, V]``, the distribution each token
    was drawn from, and ``trials``: per parent (-1: the pending token) its children in the
    order they were drawn, duplicates included (node indices); None for deterministic drafts."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: Tensor | None = None
    trials: dict[int, list[int]] | None = None
    match: int = 0  # prompt lookup: how far back the followed match agrees (its n-gram and more)
    resumed: bool = False  # prompt lookup: ``match`` counts across one edit (a quote that resumed); informational


class PromptLookup:
    """Continuations of the latest n-gram (``max_ngram`` down to 1 tokens) found earlier in the
    sequence, as transformers' ``prompt_lookup_num_tokens``, except which earlier match: the one
    whose context agrees furthest back (up to ``max_context`` tokens; the earliest among equals),
    whose continuation is the likeliest, and the draft's ``match`` is that context's length, the
    evidence :class:`~treeattn.decoding.draft_policy.DraftPolicy` weighs (an answer that quotes the
    document matches 6 and more tokens back, a coincidental phrase 3). Where no match agrees 6
    tokens back, a match of 2 or 3 tokens whose agreement goes on past one edit (up to
    :data:`_EDIT` tokens the answer inserted, dropped or changed) to :data:`RESUMED` tokens in
    all is followed instead, ``match`` that length and ``resumed`` set: a quote that changed a
    word and goes on quoting (one that resumes fewer tokens back is too often a paraphrase: a
    common phrase, then the paraphrase's own words). Only the last n-grams found at most
    :data:`_RESUME_HITS` times are looked past an edit at. With ``width > 1`` the
    continuations of up to ``width`` distinct matches, in that order, merged into a trie.

    The n-grams of the history are indexed once and extended as it grows (a history that does
    not begin with the last one is indexed afresh): a lookup over a long document costs a few
    dictionary reads, not a scan of it (a scan cost ~1 ms per step over 7.8k tokens, on rank 0,
    while the other ranks wait)."""

    def __init__(self, max_ngram: int = 3, max_context: int = 16) -> None:
        self.max_ngram, self.max_context = max_ngram, max_context
        self._seen: list[int] = []  # the history indexed so far
        self._at: list[dict] = [{} for _ in range(max_ngram + 1)]  # n -> n-gram -> its starts, ascending

    def _index(self, h: list[int]) -> None:
        """Index the n-grams of ``h`` that end before its last token."""
        old = len(self._seen)
        if len(h) < old or h[:old] != self._seen:
            self._seen, self._at, old = [], [{} for _ in range(self.max_ngram + 1)], 0
        for n in range(1, self.max_ngram + 1):
            at = self._at[n]
            for i in range(max(0, old - n), len(h) - n):
                at.setdefault(tuple(h[i : i + n]), []).append(i)
        self._seen.extend(h[old:])

    def propose(self, history: Tensor | list[int], k: int, width: int) -> Draft:
        h = history.tolist() if isinstance(history, Tensor) else history  # read, never changed
        self._index(h)
        L = len(h)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            hits = self._at[n].get(tuple(h[L - n :]))
            if not hits:
                continue
            ctx = [self._context(h, i, n) for i in hits]
            resumed = False
            if n >= 2 and max(ctx) < QUOTE and len(hits) <= _RESUME_HITS:  # a quote past an edit?
                past = [c + self._past_edit(h, i + n - c - 1, L - c - 1, c) for c, i in zip(ctx, hits, strict=True)]
                if max(past) >= RESUMED:
                    ctx, resumed = past, True
            order = sorted(zip(ctx, hits, strict=True), key=lambda x: -x[0])  # stable: the earliest among equals
            conts: list[list[int]] = []
            for m, i in order:
                c = h[i + n : i + n + k]
                if c and c not in conts:
                    conts.append(c)
                    if len(conts) == 1:
                        match = m
                if len(conts) == width:
                    break
            if conts:
                d = _trie(conts)
                d.match, d.resumed = match, resumed
                return d
        return Draft()

    def _context(self, h: list[int], i: int, n: int) -> int:
        """How many tokens back (``n`` and more, at most ``max_context``) the match of the last
        ``n`` tokens at ``i`` agrees with the end of the history."""
        L, c = len(h), n
        for m in range(n + 1, self.max_context + 1):  # does token L - m agree with token i - (m - n)?
            p = i - (m - n)
            if p < 0 or L - m < 0 or h[p] != h[L - m]:
                break
            c += 1
        return c

    def _past_edit(self, h: list[int], b: int, a: int, c: int) -> int:
        """How many tokens agree before the first disagreement (source token ``b``, history token
        ``a``) once one edit is skipped there (up to :data:`_EDIT` tokens inserted, dropped or
        changed: the best), up to ``max_context`` in all with the ``c`` after it."""
        best = 0
        for da, db in ((x, y) for x in range(_EDIT + 1) for y in range(_EDIT + 1) if x or y):
            e, x, y = 0, a - da, b - db
            while c + e < self.max_context and 0 <= y < x and h[y] == h[x]:
                e, x, y = e + 1, x - 1, y - 1
            best = max(best, e)
        return best


def _cut(d: Draft, depth: int) -> Draft:
    """The nodes of a deterministic draft down to ``depth``."""
    keep, index, out = [], {-1: -1}, Draft(match=d.match, resumed=d.resumed)
    for i, (t, a) in enumerate(zip(d.tokens, d.parents, strict=True)):
        lvl = 1 if a < 0 else keep[a] + 1
        keep.append(lvl)
        if lvl <= depth:
            index[i] = len(out.tokens)
            out.tokens.append(t)
            out.parents.append(index[a])
    return out


def _trie(conts: list[list[int]]) -> Draft:
    d, index = Draft(), {}
    for c in conts:
        parent = -1
        for t in c:
            key = (parent, t)
            if key not in index:
                index[key] = len(d.tokens)
                d.tokens.append(t)
                d.parents.append(parent)
            parent = index[key]
    return d
