"""Speculative decoding inside the batched step (rank 0's side).

Each decoding request may draft a chain: by prompt lookup, from its own prompt and answer
(the continuation of the latest n-gram found earlier, so a question about a document drafts
from the document), or from a draft model (a smaller LM with the same tokenizer, run on rank
0 alone, greedy). Its line in the step's forward is then its pending token followed by the
draft, with logits at every token; the target's own choice at each position (greedy, or one
draw of the request's sampler) is emitted while it matches the draft, plus the first
mismatch or the token after a fully accepted draft. One choice per emitted token, made
exactly as without speculation: answers are identical to plain decoding's, greedy or seeded
sampling alike. The rejected tokens are trimmed from the row at the next step.

How deep each request drafts: a draft of ``d`` tokens with per-position acceptance ``a``
brings ``1 + a + ... + a^d`` tokens in expectation, and makes the whole step wider (and, with
a draft model, costs ``d`` draft forwards on rank 0 while the other ranks wait). The batch's
step time by its token count ``N`` is measured as the server runs (decode-only steps; until a
second width is measured each extra token is assumed to cost half a one-token step's share),
and so is a draft model's time per drafted token; rows are taken best evidence first, and a
row drafts ``d`` tokens only if the batch's expected tokens per second rise by
:data:`MARGIN`. The acceptance of each request is tracked per kind of evidence (prompt
lookup: how far back its match agrees, 1, 2, 3, 4-5 or 6 and more tokens; a draft model: one
kind), in :class:`~treeattn.decoding.draft_policy.DraftPolicy`'s counts: sceptical of matches
shorter than 6 tokens, recent steps weighing most, starting from what the server's earlier
drafts did; a request that stopped drafting gets a one-token probe now and then.

A draft model keeps a KV cache per request (:class:`DraftPool`): a request takes the idle
cache that shares the longest prefix with its sequence, or a copy of a running one's when
that shares more (the questions about one document prefill the document once in the draft
model, a chunk per step), and gives it back when it ends.
"""

from __future__ import annotations

import sys
import time

import torch

from ..decoding.draft_policy import PROBE, DraftPolicy
from ..decoding.prompt_lookup import PromptLookup
from ..decoding.speculative import DraftModel, follow
from ..decoding.step_costs import MARGIN, Rate, StepCosts, expected_tokens
from ..hf.families import max_positions

# MARGIN (generate's too): the batch's tokens per second must rise 2 %. Replayed over 4 requests at
# once with the step costs a server measured (benchmarks/server_draft_replay.py, docs/benchmarks/
# serving.md), 10 % left drafts undrafted that paid: quoting answers 0.84-0.87 of plain's decode time
# after the first round, 0.77-0.79 with 2 %; answers that do not quote the text 0.646-0.655 and 0.650-0.660
MODEL = "model"  # the kind of a draft model's drafts
_SYNC_MAX = 8  # a drafting call that first ran more new tokens than this (a prompt, a catch-up) is not timed
# a draft model catching up with prompts it has not seen takes at most this share of a step's
# time (all requests together), measured: a draft model as costly as the target ran 256 tokens
# a step and made the batched server 5x slower (0.19-0.20x plain's tokens/s, 2026-11-27)
_CATCHUP = 0.05
_CATCHUP_FIRST = 16  # the first catch-up's tokens, which measure its rate


class DraftPool:
    """A draft model's KV caches, one per drafting request (rank 0). Idle ones are kept for
    later requests while all the caches together hold at most ``tokens`` tokens (the oldest
    idle ones go first); past that budget a request starts no cache of its own (it does not
    draft). A request's tokens its cache has not seen (a new prompt) run ``chunk`` per step,
    without a draft, so a long document does not hold up the batch's steps (with the batch's cost
    model, fewer: :meth:`BatchDrafts.catchup_tokens`)."""

    def __init__(self, model: torch.nn.Module, tokens: int, chunk: int = 256) -> None:
        self.model, self.tokens, self.chunk = model, tokens, chunk  # chunk: prompt tokens run per step
        self.max_pos = max_positions(model.config) or (1 << 62)
        self.idle: list[DraftModel] = []
        self.busy: list[DraftModel] = []

    def held(self) -> int:
        """Tokens the caches hold."""
        return sum(len(d.ids) for d in self.idle + self.busy)

    def take(self, history: list[int]) -> DraftModel | None:
        """The cache for a request whose sequence is ``history``: the idle one sharing most of
        it, a copy of a running one's where that shares more, else a new one; None when a new
        cache would not fit the budget."""
        best_idle = max(self.idle, key=lambda d: d.common(history), default=None)
        best_busy = max(self.busy, key=lambda d: d.common(history), default=None)
        n_idle = best_idle.common(history) if best_idle is not None else 0
        n_busy = best_busy.common(history) if best_busy is not None else 0
        if best_idle is not None and n_idle >= n_busy and n_idle:
            self.idle.remove(best_idle)
            d = best_idle
        else:
            self._fit(len(history))
            if sum(len(x.ids) for x in self.busy) + len(history) > self.tokens:
                return None
            d = best_busy.fork(n_busy) if best_busy is not None and n_busy else DraftModel(self.model)
        self.busy.append(d)
        return d

    def give(self, d: DraftModel) -> None:
        """A request ended: its cache may serve a later one."""
        self.busy.remove(d)
        self.idle.append(d)
        self._fit(0)

    def drop(self, d: DraftModel) -> None:
        """A cache in an unknown state (its drafting failed): forgotten."""
        if d in self.busy:
            self.busy.remove(d)

    def _fit(self, more: int) -> None:
        while self.idle and self.held() + more > self.tokens:
            self.idle.pop(0)


class RowDrafts:
    """One request's drafting: its acceptance by evidence, and what it was offered and kept.
    ``pool``: the server's acceptance so far, which a new request starts from (what earlier
    requests' drafts did is the best prior of what this one's will do)."""

    def __init__(self, k_max: int, pool: DraftPolicy | None = None, drafters: DraftPool | None = None) -> None:
        self.policy, self.pool = DraftPolicy(k_max), pool
        if pool is not None:
            self.policy.counts = {kind: list(c) for kind, c in pool.counts.items()}
        self.lookup = PromptLookup()
        self.drafters, self.model = drafters, None  # with a draft model: the pool, and this request's cache
        self.failed = False  # its draft model raised (or no cache fitted): it drafts no more
        self.k_max = k_max
        self.idle = 0  # steps since it last drafted
        self.offered = self.accepted = self.verified = 0  # tokens offered, accepted; steps that verified
        self._offer: list[int] = []

    def candidate(self, history: list[int], cap: int) -> tuple[list[int], int]:
        """(the longest draft prompt lookup offers within ``cap``, how far back its match agrees)."""
        if cap < 1 or len(history) < 2:
            return [], 0
        d = self.lookup.propose(history, min(cap, self.k_max), 1)  # a list: its index grows with it
        return d.tokens, d.match

    def offer(self, history: list[int], cap: int) -> tuple[int, object]:
        """(how deep this request may draft now, the kind of evidence); :meth:`draft` then gives
        the tokens. Prompt lookup finds its draft here; a draft model drafts only in :meth:`draft`."""
        if self.drafters is not None:
            cap = min(cap, self.k_max, self.drafters.max_pos - len(history))  # the draft model's positions
            return (cap, MODEL) if cap >= 1 and not self.failed else (0, MODEL)
        self._offer, kind = self.candidate(history, cap)
        return len(self._offer), kind

    def draft(self, history: list[int], d: int, batch: BatchDrafts | None = None) -> list[int]:
        """The first ``d`` tokens of this request's draft after ``history`` (a draft model's
        time per drafted token goes to ``batch``'s cost model)."""
        if d < 1:
            return []
        if self.drafters is None:
            return self._offer[:d]
        try:  # rank 0 alone: a failure here must not reach the step (the other ranks wait for its plan)
            if self.model is None:
                self.model = self.drafters.take(history)
                if self.model is None:  # the caches are full
                    self.failed = True
                    return []
            fresh = len(history) - self.model.common(history)
            most = fresh
            if fresh > _SYNC_MAX:  # a prompt the draft model has not seen: a few tokens per step
                most = self.drafters.chunk if batch is None else batch.catchup_tokens(self.drafters.chunk, fresh)
            if fresh > most:  # while the batch goes on; no draft yet
                if most > 0:
                    t = time.perf_counter()
                    self.model.advance(history, most)
                    if batch is not None:
                        batch.observe_catchup(most, time.perf_counter() - t)
                return []
            t = time.perf_counter()
            toks = self.model.propose(torch.tensor(history, dtype=torch.int64), d, 1).tokens
        except Exception as err:  # noqa: BLE001 - e.g. out of memory: this request stops drafting
            if self.model is not None:
                self.drafters.drop(self.model)
            self.model, self.failed = None, True
            print(f"treeattn serve: the draft model failed ({type(err).__name__}: {err}); this request drafts no "
                  "more", file=sys.stderr, flush=True)  # fmt: skip
            return []
        if batch is not None and fresh <= _SYNC_MAX:  # d forwards; a long catch-up (a prompt) is not timed
            batch.observe_drafting(len(toks), time.perf_counter() - t)
        return toks

    def release(self) -> None:
        """The request ended: its draft model cache goes back to the pool."""
        if self.model is not None:
            self.drafters.give(self.model)
            self.model = None

    def expected(self, kind: int, d: int) -> float:
        return expected_tokens(self.policy.alpha(kind), d)

    def observe(self, kind: int, offered: int, accepted: int) -> None:
        self.policy.observe_acceptance(kind, offered, accepted)
        if self.pool is not None:
            self.pool.observe_acceptance(kind, offered, accepted)
        self.offered += offered
        self.accepted += accepted
        self.verified += 1


class BatchDrafts:
    """The batch's step cost by token count, and each step's choice of draft depths
    (``fixed``: every candidate draft whole, no cost model)."""

    def __init__(self, fixed: bool = False) -> None:
        self.costs = StepCosts()  # tokens in a decode-only step -> EMA seconds (decoding.step_costs: generate's model)
        self.fixed = fixed
        self.pool = DraftPolicy(1)  # acceptance by evidence over every request (its counts only)
        self.drafting = Rate()  # a draft model's seconds per drafted token (0: none measured yet)
        self.catchup = Rate()  # a draft model's seconds per prompt token caught up with
        self.catchup_left = 0.0  # seconds of catching up left in this step

    @property
    def cost(self) -> dict[int, float]:
        """A decode-only step's measured seconds by its tokens."""
        return self.costs.seconds

    def observe_step(self, n: int, seconds: float) -> None:
        self.costs.observe(n, seconds)

    def observe_drafting(self, tokens: int, seconds: float) -> None:
        self.drafting.observe(tokens, seconds)

    def observe_catchup(self, tokens: int, seconds: float) -> None:
        self.catchup.observe(tokens, seconds)

    def catchup_tokens(self, most: int, fresh: int) -> int:
        """Prompt tokens a draft model may run in this step to catch up with ``fresh`` unseen
        ones: what fits the step's catch-up time (:data:`_CATCHUP` of a step) at the measured
        rate, at most ``most``; :data:`_CATCHUP_FIRST` while the rate is unmeasured. ``fresh``
        itself when it all fits (the draft then runs in the same call). ``fixed``: no cost
        model, ``most`` a step."""
        if self.fixed:
            return min(fresh, most)
        rate = self.catchup.value
        n = min(most, _CATCHUP_FIRST) if not rate else max(0, min(most, int(self.catchup_left / rate)))
        n = fresh if fresh <= n else n
        self.catchup_left -= n * rate
        return n

    def step_cost(self, n: int) -> float | None:
        """Estimated seconds of a decode-only step of ``n`` tokens (None: nothing measured)."""
        return self.costs.estimate(n)

    def _probe_pays(self, rd: RowDrafts, per: float, rows: int) -> bool:
        """Whether a one-token probe is due: always for prompt lookup; for a draft model, whose
        probe first catches up with the tokens since it last drafted (one forward of them,
        priced as two drafted tokens), once it costs within 5 % of the steps it waited: a
        costly draft model is probed rarely, but never given up for good."""
        return 2.0 * per <= 0.05 * rd.idle * self.step_cost(rows)

    def choose(self, rows: int, cands: list[tuple[RowDrafts, int, object]]) -> list[int]:
        """Draft depths for ``cands`` ((request, how deep it may draft, its kind of evidence)) in
        a step of ``rows`` decoding requests: a depth only where the batch's tokens per second
        gain (a draft model's drafting time counted in)."""
        if self.fixed:
            return [c[1] for c in cands]
        depth = [0] * len(cands)
        if self.step_cost(rows) is None:  # a plain step first: the yardstick
            return depth
        self.catchup_left = _CATCHUP * self.step_cost(rows)
        n, tokens, drafting = rows, float(rows), 0.0
        order = sorted(range(len(cands)), key=lambda i: -cands[i][0].policy.alpha(cands[i][2]))
        for i in order:
            rd, cap, kind = cands[i]
            per = self.drafting.value if kind == MODEL else 0.0
            best, best_v = 0, tokens / (self.step_cost(n) + drafting) * (1.0 + MARGIN)
            for d in range(1, cap + 1):
                v = (tokens - 1.0 + rd.expected(kind, d)) / (self.step_cost(n + d) + drafting + d * per)
                if v > best_v:
                    best, best_v = d, v
            if best == 0 and cap and rd.idle + 1 >= PROBE and self._probe_pays(rd, per, rows):
                best = 1  # a probe: acceptance may have changed
            rd.idle = 0 if best else rd.idle + 1
            if best:
                depth[i] = best
                n += best
                tokens += rd.expected(kind, best) - 1.0
                drafting += best * per
        return depth


def verify(logits: torch.Tensor, draft: list[int], choose) -> list[int]:
    """The tokens a step emits for a line of the pending token and ``draft`` (a chain):
    :func:`treeattn.decoding.speculative.follow`'s accepted draft tokens and the target's next."""
    path, nxt = follow(logits, [-1] + draft, list(range(-1, len(draft))), choose)
    return draft[: len(path) - 1] + [nxt]
