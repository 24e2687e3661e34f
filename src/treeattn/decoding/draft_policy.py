"""How many tokens to draft: speculation that does not cost more than it saves.

A step that verifies ``T`` tentative tokens costs ``c(T)`` seconds, ``c(1)`` for a plain one.
With a per-position acceptance rate ``a``, a draft of ``d`` tokens commits
``E(d) = 1 + a + ... + a^d`` tokens per step in expectation, so its value against plain
decoding is ``E(d) c(1) / (c(d + 1) + drafting time)``; the policy drafts the ``d`` with the
best value, and nothing unless that value beats plain decoding by :data:`MARGIN`.

Both sides are measured on rank 0 as the generation runs:

- **cost**: each step's wall time by its token count (collective waits included: what the
  step really costs on this machine), and the drafter's time per drafted token, in the one
  step-cost model of speculation (:mod:`treeattn.decoding.step_costs`, the server's too). The first
  step is plain, to measure the yardstick; while only plain steps were seen, each extra token
  is priced at :data:`~treeattn.decoding.step_costs.BETA0` of a plain step, so only strong evidence
  drafts before a wide step was measured.
- **acceptance**, per kind of evidence: prompt lookup's drafts by how far back their match
  agrees with the text (:func:`evidence`: 1, 2, 3, 4-5 or 6 and more tokens; a coincidental
  phrase matches 3 or 4, a quote 6 and more), a draft model's as one kind. A
  discounted Beta count: recent steps weigh most (an answer that starts quoting the document
  is noticed within a few steps, one that stops quoting as fast), and the prior is sceptical
  of short matches, so a match shorter than 6 tokens is drafted only after such drafts were
  seen to pay, or once wide steps were measured cheap enough for its prior. A kind
  not drafted for a while gets a one-token probe (every :data:`PROBE` steps at least, rarer
  where a wide step is expensive: probes cost under 1 % of the time), so a change of regime
  is found again.

Only draft lengths change: verification is untouched, so greedy output stays plain greedy's
and sampling stays lossless.
"""

from __future__ import annotations

from .step_costs import BETA0, MARGIN, Rate, StepCosts, expected_tokens

__all__ = ["BETA0", "MARGIN", "PROBE", "DraftPolicy", "evidence"]
_DISCOUNT = 0.9  # weight of the past per observation of a kind
# Beta(a, b) of prompt lookup by evidence (the match's length, :func:`evidence`). From two real
# answers over a 7.7k-token document (SmolLM2-135M, GPL-3, benchmarks/speculative.py), replayed
# with measured step costs: one that does not quote drafted a 4-token match, rejected, with
# (1.5, 1) for every length from 3 (1.7 % slower than plain), none with these; one that quotes
# (its matches reach 6 to 32 tokens) went from 0.80x to 0.71x plain's time. 2-token matches:
# with a prior of 1/3, 4 of 24 such drafts had their first token accepted over six answers
# (benchmarks/draft_replay.py: quoting, paraphrasing and not quoting, over wrapped and unwrapped
# text), hence 0.2; replayed with 2-token steps at 1.15-1.25x a plain one, the paraphrasing
# answer went from 1.027-1.030x to 1.018-1.023x plain's time over 33 tokens, and no answer
# lost more than 0.013x
_PRIOR = {1: (0.25, 4.0), 2: (0.5, 2.0), 3: (1.0, 1.5), 4: (1.0, 1.0), 6: (2.0, 1.0)}
_MODEL_PRIOR = (1.0, 1.0)
PROBE = 16  # a kind not drafted for this many steps of its evidence gets a 1-token draft


QUOTE = 6  # a prompt-lookup match agreeing this far back: a quote (the last bucket of its evidence)


def evidence(kind):
    """The kind of evidence a draft is counted under: prompt lookup's match length bucketed
    (1, 2, 3, 4 for 4-5, 6 for 6 and more), anything else as is."""
    if isinstance(kind, int) and not isinstance(kind, bool):
        return kind if kind <= 3 else 4 if kind < QUOTE else QUOTE
    return kind


class DraftPolicy:
    """Per generation (one request): the draft length from measured costs and acceptance."""

    def __init__(self, k_max: int, width: int = 1) -> None:
        self.k_max, self.width = k_max, width
        self.costs = StepCosts()  # step tokens -> EMA seconds
        self.drafting = Rate()  # seconds of drafting per drafted depth
        self.counts: dict[object, list[float]] = {}  # kind -> [accepted, rejected], discounted
        self.idle: dict[object, int] = {}  # kind -> steps since it was last drafted

    # -- estimates -------------------------------------------------------------------------
    def _counts(self, kind) -> list[float]:
        kind = evidence(kind)
        if kind not in self.counts:  # the prior, as counts that fade like any observation
            self.counts[kind] = list(_PRIOR.get(kind, (1.5, 1.0)) if isinstance(kind, int) else _MODEL_PRIOR)
        return self.counts[kind]

    def alpha(self, kind) -> float:
        a, b = self._counts(kind)
        return a / (a + b)

    def step_cost(self, T: int) -> float:
        """Estimated seconds of a step of ``T`` tokens, relative to a plain step (1.0)."""
        return 1.0 if T == 1 else self.costs.relative(T)

    def value(self, kind, d: int) -> float:
        """Expected tokens per unit of time of a draft of depth ``d``, plain decoding = 1."""
        if d == 0:
            return 1.0
        c1 = self.costs.seconds.get(1)
        drafting = d * self.drafting.value / c1 if c1 else 0.0
        return expected_tokens(self.alpha(kind), d) / (self.step_cost(1 + d * self.width) + drafting)

    def depth(self, kind, cap: int) -> int:
        """The draft depth to offer (0: a plain step) for evidence ``kind`` within ``cap``."""
        if 1 not in self.costs:  # a plain step first: the yardstick of every other
            return 0
        kind = evidence(kind)
        best, best_v = 0, 1.0 + MARGIN
        for d in range(1, min(cap, self.k_max) + 1):
            v = self.value(kind, d)
            if v > best_v:
                best, best_v = d, v
        idle = self.idle.get(kind, 0) + 1 if best == 0 else 0
        if idle >= self._probe_every():  # a kind given up on is tried again now and then: it may pay by now
            best, idle = 1, 0
        self.idle[kind] = idle
        return best

    def _probe_every(self) -> float:
        """Steps between one-token probes: at least :data:`PROBE`, and enough that a probe's
        extra cost stays under 1 % of the time."""
        c1 = self.costs.seconds.get(1)
        extra = self.step_cost(1 + self.width) - 1.0 + (self.drafting.value / c1 if c1 else 0.0)
        return max(PROBE, extra / 0.01)

    # -- measurements ----------------------------------------------------------------------
    def observe_step(self, T: int, seconds: float) -> None:
        self.costs.observe(T, seconds)

    def observe_drafting(self, depth: int, seconds: float) -> None:
        self.drafting.observe(depth, seconds)

    def observe_acceptance(self, kind, offered: int, accepted: int) -> None:
        """A draft of depth ``offered`` whose accepted path was ``accepted`` deep: ``accepted``
        successes, and a failure at the first rejected position (if any)."""
        if offered <= 0:
            return
        c = self._counts(kind)
        c[0] = c[0] * _DISCOUNT + accepted
        c[1] = c[1] * _DISCOUNT + (1.0 if accepted < offered else 0.0)
