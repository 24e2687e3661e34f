"""A request admitted to a row, as rank 0 follows it: its tokens, what each token does (the
history's processors and the grammar before the sampler; logprobs, stop strings, the streamed
text after it), and the rule that picks a verified line's tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..decoding.penalties import Penalties
from ..decoding.sampler import Sampler
from .drafts import RowDrafts
from .request import Request, first_stop, safe_prefix


@dataclass
class Job:
    """A request admitted to a row."""

    req: Request
    row: int
    pid: int | None  # the prefix it reads (None: none)
    keep: int  # tokens of the prefix it reads
    cached: int  # prompt tokens found cached
    todo: list = field(default_factory=list)  # prefill items left: ("prefix", pid, ids) or ("join", ids)
    opened: bool = False
    out: list[int] = field(default_factory=list)
    last: int | None = None  # the token the next decode step runs
    sent: str = ""
    finish: str | None = None
    reserve: int = 0  # KV tokens per rank its own tokens take (after the coming step)
    block: int = 1  # its row's placement block
    admitted: int = 0  # when it was (last) admitted: the newest is preempted first
    echo_at: int = -1  # echo with logprobs: the prompt position of its next join chunk (-1: none pending)
    echo_lps: list = field(default_factory=list)  # the prompt's logprob entries so far
    echoed: bool = False  # the prompt was echoed (a recomputed request does not echo again)
    t0: float = field(default_factory=time.perf_counter)
    sampler: Sampler | None = None
    penalties: Penalties | None = None  # the history's logits processors, when the request has any
    grammar: object | None = None  # its response_format's matcher (serve.grammar.Grammar)
    drafts: RowDrafts | None = None  # with speculation
    draft: list[int] = field(default_factory=list)  # drafted after ``last`` in the running step
    kind: int = 0  # how far back that draft's match agrees (prompt lookup's evidence)
    lps: list = field(default_factory=list)  # logprob entries not sent yet
    text: str = ""  # the answer's text so far, with an incremental decoder
    step: Callable[[int], str] | None = None  # that decoder

    def prompt_logprobs(self, logits) -> None:
        """A join chunk's logits ``[n, V]`` (every token's): the logprob entries of the prompt
        tokens they predict (the chunk's last row predicts the next chunk's first token, or
        the answer's)."""
        ids, top = self.req.ids, self.req.logprobs
        for i in range(logits.shape[0]):
            q = self.echo_at + i + 1
            if q < len(ids):
                self.echo_lps.append(logprob_entry(logits[i], ids[q], top))
        self.echo_at += logits.shape[0]

    def echo(self) -> None:
        """Send the prompt before the answer (completions' ``echo``): its text, and with
        logprobs its tokens' entries (the first token has none)."""
        req = self.req
        if req.logprobs is not None:
            req.emit("logprobs", [(req.ids[0], None, None), *self.echo_lps])
        if req.echo:
            req.emit("text", req.echo)
        self.echo_lps, self.echo_at, self.echoed = [], -1, True

    def take(self, tok: int, logits=None) -> None:
        """Append a sampled token (``logits`` ``[V]``: the distribution it was chosen from, for
        its logprobs); decide whether the request ends; send what text may go."""
        req = self.req
        self.out.append(tok)
        if self.penalties is not None:
            self.penalties.add(tok)
        if req.logprobs is not None and logits is not None:
            self.lps.append(logprob_entry(logits, tok, req.logprobs))
        finish = None
        done = self.grammar is not None and self.grammar.take(tok)  # (the matcher follows every token)
        if tok in req.eos or done:  # EOS, or the grammar's output (the JSON) is complete
            finish = "stop"
        elif len(self.out) == req.max_tokens:
            finish = "length"
        text = self._text(tok, finish is not None)
        hold = max((len(s) for s in req.stop), default=0)
        early = len(self.out) < req.min_tokens  # no stop string ends it yet (vLLM's min_tokens)
        cut = None if early else first_stop(text, req.stop, max(0, len(self.sent) - hold))
        if cut is not None:
            text, finish = text[:cut], "stop"
        if finish is None and req.cancelled.is_set():
            finish = "cancelled"
        safe = text if finish else safe_prefix(text, req.stop)
        if self.lps and (len(safe) > len(self.sent) or finish):
            req.emit("logprobs", self.lps)
            self.lps = []
        if len(safe) > len(self.sent):
            req.emit("text", safe[len(self.sent) :])
            self.sent = safe
        self.finish, self.last = finish, tok


    def _text(self, tok: int, last: bool) -> str:
        """The answer's text so far (EOS adds none): incremental while it runs, when the
        request has a stream; the whole decode at the end (exact, a trailing partial character
        included)."""
        req = self.req
        if req.stream is None or last:
            return req.decode(self.out[:-1] if tok in req.eos else self.out)
        if self.step is None:
            self.step = req.stream()
        if tok not in req.eos:
            self.text += self.step(tok)
        return self.text


def chooser(j: Job, draft: list[int]):
    """The next-token rule of ``j`` at each position of a verified line (the pending token,
    then its draft): the sampler, after the request's history processors over the output so
    far and the draft tokens before that position."""
    if j.penalties is None and j.grammar is None:
        return j.sampler.next
    at = iter(range(len(draft) + 1))

    def choose(lg):
        i = next(at)
        if j.penalties is not None:
            lg = j.penalties(lg, draft[:i])
        return j.sampler.next(lg if j.grammar is None else j.grammar.mask(lg))

    return choose


def logprob_entry(logits, tok: int, top: int) -> tuple:
    """(tok, its log-probability, the ``top`` likeliest tokens with theirs) under the
    log-softmax of ``logits`` ``[V]`` (float32)."""
    lsm = torch.log_softmax(logits.float(), -1)
    alt = []
    if top:
        v, i = lsm.topk(min(top, lsm.shape[-1]))
        alt = list(zip(i.tolist(), v.tolist(), strict=True))
    return tok, float(lsm[tok]), alt
