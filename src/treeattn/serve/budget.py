"""The K/V budget of rank 0's scheduler: what the prefixes and the running rows hold per rank
against ``cache_tokens``, K/V taken as it is used: prefixes no running request reads go
first (least recently used), then the newest running request is preempted and recomputed
later (vLLM's recompute preemption). A mixin of :class:`~treeattn.serve.scheduler.Scheduler`,
over its state (jobs, prefixes being built or dropped, rows, the preempted queue)."""

from __future__ import annotations

from .job import Job


class KVBudget:
    def _committed(self) -> int:
        """KV tokens per rank held or promised: prefixes (a prefix being built at its full
        size) and every running request's own tokens."""
        r = self.r
        held = sum(max(r.held(q), self.building.get(q, 0)) for q in r.prefixes if q not in self.dropping)
        held += sum(v for q, v in self.building.items() if q not in r.prefixes)
        return held + sum(j.reserve for j in self.jobs)

    def _lru(self, total: int, protected: set) -> tuple[int, list[int]]:
        """``(total, prefixes to drop)``: unread prefixes, least recently used first, until
        ``total`` KV tokens per rank fit (or none is left)."""
        evict = []
        for q in sorted((q for q in self.r.prefixes if q not in protected and q not in self.dropping),
                        key=lambda q: self.used.get(q, 0)):  # fmt: skip
            if total <= self.e.cache_tokens:
                break
            evict.append(q)
            total -= self.r.held(q)
        return total, evict

    def _fit(self) -> None:
        """K/V taken as it is used: the decoding rows' tokens of the coming step (a token and
        at most a full draft each) must fit under ``cache_tokens`` per rank. If they do not,
        prefixes no running request reads go first (least recently used), then the newest
        running requests are preempted (their rows freed; each is recomputed later from its
        prompt and its answer so far, and goes on where it stopped); a request running alone
        that has filled the cache ends (``length``)."""
        e = self.e
        for j in self.jobs:
            if not j.todo:
                own = len(j.req.ids) - j.keep + len(j.out) + e.num_draft  # the row after this step
                j.reserve = e.per_rank(own, j.block) + j.block
        total = self._committed()
        if total <= e.cache_tokens:
            return
        total, evict = self._lru(total, {j.pid for j in self.jobs})
        self.dropping += evict
        while total > e.cache_tokens and self.jobs:
            decoding = [j for j in self.jobs if not j.todo]
            if len(self.jobs) == 1 or not decoding:
                for j in decoding:
                    j.finish = "length"
                    self._end(j)
                return
            j = max(decoding, key=lambda x: x.admitted)
            total -= j.reserve
            self._preempt(j)

    def _preempt(self, j: Job) -> None:
        self.jobs.remove(j)
        if j.drafts is not None:
            j.drafts.release()
            j.drafts = None
        if j.opened:
            self.closing.append((j.row, 0))
        self.free.append(j.row)
        self.free.sort()
        j.draft, j.opened = [], False
        self.preempted.append(j)
        self.preempted.sort(key=lambda x: x.t0)
        self.e.stats["preempted"] += 1
