"""The runtime (extra ``[hf]``): one :class:`ModelRunner` runs a transformers model over the
sharded K/V cache for every kind of :class:`Step` (:mod:`.steps`; a batched step over shared
prefixes, :mod:`._cascade`); a :class:`Session` (one batch of sequences, :mod:`.session`) and
the server's :class:`BatchRunner` (many rows over shared prefixes, :mod:`.batch`) hold state
only. Decoding methods over a Session are :mod:`treeattn.decoding`."""

from ..hf.attention import Step
from .batch import BatchRunner
from .runner import ModelRunner
from .session import Session

__all__ = ["BatchRunner", "ModelRunner", "Session", "Step"]
