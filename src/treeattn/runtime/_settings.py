"""What a :class:`treeattn.runtime.Session` is created with: its :class:`~treeattn.config.Layout`
checked on each rank, then agreed across the ranks with the model's shape (one small int64
all-gather of a digest of every field, nothing pickled), so a bad or differing argument raises
the same ``ValueError`` on every rank before any other collective."""

from __future__ import annotations

import torch

from ..comm.collectives import world
from ..comm.validate import agree
from ..config import ATTENTIONS, PREFILLS, Layout
from ..hf.families import max_positions
from ..hf.model import model_problem
from ..hf.tensor_parallel import tensor_parallel_ranks

__all__ = ["ATTENTIONS", "PREFILLS", "agree_settings"]


def agree_settings(model: torch.nn.Module, group, *, max_length: int | None, **layout) -> tuple[Layout | None, int]:
    """Check a Session's arguments (see :class:`~treeattn.runtime.Session`; ``layout``: the fields of
    :class:`~treeattn.config.Layout`) and agree on them and the model's shape across ``group``;
    returns (the layout, the sequence length limit: ``max_length`` or the model's positions).
    ValueError on every rank when any rank's are bad or differ."""
    err, limit, lay = None, 0, None
    try:
        lay = Layout(**layout)
        why = model_problem(model)
        if why is not None:
            raise ValueError(why)
        max_pos = max_positions(model.config) or (1 << 62)
        if max_length is not None and (type(max_length) is not int or not 1 <= max_length <= max_pos):
            raise ValueError(
                f"max_length must be an int in [1, {max_pos}] (the model's max_position_embeddings), "
                f"got {max_length!r}"
            )
        limit = max_length or max_pos
        tp, p = tensor_parallel_ranks(model), world(group)[1]
        if tp not in (1, p):
            raise ValueError(f"the model's weights are split over {tp} ranks (tensor_parallel), but the group has {p}: "
                             "split it over the session's group")  # fmt: skip
    except (ValueError, TypeError) as e:
        err = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    cfg = model.config if err is None else None
    fields = {
        "layout": lay if err is None else None,
        "max_length": limit,
        "num_hidden_layers": cfg.num_hidden_layers if cfg else -1,
        "vocab_size": cfg.vocab_size if cfg else -1,
        "hidden_size": cfg.hidden_size if cfg else -1,
        "tensor parallel ranks": tensor_parallel_ranks(model),
    }
    agree(fields, err, group=group)
    return lay, limit
