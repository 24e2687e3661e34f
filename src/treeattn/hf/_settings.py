"""What a :class:`treeattn.hf.Session` is created with: its settings checked on each rank,
then agreed across the ranks (one small int64 all-gather, nothing pickled), so a bad or
differing argument raises the same ``ValueError`` on every rank before any other collective."""

from __future__ import annotations

import torch

from ..cache import PLACEMENTS
from ..comm.strategies import STRATEGIES
from ..comm.validate import agree
from ._model import model_problem

ATTENTIONS = ("tree", "ring")
PREFILLS = ("auto", "tree", "ring")


def agree_settings(model: torch.nn.Module, group, *, placement: str, attention: str, strategy: str,
                   prefill_chunk: int | None, max_length: int | None, block: int | None, prefill: str) -> int:  # fmt: skip
    """Check a Session's arguments (see :class:`~treeattn.hf.Session`) and agree on them and the
    model's shape across ``group``; returns the sequence length limit (``max_length`` or the
    model's positions). ValueError on every rank when any rank's are bad or differ."""
    err, limit = None, 0
    try:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if prefill_chunk is not None and (type(prefill_chunk) is not int or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be an int >= 1 or None, got {prefill_chunk!r}")
        if block is not None and (type(block) is not int or block < 1):
            raise ValueError(f"block must be an int >= 1 or None, got {block!r}")
        why = model_problem(model)
        if why is not None:
            raise ValueError(why)
        max_pos = getattr(model.config, "max_position_embeddings", None) or (1 << 62)
        if max_length is not None and (not isinstance(max_length, int) or not 1 <= max_length <= max_pos):
            raise ValueError(
                f"max_length must be an int in [1, {max_pos}] (the model's max_position_embeddings), "
                f"got {max_length!r}"
            )
        limit = max_length or max_pos
    except (ValueError, TypeError) as e:
        err = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    ok = err is None
    cfg = model.config if ok else None
    fields = {
        "attention": ATTENTIONS.index(attention) if attention in ATTENTIONS else -1,
        "prefill": PREFILLS.index(prefill) if prefill in PREFILLS else -1,
        "placement": PLACEMENTS.index(placement) if placement in PLACEMENTS else -1,
        "strategy": STRATEGIES.index(strategy) if strategy in STRATEGIES else -1,
        "prefill_chunk": prefill_chunk or 0 if ok else -1,
        "block": block or 0 if ok else -1,
        "max_length": limit,
        "num_hidden_layers": cfg.num_hidden_layers if ok else -1,
        "vocab_size": cfg.vocab_size if ok else -1,
        "hidden_size": cfg.hidden_size if ok else -1,
    }
    agree(fields, err, group=group, show={"attention": dict(enumerate(ATTENTIONS)),
                                          "placement": dict(enumerate(PLACEMENTS))})  # fmt: skip
    return limit
