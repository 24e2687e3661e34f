"""The merge of a reduction's packed states: ``buf [N, ..., Dv + 1]``, each row its out then its
lse, as the all-gather strategy receives them. A decode step merges once per layer, so on the
CPU it is one compiled call (``_merge_cpu.c``, in the decode kernel's shared object) instead of
a dozen small PyTorch ops; elsewhere, or without the compiled kernel, :func:`merge_states_n`."""

from __future__ import annotations

import torch
from torch import Tensor

from ._decode_cpu import merge_packed_cpu
from .state import merge_states_n


def merge_packed(buf: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`~treeattn.ops.state.merge_states_n` of ``buf [N, ..., Dv + 1]`` along dim 0:
    ``(out [..., Dv], lse [...])``, float32 (float64 for float64 states)."""
    if buf.device.type == "cpu" and buf.dtype == torch.float32 and buf.is_contiguous() and buf.ndim > 1:
        r = merge_packed_cpu(buf)
        if r is not None:
            return r
    return merge_states_n(buf[..., :-1], buf[..., -1])
