"""Decoding methods over a :class:`treeattn.runtime.Session` (extra ``[hf]``): :func:`generate`
(a loop over a decoder, :mod:`.decoders`: greedy / sampling, contrastive search, speculative
decoding), the sampler and its processors (:mod:`.sampler`, :mod:`.penalties`), drafters
(:mod:`.prompt_lookup`, draft models in :mod:`.speculative`), the drafting policy and its step
costs (:mod:`.draft_policy`, :mod:`.step_costs`)."""

from .generate import generate
from .sampler import Sampler

__all__ = ["Sampler", "generate"]
