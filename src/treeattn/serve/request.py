"""A generation request as rank 0's engine sees it, and the stop-string helpers of its stream."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


class BadRequest(ValueError):
    """A request rank 0 refuses before it reaches the other ranks (the HTTP layer checks the
    same first; this is the engine's own guard)."""


@dataclass
class Request:
    """One generation, as rank 0 sees it. ``emit`` receives the events (called from the
    engine's thread): ``("start", {"prompt_tokens", "cached_tokens"})``, ``("text", str)``,
    ``("end", {"finish_reason", "completion_tokens", ...})`` or ``("error", (status, message))``;
    with ``logprobs`` (the number of most likely alternatives per token, 0 or more; None: off)
    also ``("logprobs", [(token, logprob, [(alternative, logprob), ...]), ...])`` before the
    text event its tokens belong to (the rest before ``end``): natural-log probabilities under
    the model's own distribution (its log-softmax, before any sampling warper), one entry per
    completion token, EOS included.

    ``stream`` (when the tokenizer's incremental decoding equals its whole decode): makes a
    decoder that takes the completion's tokens one by one and returns each one's new text, so
    a token costs its own decoding rather than the whole answer's; the answer's final text is
    ``decode`` of the whole, as without it."""

    ids: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    decode: Callable[[list[int]], str]
    stream: Callable[[], Callable[[int], str]] | None = None  # a new incremental decoder (None: ``decode`` each token)
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    top_k: int | None = None  # the further warpers, as :class:`~treeattn.decoding.sampler.Sampler` applies them
    min_p: float | None = None
    typical_p: float | None = None
    eta_cutoff: float | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0  # the history's processors (:class:`~treeattn.decoding.penalties.Penalties`)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # before this many tokens: no EOS, stop token or stop string ends it
    echo: str | None = None  # completions' echo: the prompt's text, sent before the answer (None: no echo)
    grammar: Callable[[], object] | None = None  # a new matcher of its response_format (serve.grammar.Grammar)
    stop: list[str] = field(default_factory=list)
    eos: list[int] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


def first_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the first stop string begins in ``text`` (searching from ``start``), or None."""
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def safe_prefix(text: str, stops: list[str]) -> str:
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
