"""The decoding methods :func:`treeattn.decoding.generate` loops over, one per kind, each over a
:class:`~treeattn.runtime.Session` whose prompt is in: :meth:`Decoder.first` takes the prompt's
logits and gives the first token, :meth:`Decoder.next` commits the last token given and gives
the next ones (one, or several at once under speculation), :attr:`Decoder.logits` the logits
the last token given was chosen from. Tokens are ``[B]`` int64 on the ids' device, identical
on every rank; every call is collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .contrastive import HiddenStore, contrastive_step
from .speculative import Speculator


class Decoder:
    logits: Tensor | None = None

    def first(self, logits: Tensor) -> Tensor:
        raise NotImplementedError

    def next(self, tok: Tensor, left: int) -> list[Tensor]:
        """After ``tok``, at most ``left`` tokens (at least one)."""
        raise NotImplementedError

    def stats(self) -> dict:
        """What the method adds to generate's ``info``."""
        return {}


class Plain(Decoder):
    """Greedy or sampled decoding: one step per token, ``pick(logits [B, V]) -> [B]``."""

    def __init__(self, session, pick) -> None:
        self.session, self.pick = session, pick

    def first(self, logits):
        self.logits = logits
        return self.pick(logits)

    def next(self, tok, left):
        self.logits = self.session.extend(tok[:, None], check=False)
        return [self.pick(self.logits)]


class Contrastive(Decoder):
    """Contrastive search (one sequence): each token chosen and committed by
    :func:`~treeattn.decoding.contrastive.contrastive_step`, which also gives the logits after it."""

    def __init__(self, session, alpha: float, k: int, device) -> None:
        self.session, self.alpha, self.k, self.device = session, alpha, k, device
        session.hidden = HiddenStore(session)
        self._after: Tensor | None = None

    def first(self, logits):
        return self.next(None, 1, logits)[0]

    def next(self, tok, left, logits: Tensor | None = None):
        self.logits = self._after if logits is None else logits
        t, self._after = contrastive_step(self.session, self.logits, self.alpha, self.k)
        return [torch.tensor([t], device=self.device)]


class Speculative(Decoder):
    """Speculative decoding (one sequence): :class:`~treeattn.decoding.speculative.Speculator`'s steps,
    each committing the accepted draft and the target's own next token."""

    def __init__(self, session, spec: Speculator, pick) -> None:
        self.session, self.spec, self.pick = session, spec, pick

    def first(self, logits):
        self.logits = logits
        return self.pick(logits)

    def next(self, tok, left):
        new = self.spec.step(self.session, int(tok), left)
        self.logits = self.spec.last_logits
        return [tok.new_tensor([t]) for t in new]

    def stats(self):
        st = self.spec.stats
        out = dict(mean_accepted_length=st.mean_accepted_length, acceptance_rates=st.rates(),
                   target_forwards=len(st.committed))  # fmt: skip
        pol = self.spec.policy
        if pol is not None and pol.costs.seconds:  # rank 0's measured step costs, plain = 1
            out["step_costs"] = {T: pol.step_cost(T) for T in sorted(pol.costs.seconds)}
        return out


@dataclass
class GenerationStats:
    """What one :func:`~treeattn.decoding.generate` call measured (its ``info``): ``ttft`` (seconds to the
    first token), ``prefill`` (of which the prompt's extend), ``decode`` (seconds per later token;
    tokens of one speculative step share its time), ``cache_bytes`` and ``peak_bytes`` (as
    :meth:`Session.stats`), ``last_logits`` (``[B, V]``: what the last token was chosen from)."""

    ttft: float
    prefill: float
    decode: list[float]
    cache_bytes: dict
    peak_bytes: int
    last_logits: Tensor | None
