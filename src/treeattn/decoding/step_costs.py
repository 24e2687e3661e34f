"""What speculation weighs, measured as it runs: the one step-cost model of ``generate``'s
:class:`~treeattn.decoding.draft_policy.DraftPolicy` and the server's batch drafting
(:class:`treeattn.serve.drafts.BatchDrafts`).

A step's wall time by its token count is an EMA per count (:class:`StepCosts`); a count not
measured is interpolated linearly between the nearest measured counts, extrapolated beyond them
with the slope of the two nearest, and, while one count alone was measured, priced at
:data:`BETA0` of that step's per-token share for each extra token (what a 2-core CPU measured:
torch's linear layers take one token's rows much faster than two, docs/benchmarks/session.md; a GPU,
where wide steps cost next to nothing, finds that out at its first draft). Drafting and catching
up are rates in seconds per token (:class:`Rate`). A draft is worth making only where it
promises :data:`MARGIN` more tokens per second."""

from __future__ import annotations

MARGIN = 0.02  # a draft must promise 2 % more tokens per second than not drafting
BETA0 = 0.5  # prior cost of each extra token, relative to a one-token step's per-token share
_PAST = 0.7  # an EMA's weight of the past per observation


class Rate:
    """An EMA of seconds per unit (0.0 until measured)."""

    def __init__(self) -> None:
        self.value = 0.0

    def observe(self, units: int, seconds: float) -> None:
        if units > 0:
            s = seconds / units
            self.value = s if not self.value else _PAST * self.value + (1 - _PAST) * s


class StepCosts:
    """A step's seconds by its token count, measured (``seconds``: count -> EMA)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def __contains__(self, n: int) -> bool:
        return n in self.seconds

    def observe(self, n: int, seconds: float) -> None:
        old = self.seconds.get(n)
        self.seconds[n] = seconds if old is None else _PAST * old + (1 - _PAST) * seconds

    def estimate(self, n: int) -> float | None:
        """Seconds of a step of ``n`` tokens (None: nothing measured yet)."""
        c = self.seconds
        if not c:
            return None
        if n in c:
            return c[n]
        known = sorted(c)
        lo = max((t for t in known if t < n), default=None)
        hi = min((t for t in known if t > n), default=None)
        if lo is not None and hi is not None:
            return c[lo] + (c[hi] - c[lo]) * (n - lo) / (hi - lo)
        if len(known) >= 2:  # beyond the measured counts: the slope of the two nearest
            a, b = (known[-2], known[-1]) if hi is None else (known[0], known[1])
            ref = b if hi is None else a
            return max(c[ref] + max(0.0, (c[b] - c[a]) / (b - a)) * (n - ref), 1e-9)
        (t,) = known
        return c[t] * max(1.0 + BETA0 * (n - t) / t, 1e-3)

    def relative(self, n: int, base: int = 1) -> float:
        """A step of ``n`` tokens against one of ``base`` tokens (the prior until ``base`` is measured)."""
        if base not in self.seconds:
            return 1.0 + BETA0 * (n - base) / base
        return self.estimate(n) / self.seconds[base]


def expected_tokens(a: float, d: int) -> float:
    """Tokens a draft of depth ``d`` commits in expectation at per-position acceptance ``a``
    (the target's own token included): ``1 + a + ... + a^d``."""
    return sum(a**i for i in range(d + 1))
