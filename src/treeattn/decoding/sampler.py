"""The next-token rule, one for every caller: ``generate``, speculative decoding (its
verifier and its draft model) and the server's requests."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# Below this temperature the scores are shifted by their maximum before the division (the same
# distribution): logits / 1e-45 overflow to inf and the softmax to NaN. Above it transformers'
# own warper runs, bit for bit (logits would have to exceed ~3e34 to overflow).
_SHIFT_BELOW = 1e-4


class _ShiftedTemperature:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self, ids: Tensor, scores: Tensor) -> Tensor:
        return ((scores - scores.amax(-1, keepdim=True)).double() / self.t).to(scores.dtype)  # t: maybe under float32's range


class Sampler:
    """Greedy (``sample`` False: the argmax, the first of equal maxima as in torch and
    transformers) or a draw from the softmax of the warped float32 logits (``sample`` True).

    The warpers are transformers' own, in the order its ``generate`` applies them: temperature
    (> 0), top-k (``None``/0: off), top-p in (0, 1], min-p in [0, 1] (``None``/0: off), typical-p
    in (0, 1], eta cutoff (``None``/0: off); none needs the token history. Draws come from one ``torch.Generator``
    on ``device`` seeded with ``seed``: equal parameters, seeds and logits give equal tokens,
    whatever else runs in the process. Raises ValueError for a parameter out of its range
    (top_p, typical_p outside (0, 1], min_p outside [0, 1]; the others as transformers' warpers do).
    """

    def __init__(self, sample: bool = False, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, typical_p: float | None = None, eta_cutoff: float | None = None,
                 seed: int = 0, min_p: float | None = None, device: torch.device | str | None = None) -> None:  # fmt: skip
        self.sample = sample
        self.gen = torch.Generator(device=device or "cpu").manual_seed(seed)
        w = self.warpers = LogitsProcessorList()
        if sample:
            for name, x in (("top_p", top_p), ("typical_p", typical_p)):
                if x is not None and not 0 < x <= 1:  # transformers' warpers never see 1 or more
                    raise ValueError(f"{name} must be a float in (0, 1], got {x!r}")
            if min_p is not None and not 0 <= min_p <= 1:
                raise ValueError(f"min_p must be a float in [0, 1], got {min_p!r}")
            if 0 < temperature < _SHIFT_BELOW:
                w.append(_ShiftedTemperature(temperature))
            elif temperature != 1.0:
                w.append(TemperatureLogitsWarper(temperature))
            if top_k:
                w.append(TopKLogitsWarper(top_k))
            if top_p is not None and top_p < 1.0:
                w.append(TopPLogitsWarper(top_p))
            if min_p:
                w.append(MinPLogitsWarper(min_p))
            if typical_p is not None and typical_p < 1.0:
                w.append(TypicalLogitsWarper(typical_p))
            if eta_cutoff:
                w.append(EtaLogitsWarper(eta_cutoff, device=self.gen.device))

    def warp(self, logits: Tensor) -> Tensor:
        """The warped float32 scores of ``logits`` ``[V]`` or ``[N, V]`` (same shape)."""
        x = logits.float()
        one = x.dim() == 1
        x = x[None] if one else x
        x = self.warpers(torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device), x)
        return x[0] if one else x

    def probs(self, logits: Tensor) -> Tensor:
        """The sampling distribution of ``logits`` ``[V]`` or ``[N, V]`` (same shape, float32)."""
        return torch.softmax(self.warp(logits), -1)

    def pick(self, logits: Tensor) -> Tensor:
        """The next token of every row of ``logits`` ``[N, V]``: int64 ``[N]``."""
        if not self.sample:
            return logits.argmax(-1)
        p = self.probs(logits)
        return torch.multinomial(p.to(self.gen.device), 1, generator=self.gen).squeeze(1).to(logits.device)

    def next(self, logits: Tensor) -> int:
        """The next token of one row, ``logits`` ``[V]``."""
        return self.draw(self.probs(logits)) if self.sample else int(logits.argmax())

    def draw(self, p: Tensor) -> int:
        """One draw from the distribution ``p`` ``[V]``."""
        return int(torch.multinomial(p.to(self.gen.device), 1, generator=self.gen))

    def draws(self, p: Tensor, n: int) -> list[int]:
        """``n`` draws from the distribution ``p`` ``[V]``, with replacement."""
        return torch.multinomial(p.to(self.gen.device), n, replacement=True, generator=self.gen).tolist()

    def rand(self) -> float:
        """A uniform draw in [0, 1)."""
        return float(torch.rand((), generator=self.gen, device=self.gen.device))
