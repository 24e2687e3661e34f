"""The rank loop under ``treeattn serve``: continuous batching over shared, sharded prefixes.

Rank 0 takes requests from a queue (filled by the HTTP layer) and plans every step
(:mod:`treeattn.serve.scheduler`): the rows that close, the prefixes dropped, at most one
chunk of a new prefix (a sharded prefill), and the lines of one forward: a token for every
running request and chunks of the joining requests' own prompts. The plan reaches the other
ranks as two int64 broadcasts (nothing is pickled) and every rank, rank 0 included, executes
it on its :class:`~treeattn.runtime.batch.BatchRunner`, whose queries read each shared prefix
once per step. A long new prompt is prefilled a chunk per step between the decode steps of
the others. Nothing here knows about HTTP.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..cache import auto_block
from ..cache.placement import Placement
from ..comm.collectives import CollectiveError, broadcast, world
from ..comm.validate import agree
from ..config import Layout, Sampling, Serving
from ..decoding.penalties import penalty_problem
from ..runtime.batch import BatchRunner
from .plan import MAX_DRAFT, Plan
from .request import BadRequest, Request
from .scheduler import Scheduler

IDLE, RUN, STOP = 0, 1, 2
MAX_LOGPROBS = 20  # most likely alternatives per token a request may ask for (OpenAI's top_logprobs limit)
__all__ = ["BadRequest", "Engine", "RankFailure", "Request"]


class RankFailure(RuntimeError):
    """A collective failed: a rank is gone (or stalled past the collective timeout)."""


class Engine:
    """The prefixes, the running rows and the loop every rank runs.

    Args:
        model: the causal LM (same weights on every rank).
        session_kw: keyword arguments of every prefix's :class:`~treeattn.runtime.Session`
            (placement, attention, strategy, prefill_chunk, block, prefill).
        cache_tokens: KV tokens per rank the prefixes and the running requests may hold
            together (a shared prefix counts once); least recently used prefixes that no
            running request reads go first. 0: no prefix cache (a prefix lives while a
            running request reads it).
        heartbeat: seconds between idle broadcasts (they keep the other ranks' collectives
            within their timeout and find a dead rank while nothing is asked).
        max_batch: requests that run at once; more wait in the queue.
        num_draft: with speculation, the most tokens a request drafts per step (0: no
            speculation; at most :data:`~treeattn.serve.plan.MAX_DRAFT`, else ValueError); see
            :mod:`treeattn.serve.drafts`. ``fixed_draft``: every draft as
            deep as it goes (default: as deep as measured step costs and acceptance make
            worth it).
        draft_model: rank 0's draft model (a causal LM with the model's vocabulary; ignored on
            the other ranks): with ``num_draft``, requests draft from it instead of by
            prompt lookup. Its KV caches (one per drafting request, idle ones kept for later
            requests) hold at most ``draft_tokens`` tokens in all (default: ``cache_tokens``
            times the ranks, or 32768 per rank without a prefix cache); a request that finds
            no room does not draft.
    """

    def __init__(self, model, group=None, session_kw: dict | None = None, cache_tokens: int = 32768,
                 heartbeat: float = 1.0, max_batch: int = 8, num_draft: int = 0,
                 fixed_draft: bool = False, draft_model=None, draft_tokens: int | None = None,
                 max_num_batched_tokens: int | None = None) -> None:  # fmt: skip
        self.model, self.group, self.kw = model, group, dict(session_kw or {})
        self.draft_model = draft_model if num_draft else None
        _agree_engine(model, group, self.kw, cache_tokens, heartbeat, max_batch, num_draft, fixed_draft,
                      self.draft_model, draft_tokens, max_num_batched_tokens)  # fmt: skip
        self.max_batched = max_num_batched_tokens  # a step's tokens in all (None: no bound)
        self.vocab: int = model.config.vocab_size
        self.rank, self.p = world(group)
        self.draft_tokens = draft_tokens if draft_tokens is not None else (cache_tokens or 32768) * self.p
        self.cache_tokens, self.heartbeat, self.max_batch = cache_tokens, heartbeat, max_batch
        self.num_draft, self.fixed_draft = num_draft, fixed_draft
        self.runner = BatchRunner(model, group, max_batch, **self.kw)
        self.sched = Scheduler(self)  # rank 0's; it outlives a serve() call, as the prefixes do
        chunk = self.kw.get("prefill_chunk", 1024)
        self.prefill_step = chunk * self.p if chunk else 1 << 62  # prompt tokens per step of a new prefix
        self.join_step = chunk or 1 << 62  # joining requests' own tokens per step (every rank runs them)
        self.stats = dict(requests=0, cancelled=0, prompt_tokens=0, cached_tokens=0, completion_tokens=0,
                          cache_entries=0, cache_tokens_per_rank=0, running=0, max_batch=max_batch, steps=0,
                          decode_rows=0, decode_tokens=0, mean_accepted_length=1.0, draft_tokens_offered=0,
                          draft_tokens_accepted=0, preempted=0, waiting=0, decode_step_seconds={}, plan_seconds=0.0, execute_seconds=0.0, sample_seconds=0.0,
                          kv_tokens_per_rank=0, peak_kv_tokens_per_rank=0, prefixes=[])  # fmt: skip

    @property
    def entries(self) -> dict:
        """The cached prefixes (id -> Session)."""
        return self.runner.prefixes

    # -- sizes -----------------------------------------------------------------------
    def block_of(self, n: int | None, sess=None) -> int:
        """The placement block of a prefix: ``sess``'s, or a new one's of ``n`` tokens."""
        if sess is not None and sess.cache is not None:
            return sess.cache.placement.block
        return self.kw.get("block") or auto_block(min(n or 1, self.prefill_step), self.p)

    def per_rank(self, n: int, block: int | None = None) -> int:
        """KV tokens per rank a sequence of ``n`` tokens may need (an upper bound) in placement
        blocks of ``block`` tokens (default: what a new prefix of ``n`` tokens would get)."""
        b = block or self.block_of(n)
        return Placement(self.kw.get("placement", "interleaved"), self.p, b).max_per_rank(n)

    def cached(self) -> int:
        """KV tokens per rank the prefixes hold."""
        return sum(self.runner.held(q) for q in self.runner.prefixes)

    def check(self, req: Request) -> None:
        """Rank 0, before a request reaches the other ranks: BadRequest for what would fail
        halfway or not fit the int64 broadcasts."""
        if not req.ids or not all(isinstance(i, int) and 0 <= i < self.vocab for i in req.ids):
            raise BadRequest(f"the prompt must be 1 or more token ids in [0, {self.vocab})")
        if not (isinstance(req.max_tokens, int) and req.max_tokens >= 1):
            raise BadRequest(f"max_tokens must be an integer >= 1, got {req.max_tokens!r}")
        if len(req.ids) + req.max_tokens > self.runner.max_pos:
            raise BadRequest(f"the prompt plus max_tokens exceed the model's {self.runner.max_pos} positions")
        if req.seed is not None and not (isinstance(req.seed, int) and 0 <= req.seed < 2**64):
            raise BadRequest(f"the seed must be an integer in [0, 2**64), got {req.seed!r}")
        if req.logprobs is not None and not (type(req.logprobs) is int and 0 <= req.logprobs <= MAX_LOGPROBS):
            raise BadRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.logprobs!r}")
        try:  # the sampling parameters' ranges, written once
            Sampling(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                     typical_p=req.typical_p, eta_cutoff=req.eta_cutoff)  # fmt: skip
        except ValueError as e:
            raise BadRequest(str(e)) from None
        bad = penalty_problem(repetition=req.repetition_penalty, presence=req.presence_penalty,
                              frequency=req.frequency_penalty, logit_bias=req.logit_bias, min_tokens=req.min_tokens,
                              vocab=self.vocab)  # fmt: skip
        if bad is not None:
            raise BadRequest(bad[1])

    # -- every rank --------------------------------------------------------------------
    def execute(self, p: Plan) -> torch.Tensor | None:
        """Run one step; returns the logits of its lines (:meth:`BatchRunner.run`)."""
        r = self.runner
        for row, n in p.trims:
            r.trim(row, n)
        for row, adopt in p.closes:
            r.close(row, adopt=bool(adopt))
        for pid in p.drops:
            r.drop(pid)
        if p.prefix is not None:
            r.prefill(*p.prefix)
        if not p.lines:
            return None
        for row, opening, pid, keep, _, _ in p.lines:
            if opening:
                r.open(row, None if pid < 0 else pid, keep)
        return r.run([(x.row, x.ids) for x in p.lines], [x.row for x in p.lines if x.full])

    def _send(self, t: torch.Tensor) -> torch.Tensor:
        try:
            return broadcast(t, self.group)
        except (RuntimeError, CollectiveError) as e:
            raise RankFailure(str(e).splitlines()[0]) from e

    def follow(self) -> None:
        """Ranks other than 0: execute rank 0's plans until it says stop."""
        hdr = torch.zeros(2, dtype=torch.int64)
        while True:
            op, n = self._send(hdr).tolist()
            if op == STOP:
                return
            if op == IDLE:
                continue
            self.execute(Plan.decode_from(self._send(torch.zeros(n, dtype=torch.int64)).tolist()))

    # -- rank 0 ----------------------------------------------------------------------
    def serve(self, requests: queue.Queue, stopping: threading.Event,
              on_failure: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """Rank 0: run requests from ``requests``, batched, until ``stopping`` is set (the
        running and held requests then get a 503 ``error`` event and their rows close on every
        rank, so the engine may serve again). Raises
        :class:`RankFailure` when a collective fails, after calling ``on_failure(why)`` and
        giving every running request an ``error`` event with status 503."""
        sched = self.sched
        try:
            while True:
                if stopping.is_set():  # the running requests end; every rank closes their rows, then stops
                    sched.fail(503, "the server is shutting down")
                    if sched.trimming or sched.closing or sched.dropping:
                        self._run(Plan(trims=sched.trimming, closes=sched.closing, drops=sched.dropping))
                        sched.trimming, sched.closing, sched.dropping = [], [], []
                    self._send(torch.tensor([STOP, 0]))
                    return
                sched.admit(requests, self.heartbeat)
                t0 = time.perf_counter()
                plan = sched.plan()
                if plan is None:
                    if not stopping.is_set():
                        self._send(torch.tensor([IDLE, 0]))
                    continue
                t1 = time.perf_counter()
                logits = self._run(plan)
                t2 = time.perf_counter()
                sched.after(plan, logits, t2 - t1)
                self._account(sched, plan, (t1 - t0, t2 - t1, time.perf_counter() - t2))
        except (RankFailure, CollectiveError, dist.DistError) as e:
            why = str(e).splitlines()[0]
            if on_failure is not None:
                on_failure(why)
            sched.fail(503, f"a rank failed: {why}")
            raise RankFailure(str(e)) from e

    def _run(self, plan: Plan) -> torch.Tensor | None:
        """Rank 0: send ``plan`` to the other ranks and execute it."""
        body = torch.tensor(plan.encode(), dtype=torch.int64)
        self._send(torch.tensor([RUN, len(body)]))
        self._send(body)
        return self.execute(plan)

    def _account(self, sched: Scheduler, plan: Plan, times: tuple[float, float, float]) -> None:
        st, r = self.stats, self.runner
        st["steps"] += 1
        for k, t in zip(("plan_seconds", "execute_seconds", "sample_seconds"), times, strict=True):
            st[k] += t
        st["mean_accepted_length"] = st["decode_tokens"] / st["decode_rows"] if st["decode_rows"] else 1.0
        cost = sched.batch_drafts.cost  # what drafting weighs: a decode-only step's seconds by its tokens
        st["decode_step_seconds"] = {str(n): round(cost[n], 4) for n in sorted(cost)}
        readers: dict[int, int] = {}
        for j in sched.jobs:
            if j.pid is not None:
                readers[j.pid] = readers.get(j.pid, 0) + 1
        kv = self.cached() + int(r.rows.kv_len.sum())  # rank 0's: the others' differ by a block per row
        st.update(running=len(sched.jobs), cache_entries=len(r.prefixes), cache_tokens_per_rank=self.cached(),
                  kv_tokens_per_rank=kv, peak_kv_tokens_per_rank=max(kv, st["peak_kv_tokens_per_rank"]),
                  prefixes=[{"tokens": len(s), "tokens_per_rank": r.held(q), "readers": readers.get(q, 0)}
                            for q, s in r.prefixes.items()])  # fmt: skip


def _agree_engine(model, group, kw, cache_tokens, heartbeat, max_batch, num_draft, fixed_draft, draft_model,
                  draft_tokens, max_batched) -> None:  # fmt: skip
    """The engine's settings checked on each rank and agreed across ``group`` (every rank's
    loop must plan alike): the same ValueError on every rank when any rank's are bad or differ."""
    err, layout, serving = None, None, None
    try:
        if type(num_draft) is not int or not 0 <= num_draft <= MAX_DRAFT:
            raise ValueError(f"num_draft must be an int in [0, {MAX_DRAFT}], got {num_draft!r}")
        layout = Layout(**{k: v for k, v in kw.items() if k in Layout.__dataclass_fields__})
        serving = Serving(cache_tokens=cache_tokens, max_batch=max_batch, draft_cache_tokens=draft_tokens,
                          max_num_batched_tokens=max_batched)  # fmt: skip
        if draft_model is not None:
            dv = draft_model.config.get_text_config().vocab_size
            if dv != model.config.get_text_config().vocab_size:
                raise ValueError(f"the draft model's vocabulary ({dv}) differs from the model's")
    except (ValueError, TypeError) as e:
        err = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    rest = {f"session {k}": v for k, v in kw.items() if k not in Layout.__dataclass_fields__}
    agree({"layout": layout, "serving": serving, **rest, "num_draft": num_draft, "fixed_draft": bool(fixed_draft),
           "heartbeat": float(heartbeat), "vocab_size": model.config.vocab_size}, err, group=group)  # fmt: skip
