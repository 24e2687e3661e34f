"""The rank loop under ``treeattn serve``: requests in, tokens out, through Sessions only.

Rank 0 takes requests from a queue (filled by the HTTP layer), decides which cached prefix a
request reuses, samples every token and decides when to stop; each decision reaches the other
ranks as a small int64 broadcast (a command header, the prompt's new token ids, then one
``[token, go]`` per step). Nothing is pickled. Every rank keeps the same cache entries: one
:class:`treeattn.hf.Session` (one sequence, its KV sharded over the ranks) per cached
prefix. Nothing here knows about HTTP.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..cache.placement import Placement
from ..comm.collectives import CollectiveError, broadcast, world
from ..hf._steps import auto_block
from ..hf.session import Session

IDLE, RUN, STOP = 0, 1, 2
_HDR = 6  # op, slot, keep, new entry, new ids, evictions


class RankFailure(RuntimeError):
    """A collective failed: a rank is gone (or stalled past the collective timeout)."""


class BadRequest(ValueError):
    """A request rank 0 refuses before its first broadcast (the HTTP layer checks the same
    first; this is the engine's own guard): the other ranks never hear of it."""


@dataclass
class Request:
    """One generation, as rank 0 sees it. ``emit`` receives the events (called from the
    engine's thread): ``("start", {"prompt_tokens", "cached_tokens"})``, ``("text", str)``,
    ``("end", {"finish_reason", "completion_tokens", ...})`` or ``("error", (status, message))``."""

    ids: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    decode: Callable[[list[int]], str]
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    eos: list[int] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Engine:
    """The cache entries and the loop every rank runs.

    Args:
        model: the causal LM (same weights on every rank).
        session_kw: keyword arguments of every :class:`Session` (placement, attention, ...).
        cache_tokens: KV tokens per rank the entries may hold together, the running request's
            included; least recently used entries go first. 0: no prefix cache (every request
            starts from an empty session that is dropped after it).
        heartbeat: seconds between idle broadcasts (they keep the other ranks' collectives
            within their timeout and find a dead rank while nothing is asked).
    """

    def __init__(self, model, group=None, session_kw: dict | None = None, cache_tokens: int = 32768,
                 heartbeat: float = 1.0) -> None:  # fmt: skip
        self.model, self.group, self.kw = model, group, dict(session_kw or {})
        self.vocab: int = model.config.vocab_size  # token ids lie in [0, vocab) (Session checks the same)
        self.rank, self.p = world(group)
        self.cache_tokens, self.heartbeat = cache_tokens, heartbeat
        self.entries: dict[int, Session] = {}
        self.used: dict[int, int] = {}  # slot -> last use (rank 0's clock of requests)
        self.next_slot, self.clock = 0, 0
        self.stats = dict(requests=0, cancelled=0, prompt_tokens=0, cached_tokens=0, completion_tokens=0,
                          cache_entries=0, cache_tokens_per_rank=0)  # fmt: skip

    # -- sizes -----------------------------------------------------------------------
    def per_rank(self, n: int, block: int | None = None) -> int:
        """KV tokens per rank a sequence of ``n`` tokens may need (an upper bound) in placement
        blocks of ``block`` tokens (default: what a new entry of ``n`` tokens would get)."""
        b = block or self.kw.get("block") or auto_block(n, self.p)
        return Placement(self.kw.get("placement", "interleaved"), self.p, b).max_per_rank(n)

    def held(self, slot: int) -> int:
        s = self.entries[slot]
        return int(s.cache.counts.max()) if s.cache is not None else 0

    def cached(self) -> int:
        return sum(self.held(s) for s in self.entries)

    # -- rank 0 ----------------------------------------------------------------------
    def plan(self, ids: list[int], max_tokens: int) -> tuple[int, int, bool, list[int]]:
        """(slot, tokens kept, new entry?, slots to evict) for a request."""
        L, slot, keep = len(ids), -1, 0
        if self.cache_tokens:
            t = torch.tensor(ids)
            for s, sess in self.entries.items():
                k = min(sess.common_prefix(t), L - 1)  # the last prompt token runs: its logits start the answer
                if k > keep:
                    slot, keep = s, k
            if slot >= 0 and len(self.entries[slot]) - keep > keep:  # reusing it would drop more than it keeps
                slot, keep = -1, 0
        new = slot < 0
        if new:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        evict = [s for s in self.entries if s != slot] if not self.cache_tokens else []
        if self.cache_tokens:
            others = {s: self.held(s) for s in self.entries if s != slot}
            c = None if new else self.entries[slot].cache
            total = self.per_rank(L + max_tokens, c.placement.block if c is not None else None) + sum(others.values())
            for s in sorted(others, key=self.used.__getitem__):  # least recently used first
                if total <= self.cache_tokens:
                    break
                evict.append(s)
                total -= others[s]
        return slot, keep, new, evict

    def serve(self, requests: queue.Queue, stopping: threading.Event,
              on_failure: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """Rank 0: run requests from ``requests`` one at a time until ``stopping`` is set.
        Raises :class:`RankFailure` when a collective fails, after calling ``on_failure(why)``
        and giving the request running an ``error`` event with status 503."""
        while True:
            try:
                req = requests.get(timeout=self.heartbeat)
            except queue.Empty:
                req = None
            if stopping.is_set():
                self._send(torch.tensor([STOP] + [0] * (_HDR - 1)))
                if req is not None:
                    req.emit("error", (503, "the server is shutting down"))
                return
            if req is None:
                try:
                    self._send(torch.tensor([IDLE] + [0] * (_HDR - 1)))
                except RankFailure as e:
                    if on_failure is not None:
                        on_failure(str(e).splitlines()[0])
                    raise
                continue
            if req.cancelled.is_set():  # its client left while it waited
                self.stats["cancelled"] += 1
                continue
            try:
                self._check(req)
            except BadRequest as e:
                req.emit("error", (400, str(e)))
                continue
            try:
                self._run0(req)
            except (RankFailure, CollectiveError, dist.DistError) as e:
                why = str(e).splitlines()[0]
                if on_failure is not None:
                    on_failure(why)
                req.emit("error", (503, f"a rank failed: {why}"))
                raise RankFailure(str(e)) from e
            except Exception as e:  # every rank raised the same, or rank 0 raised between steps (_run0)
                req.emit("error", (500, f"{type(e).__name__}: {e}"))

    def _check(self, req: Request) -> None:
        """Rank 0, before a request's first broadcast: BadRequest for what would raise halfway
        through it (and leave the other ranks waiting for a broadcast that never comes) or not
        fit the int64 broadcasts."""
        if not req.ids or not all(isinstance(i, int) and 0 <= i < self.vocab for i in req.ids):
            raise BadRequest(f"the prompt must be 1 or more token ids in [0, {self.vocab})")
        if not (isinstance(req.max_tokens, int) and req.max_tokens >= 1):
            raise BadRequest(f"max_tokens must be an integer >= 1, got {req.max_tokens!r}")
        if req.seed is not None and not (isinstance(req.seed, int) and 0 <= req.seed < 2**64):
            raise BadRequest(f"the seed must be an integer in [0, 2**64), got {req.seed!r}")
        if not 0 <= req.temperature < float("inf"):
            raise BadRequest(f"temperature must be finite and >= 0, got {req.temperature!r}")
        if req.top_p is not None and not 0 < req.top_p <= 1:
            raise BadRequest(f"top_p must lie in (0, 1], got {req.top_p!r}")

    def _send(self, t: torch.Tensor) -> torch.Tensor:
        try:
            return broadcast(t, self.group)
        except RuntimeError as e:
            raise RankFailure(str(e).splitlines()[0]) from e

    def _run0(self, req: Request) -> None:
        slot, keep, new, evict = self.plan(req.ids, req.max_tokens)
        self.clock += 1
        self.used[slot] = self.clock
        ids = req.ids[keep:]
        self._send(torch.tensor([RUN, slot, keep, int(new), len(ids), len(evict)]))
        if evict:
            self._send(torch.tensor(evict, dtype=torch.int64))
        self._send(torch.tensor(ids, dtype=torch.int64))
        st = self.stats
        st["requests"] += 1
        st["prompt_tokens"] += len(req.ids)
        st["cached_tokens"] += keep
        req.emit("start", {"prompt_tokens": len(req.ids), "cached_tokens": keep})
        logits = self._apply(slot, keep, new, evict, ids)
        sess = self.entries[slot]
        out: list[int] = []
        waiting = True  # the other ranks wait for a [token, go] broadcast
        t0 = time.perf_counter()
        try:
            dev = logits.device
            gen = torch.Generator(device=dev).manual_seed(req.seed if req.seed is not None else random.getrandbits(62))
            warp = None
            if req.temperature > 0:
                from ..hf.generate import _processors

                warp = _processors(req.temperature, None, req.top_p, None, None, dev)
                none = torch.zeros(1, 0, dtype=torch.int64, device=dev)
            sent, hold = "", max((len(s) for s in req.stop), default=0)
            while True:
                if warp is None:
                    tok = int(logits[0].argmax())
                else:
                    probs = torch.softmax(warp(none, logits.float()), -1)  # temperature, top-p: no history needed
                    tok = int(torch.multinomial(probs, 1, generator=gen))
                out.append(tok)
                finish = None
                if tok in req.eos:
                    finish = "stop"
                elif len(out) == req.max_tokens:
                    finish = "length"
                text = req.decode(out[:-1] if tok in req.eos else out)
                cut = _first_stop(text, req.stop, max(0, len(sent) - hold))
                if cut is not None:
                    text, finish = text[:cut], "stop"
                if finish is None and req.cancelled.is_set():
                    finish = "cancelled"
                safe = text if finish else _safe_prefix(text, req.stop)
                if len(safe) > len(sent):
                    req.emit("text", safe[len(sent) :])
                    sent = safe
                waiting = False
                self._send(torch.tensor([tok, int(finish is None)]))
                if finish is not None:
                    break
                logits = sess.extend(torch.tensor([[tok]], device=dev), check=False)
                waiting = True
        except (RankFailure, CollectiveError, dist.DistError):
            raise
        except Exception:  # rank 0 alone raised between steps (sampling, decode, emit): end the request on
            if waiting:  # every rank, so the ranks stay in lockstep (in extend, the others are in it too)
                self._send(torch.tensor([0, 0]))
                self._after()
            raise
        st["completion_tokens"] += len(out)
        if finish == "cancelled":
            st["cancelled"] += 1
        self._after()
        st.update(cache_entries=len(self.entries), cache_tokens_per_rank=self.cached())
        req.emit("end", {"finish_reason": finish, "completion_tokens": len(out), "prompt_tokens": len(req.ids),
                         "cached_tokens": keep, "seconds": time.perf_counter() - t0})  # fmt: skip

    # -- every rank --------------------------------------------------------------------
    def _apply(self, slot: int, keep: int, new: bool, evict: list[int], ids) -> torch.Tensor:
        for s in evict:
            del self.entries[s]
            self.used.pop(s, None)
        if new:
            self.entries[slot] = Session(self.model, self.group, **self.kw)
        sess = self.entries[slot]
        if len(sess) > keep:
            sess.rewind(keep, check=False)
        dev = sess.device
        return sess.extend(torch.as_tensor(ids, dtype=torch.int64, device=dev)[None], check=True)

    def _after(self) -> None:
        if not self.cache_tokens:
            self.entries.clear()
            self.used.clear()

    def follow(self) -> None:
        """Ranks other than 0: mirror rank 0's commands until it says stop."""
        hdr = torch.zeros(_HDR, dtype=torch.int64)
        step = torch.zeros(2, dtype=torch.int64)
        while True:
            op, slot, keep, new, n, n_evict = self._send(hdr).tolist()
            if op == STOP:
                return
            if op == IDLE:
                continue
            evict = self._send(torch.zeros(n_evict, dtype=torch.int64)).tolist() if n_evict else []
            ids = self._send(torch.zeros(n, dtype=torch.int64))
            try:
                self._apply(slot, keep, bool(new), evict, ids)
            except ValueError:
                continue  # rank 0 raised the same (agreed) error and reports it
            sess = self.entries[slot]
            while True:
                tok, go = self._send(step).tolist()
                if not go:
                    break
                sess.extend(torch.tensor([[tok]], device=sess.device), check=False)
            self._after()


def _first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the first stop string begins in ``text`` (searching from ``start``), or None."""
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: list[str]) -> str:
    """What may be sent now: not a trailing partial character, nor a tail that may begin a
    stop string."""
    text = text.rstrip("\ufffd")
    cut = len(text)
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]
