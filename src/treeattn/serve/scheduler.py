"""Rank 0's side of the batched server: which requests run, what each step does, and what
each request's tokens become (sampling, stop strings, streamed text).

The scheduler admits a queued request when a row is free (one that would start a new prefix
while another is being prefilled waits, the others go by), chooses the cached prefix it
reuses (the longest common prefix, when that keeps at least as much as the request adds;
otherwise the prompt becomes a new prefix), evicts least recently used prefixes that no
running request reads to stay within ``cache_tokens`` per rank (taken as used: it preempts
the newest running request when the decoding rows fill it, :meth:`Scheduler._fit`), and
builds each step's plan: rejected draft tokens to trim, rows to close, prefixes to drop, at most one chunk of a new prefix, and the lines of one forward: chunks of
the joining requests' own prompts (up to ``prefill_chunk`` tokens in all, at least one chunk)
and a token for every decoding request (with speculation, followed by its draft:
:mod:`treeattn.serve.drafts`). Every rank (rank 0 included) then executes that plan
(:meth:`treeattn.serve.engine.Engine.execute`).

Joins go first: a step that runs join chunks leaves the decode rows out, unless they were
left out of the step before, so a new question's first token comes after a step of its own
(unless it arrives just after such a step: then its chunks ride beside the decode rows), and
the running requests never
wait more than one step in a row, however long a joining prompt is. The price: a join and the
decode rows no longer share one read of the weights. The late joiner's wait and the tokens/s:
docs/benchmarks/serving.md.
"""

from __future__ import annotations

import queue
import random
import time

import torch

from ..decoding.penalties import Penalties
from ..decoding.sampler import Sampler
from .budget import KVBudget
from .drafts import BatchDrafts, DraftPool, RowDrafts, verify
from .job import Job, chooser
from .plan import Line, Plan
from .request import BadRequest, Request


class Scheduler(KVBudget):
    """Rank 0's bookkeeping over the engine's :class:`~treeattn.runtime.batch.BatchRunner` (which
    rank 0 runs too, so the prefixes' contents are known here exactly)."""

    def __init__(self, engine) -> None:
        self.e, self.r = engine, engine.runner
        self.jobs: list[Job] = []
        self.waiting: list[Request] = []  # taken from the queue, checked, admitted in order once they fit
        self.preempted: list[Job] = []  # preempted requests, oldest first: admitted before the queue
        self.free = list(range(engine.max_batch))
        self.trimming: list[tuple[int, int]] = []  # (row, own tokens kept) for the next plan
        self.closing: list[tuple[int, int]] = []  # (row, adopt) for the next plan
        self.batch_drafts = BatchDrafts(engine.fixed_draft)
        self.drafters = None
        if engine.draft_model is not None:  # its caches may hold what the prefix cache holds on all ranks
            self.drafters = DraftPool(engine.draft_model, engine.draft_tokens)
        self.dropping: list[int] = []
        self.building: dict[int, int] = {}  # prefix being prefilled -> its KV tokens per rank when done
        self.used: dict[int, int] = {}  # prefix -> last use (a clock of admissions)
        self.next_pid, self.clock = 0, 0
        self.held_back = False  # the last step left the decode rows out (for join chunks)

    # -- admission -------------------------------------------------------------------
    def admit(self, requests: queue.Queue, wait: float) -> None:
        """Admit what may run now; with nothing running, wait up to ``wait`` s for a request.
        Preempted requests go first, then the waiting ones in order: one that waits for room
        holds back those behind it, but one that would start a new prefix while another is
        being prefilled lets the others by (a question on a cached document does not wait for
        a new document's prefill: no head-of-line blocking)."""
        try:
            self._admit(requests, wait)
        finally:
            self.e.stats["waiting"] = len(self.waiting) + len(self.preempted)

    def _admit(self, requests: queue.Queue, wait: float) -> None:
        while self.free and not (self.closing or self.dropping):
            if self.preempted and self.preempted[0].req.cancelled.is_set():  # its client left while it waited
                j = self.preempted.pop(0)
                j.finish = "cancelled"
                self._report(j)
                continue
            if self.preempted:  # recomputed from its prompt and its answer so far, once it fits
                got = self._start(self.preempted[0].req, self.preempted[0])
                if got is True:
                    self.preempted.pop(0)
                    continue
                if got == "room":
                    return
            started = False
            for i, req in enumerate(self.waiting):
                if req.cancelled.is_set():  # its client left while it waited
                    self.e.stats["cancelled"] += 1
                    del self.waiting[i]
                    started = True
                    break
                got = self._start(req)
                if got is True:
                    del self.waiting[i]
                    started = True
                    break
                if got == "room":
                    return
            if started:
                continue
            if len(self.waiting) >= 2 * self.e.max_batch:  # (what waits stays in the bounded queue)
                return
            try:
                req = requests.get(timeout=wait) if not self.jobs and wait else requests.get_nowait()
            except queue.Empty:
                return
            if req.cancelled.is_set():
                self.e.stats["cancelled"] += 1
                continue
            try:
                self.e.check(req)
            except BadRequest as err:
                req.emit("error", (400, str(err)))
                continue
            self.waiting.append(req)

    def _start(self, req: Request, resume: Job | None = None) -> bool | str:
        """Admit ``req`` when it fits (``resume``: a preempted request's job, its prompt now the
        request's prompt and its answer so far): True; else why it waits: ``"room"`` (K/V for
        it) or ``"building"`` (it would start a new prefix while one is being prefilled)."""
        e, r = self.e, self.r
        ids = req.ids + resume.out if resume is not None else req.ids
        L = len(ids)
        pid, keep = None, 0
        readers = {j.pid for j in self.jobs}
        whole = req.echo is not None and req.logprobs is not None and resume is None  # every prompt token's logits
        for q, sess in r.prefixes.items():
            if q in self.dropping or q in self.building or whole:  # (a prefix being built is not read yet)
                continue
            # the last prompt token runs: its logits start the answer
            k = min(sess.common_prefix(torch.tensor(ids)), L - 1)
            if k > keep:
                pid, keep = q, k
        if pid is not None and L - keep > keep:  # it would add more than it reuses: a prefix of its own
            pid, keep = None, 0
        new = pid is None and L > 1 and not whole
        if new and self.building:  # one new prefix at a time: it waits, the others go by
            return "building"
        block = e.block_of(L if pid is None else None, None if pid is None else r.prefixes[pid])
        reserve = e.per_rank(L - (L - 1 if new else keep) + 1, block) + block  # K/V taken as used: the prompt
        need = (e.per_rank(L - 1, block) if new else 0) + reserve
        if e.cache_tokens:
            total, evict = self._lru(need + self._committed(), readers | {pid})
            if total > e.cache_tokens and self.jobs:  # wait for running requests to end (evicting nothing)
                return "room"
            self.dropping += evict
        self.clock += 1
        row = self.free.pop(0)
        if resume is not None:
            job, job.row, job.pid, job.keep, job.todo, job.opened = resume, row, pid, keep, [], False
            job.reserve, job.block, job.admitted = reserve, block, self.clock
            self.jobs.append(job)
            self._plan_prompt(job, ids, new, block)
            return True
        job = Job(req, row, pid, keep, keep, reserve=reserve, block=block, admitted=self.clock, echo_at=0 if whole else -1)
        job.grammar = req.grammar() if req.grammar is not None else None
        self._plan_prompt(job, ids, new, block)
        seed = req.seed if req.seed is not None else random.getrandbits(62)
        job.sampler = Sampler(req.temperature > 0, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              min_p=req.min_p, typical_p=req.typical_p, eta_cutoff=req.eta_cutoff, seed=seed,
                              device=r.device)  # fmt: skip  # temperature 0: greedy, as in OpenAI's API
        pen = Penalties(ids, e.vocab, repetition=req.repetition_penalty, presence=req.presence_penalty,
                        frequency=req.frequency_penalty, logit_bias=req.logit_bias, min_tokens=req.min_tokens,
                        ends=req.eos)  # fmt: skip
        job.penalties = pen if pen.active else None
        self.jobs.append(job)
        st = e.stats
        st["requests"] += 1
        st["prompt_tokens"] += L
        st["cached_tokens"] += job.cached
        req.emit("start", {"prompt_tokens": L, "cached_tokens": job.cached})
        return True

    def _plan_prompt(self, job: Job, ids: list[int], new: bool, block: int) -> None:
        """The prefill items of a job's prompt: a new prefix's chunks, then its own tokens' joins."""
        e = self.e
        pid, keep, L = job.pid, job.keep, len(ids)
        if e.num_draft and job.grammar is None:  # (a grammar's mask follows the tokens taken: no drafts)
            job.drafts = RowDrafts(e.num_draft, self.batch_drafts.pool, self.drafters)
        if new:
            pid = job.pid = self.next_pid
            self.next_pid += 1
            self.building[pid] = e.per_rank(L - 1, block)
            step = e.prefill_step
            job.todo = [("prefix", pid, ids[a : min(a + step, L - 1)]) for a in range(0, L - 1, step)]
            job.keep = keep = L - 1
        if pid is not None:
            self.used[pid] = self.clock
        step = e.join_step
        job.todo += [("join", ids[a : a + step]) for a in range(keep, L, step)]

    # -- steps -----------------------------------------------------------------------
    def plan(self) -> Plan | None:
        """The next step, or None when there is nothing to do."""
        for j in list(self.jobs):  # a client that left: its row goes at this step
            if j.finish is None and j.req.cancelled.is_set():
                j.finish = "cancelled"
                self._end(j)
        if self.e.cache_tokens:
            self._fit()
        p = Plan(trims=self.trimming, closes=self.closing, drops=self.dropping)
        self.trimming, self.closing, self.dropping = [], [], []
        budget = self.e.join_step
        joining = any(j.todo and j.todo[0][0] == "join" for j in self.jobs)
        decoding = any(not j.todo for j in self.jobs)
        # joins first: a step with join chunks leaves the decode rows out, unless they sat out the last step
        self.held_back = hold = joining and decoding and not self.held_back
        if not hold:
            self._drafts()
        for j in self.jobs:
            if not j.todo:  # decoding, with the draft it verifies
                if hold:
                    continue
                p.lines.append(Line(j.row, 0, -1, 0, int(bool(j.draft)), [j.last, *j.draft]))
                p.jobs.append(j)
            elif j.todo[0][0] == "prefix":
                if p.prefix is None:
                    p.prefix, p.builder = (j.todo[0][1], j.todo[0][2]), j
            elif budget > 0:  # a chunk of a joining request's own prompt; the first always fits
                ids = j.todo[0][1]
                full = int(j.echo_at >= 0)  # echo with logprobs: every prompt token's logits
                p.lines.append(Line(j.row, int(not j.opened), -1 if j.pid is None else j.pid, j.keep, full, ids))
                p.jobs.append(j)
                j.opened = True
                budget -= len(ids)
        if p.prefix is not None and self.e.max_batched:
            self._bound_prefix(p)
        return None if p.empty() else p

    def _bound_prefix(self, p: Plan) -> None:
        """The new prefix's chunk cut to what the step's lines leave of ``--max-num-batched-tokens``
        (one token per rank at least, so it goes on); the rest stays next in its job's items."""
        pid, ids = p.prefix
        room = max(self.e.p, self.e.max_batched - sum(len(x.ids) for x in p.lines))
        if len(ids) > room:
            p.prefix = (pid, ids[:room])
            p.builder.todo[0:1] = [("prefix", pid, ids[:room]), ("prefix", pid, ids[room:])]

    def _drafts(self) -> None:
        """Each decoding request's draft for this step (none without speculation)."""
        dec = [j for j in self.jobs if not j.todo]
        for j in dec:
            j.draft = []
        cands = []
        for j in (j for j in dec if j.drafts is not None):
            cap, kind = j.drafts.offer(j.req.ids + j.out, j.req.max_tokens - len(j.out) - 1)
            if cap:
                cands.append((j, cap, kind))
        depth = self.batch_drafts.choose(len(dec), [(j.drafts, c, k) for j, c, k in cands])
        for (j, _, kind), d in zip(cands, depth, strict=True):
            j.draft, j.kind = j.drafts.draft(j.req.ids + j.out, d, self.batch_drafts), kind

    def after(self, p: Plan, logits, seconds: float = 0.0) -> None:
        """Sample what the step produced; end the requests that finish. ``seconds``: what the
        step took (the drafting's cost model learns from decode-only steps)."""
        j = p.builder
        if j is not None:
            pid = j.todo.pop(0)[1]
            if not any(x[0] == "prefix" for x in j.todo):
                self.building.pop(pid, None)
        elif p.lines and all(not j.todo for j in p.jobs):
            self.batch_drafts.observe_step(sum(len(x.ids) for x in p.lines), seconds)
        at = 0
        for line, j in zip(p.lines, p.jobs, strict=True):
            n = len(line.ids) if line.full else 1
            lg, at = logits[at : at + n], at + n
            joined = bool(j.todo)
            if joined:  # a join chunk
                j.todo.pop(0)
                if j.echo_at >= 0:
                    j.prompt_logprobs(lg)
                    lg = lg[-1:]
                if j.todo:
                    continue
                if j.req.echo is not None and not j.echoed:
                    j.echo()
            self._take(j, lg, not joined)

    def _take(self, j: Job, logits, decoding: bool = True) -> None:
        """Emit what a decoding line gives (one token, or the accepted part of its draft and
        the next); a rejected draft's tokens leave its row at the next step."""
        draft, st = j.draft, self.e.stats
        j.draft = []
        st["decode_rows"] += decoding
        try:
            toks = verify(logits, draft, chooser(j, draft))
            if draft:
                j.drafts.observe(j.kind, len(draft), len(toks) - 1)
                st["draft_tokens_offered"] += len(draft)
                st["draft_tokens_accepted"] += len(toks) - 1
            for i, t in enumerate(toks):
                j.take(t, logits[i])
                st["decode_tokens"] += decoding
                if j.finish is not None:
                    break
        except Exception as err:  # rank 0 alone raised (sampling, detokenizing, emit): end this request
            j.finish = "error"
            j.req.emit("error", (500, f"{type(err).__name__}: {err}"))
        own = len(j.req.ids) - j.keep + len(j.out) - 1  # the row holds the prompt and answer but the pending token
        if draft and j.finish != "error" and int(self.r.rows.n[j.row]) != own:
            self.trimming.append((j.row, own))
        if j.finish is not None:
            self._end(j)

    def _end(self, j: Job) -> None:
        e = self.e
        self.jobs.remove(j)
        if j.drafts is not None:
            j.drafts.release()
        if j.opened:
            self.closing.append((j.row, int(j.finish not in ("error",) and e.cache_tokens > 0)))
        self.free.append(j.row)
        self.free.sort()
        if j.pid is not None:
            self.building.pop(j.pid, None)
            if not e.cache_tokens and all(x.pid != j.pid for x in self.jobs):
                self.dropping.append(j.pid)
        self._report(j)

    def _report(self, j: Job) -> None:
        """A finished request's counts and its end event (none after an error)."""
        st = self.e.stats
        st["completion_tokens"] += len(j.out)
        if j.finish == "cancelled":
            st["cancelled"] += 1
        if j.finish != "error":
            d = j.drafts
            j.req.emit("end", {"finish_reason": j.finish, "completion_tokens": len(j.out), "prompt_tokens": len(j.req.ids),
                               "cached_tokens": j.cached, "seconds": time.perf_counter() - j.t0,
                               "drafted": None if d is None else (d.accepted, d.offered - d.accepted)})  # fmt: skip

    def fail(self, status: int, message: str) -> None:
        """Every running and held request gets an error (a rank failed, or the server stops);
        their rows close at the next plan."""
        for j in list(self.jobs):
            j.req.emit("error", (status, message))
            j.finish = "error"
            self._end(j)
        for j in self.preempted:
            j.req.emit("error", (status, message))
        self.preempted = []
        for req in self.waiting:
            req.emit("error", (status, message))
        self.waiting, self.held_back = [], False
