"""Speculative decoding inside the batched step (rank 0's side).

Each decoding request may draft a chain from its own prompt and answer (prompt lookup: the
continuation of the latest n-gram found earlier, so a question about a document drafts from
the document). Its line in the step's forward is then its pending token followed by the
draft, with logits at every token; the target's own choice at each position (greedy, or one
draw of the request's sampler) is emitted while it matches the draft, plus the first
mismatch or the token after a fully accepted draft. One choice per emitted token, made
exactly as without speculation: answers are identical to plain decoding's, greedy or seeded
sampling alike. The rejected tokens are trimmed from the row at the next step.

How deep each request drafts: a draft of ``d`` tokens with per-position acceptance ``a``
brings ``1 + a + ... + a^d`` tokens in expectation, and makes the whole step wider. The
batch's step time by its token count ``N`` is measured as the server runs (decode-only steps;
until a second width is measured each extra token is assumed to cost half a one-token
step's share); rows are taken best evidence first, and a row drafts ``d`` tokens only if the
batch's expected tokens per second rise by :data:`MARGIN`. The
acceptance of each request is tracked per n-gram length of its matches
(:class:`~treeattn.hf._draft_policy.DraftPolicy`'s counts: sceptical of 1-gram matches, recent
steps weighing most), starting from what the server's earlier drafts did; a request that
stopped drafting gets a one-token probe now and then.
"""

from __future__ import annotations

import torch

from ..hf._draft_policy import _BETA0, _PROBE, DraftPolicy
from ..hf.speculative import PromptLookup

MARGIN = 0.1  # a draft must promise the batch 10 % more tokens per second: its acceptance is an optimistic guess


class RowDrafts:
    """One request's drafting: its acceptance by evidence, and what it was offered and kept.
    ``pool``: the server's acceptance so far, which a new request starts from (what earlier
    requests' drafts did is the best prior of what this one's will do)."""

    def __init__(self, k_max: int, pool: DraftPolicy | None = None) -> None:
        self.policy, self.pool = DraftPolicy(k_max), pool
        if pool is not None:
            self.policy.counts = {kind: list(c) for kind, c in pool.counts.items()}
        self.lookup = PromptLookup()
        self.k_max = k_max
        self.idle = 0  # steps since it last drafted
        self.offered = self.accepted = self.verified = 0  # tokens offered, accepted; steps that verified

    def candidate(self, history: list[int], cap: int) -> tuple[list[int], int]:
        """(the longest draft prompt lookup offers within ``cap``, the n-gram length it matched)."""
        if cap < 1 or len(history) < 2:
            return [], 0
        d = self.lookup.propose(torch.tensor(history, dtype=torch.int64), min(cap, self.k_max), 1)
        return d.tokens, d.match

    def expected(self, kind: int, d: int) -> float:
        a = self.policy.alpha(kind)
        return sum(a**i for i in range(d + 1))

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
        self.cost: dict[int, float] = {}  # tokens in a decode-only step -> EMA seconds
        self.fixed = fixed
        self.pool = DraftPolicy(1)  # acceptance by evidence over every request (its counts only)

    def observe_step(self, n: int, seconds: float) -> None:
        old = self.cost.get(n)
        self.cost[n] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def step_cost(self, n: int) -> float | None:
        """Estimated seconds of a decode-only step of ``n`` tokens (None: nothing measured)."""
        if not self.cost:
            return None
        if n in self.cost:
            return self.cost[n]
        known = sorted(self.cost)
        lo = max((t for t in known if t < n), default=None)
        hi = min((t for t in known if t > n), default=None)
        if lo is not None and hi is not None:
            return self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (n - lo) / (hi - lo)
        if len(known) >= 2:  # beyond the measured widths: the slope of the two nearest
            a, b = (known[-2], known[-1]) if hi is None else (known[0], known[1])
            slope = max(0.0, (self.cost[b] - self.cost[a]) / (b - a))
            ref = b if hi is None else a
            return max(self.cost[ref] + slope * (n - ref), 1e-9)
        (t,) = known
        return self.cost[t] * max(1.0 + _BETA0 * (n - t) / t, 1e-3)

    def choose(self, rows: int, cands: list[tuple[RowDrafts, list[int], int]]) -> list[int]:
        """Draft depths for ``cands`` ((request, its candidate draft, match length)) in a step
        of ``rows`` decoding requests: a depth only where the batch's tokens per second gain."""
        if self.fixed:
            return [len(c[1]) for c in cands]
        depth = [0] * len(cands)
        if self.step_cost(rows) is None:  # a plain step first: the yardstick
            return depth
        n, tokens = rows, float(rows)
        order = sorted(range(len(cands)), key=lambda i: -cands[i][0].policy.alpha(cands[i][2]))
        for i in order:
            rd, draft, kind = cands[i]
            best, best_v = 0, tokens / self.step_cost(n) * (1.0 + MARGIN)
            for d in range(1, len(draft) + 1):
                v = (tokens - 1.0 + rd.expected(kind, d)) / self.step_cost(n + d)
                if v > best_v:
                    best, best_v = d, v
            if best == 0 and draft and rd.idle + 1 >= _PROBE:  # a probe: acceptance may have changed
                best = 1
            rd.idle = 0 if best else rd.idle + 1
            if best:
                depth[i] = best
                n += best
                tokens += rd.expected(kind, best) - 1.0
        return depth


def verify(logits: torch.Tensor, draft: list[int], choose) -> list[int]:
    """The tokens a step emits for a line of the pending token and ``draft``: ``choose(logits
    [V]) -> int`` at each position while it matches the draft, and the first that does not
    (or the token after a fully accepted draft)."""
    out = []
    for i in range(len(draft) + 1):
        out.append(choose(logits[i]))
        if i == len(draft) or out[-1] != draft[i]:
            return out
    return out
