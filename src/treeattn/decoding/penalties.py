"""The logits processors that read a sequence's history, applied before the sampler (and before
greedy's argmax), in vLLM's order: ``min_tokens`` (the end tokens masked until that many were
generated), ``logit_bias`` (added per token), then the penalties: ``repetition_penalty``
(transformers' and vLLM's: a seen token's positive logit divided by it, a negative one
multiplied; over the prompt and the output), ``frequency_penalty`` and ``presence_penalty``
(OpenAI's: subtracted once per occurrence in the output, and once for occurring at all).

One :class:`Penalties` per sequence; it keeps the prompt's and the output's token counts as
tokens arrive (:meth:`add`), so a step costs O(V), not O(history)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

BIAS_RANGE = 100.0  # |logit_bias| at most (OpenAI's)
PENALTY_RANGE = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's)


def penalty_problem(*, repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
                    logit_bias: dict[int, float] | None = None, min_tokens: int = 0, vocab: int) -> tuple | None:  # fmt: skip
    """``(field, message)`` for the first value out of range (None: all fine)."""
    for name, v, ok, want in (
        ("repetition_penalty", repetition, 0 < repetition <= 100, "in (0, 100]"),
        ("presence_penalty", presence, abs(presence) <= PENALTY_RANGE, f"in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]"),
        ("frequency_penalty", frequency, abs(frequency) <= PENALTY_RANGE, f"in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]"),
    ):
        if not (isinstance(v, int | float) and not isinstance(v, bool) and ok):
            return name, f"{name} must be a number {want}, got {v!r}"
    if type(min_tokens) is not int or min_tokens < 0:
        return "min_tokens", f"min_tokens must be an integer >= 0, got {min_tokens!r}"
    for t, b in (logit_bias or {}).items():
        if type(t) is not int or not 0 <= t < vocab:
            return "logit_bias", f"logit_bias keys must be token ids in [0, {vocab}), got {t!r}"
        if not (isinstance(b, int | float) and not isinstance(b, bool) and abs(b) <= BIAS_RANGE):
            return "logit_bias", f"logit_bias values must be numbers in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], got {b!r}"
    return None


class Penalties:
    """The history-dependent processors of one sequence over a vocabulary of ``vocab`` tokens.

    Args:
        prompt: the prompt's token ids (the repetition penalty counts them; the others do not).
        repetition: > 0 (1: off). presence, frequency: in [-2, 2] (0: off).
        logit_bias: token id -> a bias in [-100, 100] added to its logit.
        min_tokens: before this many output tokens, the ``ends`` (EOS, stop token ids) are
            masked to -inf.

    Raises:
        ValueError: a value out of its range (:func:`penalty_problem`'s message).
    """

    def __init__(self, prompt: Sequence[int], vocab: int, *, repetition: float = 1.0, presence: float = 0.0,
                 frequency: float = 0.0, logit_bias: dict[int, float] | None = None, min_tokens: int = 0,
                 ends: Sequence[int] = ()) -> None:  # fmt: skip
        bad = penalty_problem(repetition=repetition, presence=presence, frequency=frequency, logit_bias=logit_bias,
                              min_tokens=min_tokens, vocab=vocab)  # fmt: skip
        if bad is not None:
            raise ValueError(bad[1])
        self.V, self.rep, self.pres, self.freq, self.min_tokens = vocab, float(repetition), presence, frequency, min_tokens
        self.ends = torch.tensor(sorted({int(e) for e in ends if 0 <= e < vocab}), dtype=torch.int64)
        self.bias = None
        if logit_bias:
            self.bias = torch.zeros(vocab)
            self.bias[torch.tensor(list(logit_bias))] = torch.tensor([float(b) for b in logit_bias.values()])
        self.seen = torch.zeros(vocab, dtype=torch.bool)  # in the prompt or the output
        self.seen[torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.int64)] = True
        self.counts = torch.zeros(vocab)  # in the output
        self.n = 0  # output tokens

    @property
    def active(self) -> bool:
        """Whether any processor changes a logit."""
        return bool(self.rep != 1.0 or self.pres or self.freq or self.bias is not None or self.min_tokens)

    def add(self, tok: int) -> None:
        """An output token was taken."""
        if 0 <= tok < self.V:
            self.seen[tok] = True
            self.counts[tok] += 1
        self.n += 1

    def __call__(self, logits: Tensor, ahead: Sequence[int] = ()) -> Tensor:
        """``logits [V]`` processed (float32, a new tensor) for the next token after the
        output so far and ``ahead`` (tentative tokens after it: a draft being verified)."""
        x = logits.float().clone()
        seen, counts = self.seen, self.counts
        if ahead:
            seen, counts = seen.clone(), counts.clone()
            t = torch.tensor([a for a in ahead if 0 <= a < self.V], dtype=torch.int64)
            seen[t] = True
            counts.index_add_(0, t, torch.ones(len(t)))
        dev = x.device
        if self.n + len(ahead) < self.min_tokens and len(self.ends):
            x[self.ends.to(dev)] = float("-inf")
        if self.bias is not None:
            x += self.bias.to(dev)
        if self.rep != 1.0:
            s = seen.to(dev)
            x = torch.where(s, torch.where(x < 0, x * self.rep, x / self.rep), x)
        if self.freq or self.pres:
            c = counts.to(dev)
            x -= self.freq * c + self.pres * (c > 0).float()
        return x
