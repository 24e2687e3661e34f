"""The LM head split over the ranks' vocabulary, on CPUs. Every rank holds the same hidden
states, so each computes the logits of its slice of the vocabulary and one all-gather (through
/dev/shm on one host: :mod:`treeattn.comm.shm_small`) puts them together, in the same bits on
every rank. Each rank reads ``1/p`` of the head instead of all of it: SmolLM2-135M's head,
tied to its embeddings, is 49,152 x 576 float32 (113 MB), which two ranks used to read whole,
at the same time, every step (docs/benchmarks/session.md).

Slices start at multiples of 64 outputs, the packed kernel's output groups
(:mod:`treeattn.ops.linear_cpu`), so a packed head's slice is a view of its packed stream and
every logit is the same sum as the whole head's (bitwise). A head on oneDNN's packed layout,
on another device, or of a single rank is run whole. A head :func:`treeattn.hf.tensor_parallel`
split holds its rows only (:class:`treeattn.parallel.vocab.VocabParallelHead`) and gathers itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..comm.collectives import world
from ..parallel.vocab import gather_vocab, vocab_slice
from .linear import _ATTR


def _local(head: nn.Linear, x: Tensor, lo: int, hi: int) -> Tensor | None:
    """This rank's logits ``[n, hi - lo]`` of ``x [n, K]`` (None: the head cannot be sliced here)."""
    if hi == lo:  # a vocabulary smaller than the ranks' slices
        return x.new_zeros(x.shape[0], 0)
    bias = None if head.bias is None else head.bias[lo:hi]
    packed = getattr(head, _ATTR, None)
    if packed is None:
        return F.linear(x, head.weight[lo:hi], bias)
    wp, _, _, own = packed
    if not own:  # oneDNN's opaque layout cannot be sliced
        return None
    from ..ops.linear_cpu import packed_linear

    k = x.shape[1]
    end = hi if hi < head.out_features else 16 * ((head.out_features + 15) // 16)  # the last group's padding
    return packed_linear(x, wp[lo * k : end * k], hi - lo, bias)


def split_head(model: nn.Module, hidden: Tensor, group) -> Tensor | None:
    """The output head of ``model`` over ``hidden [..., D]`` computed a vocabulary slice per rank
    of ``group`` and all-gathered (collective: every rank calls it alike); None where it does not
    apply (one rank, not on the CPU, autograd recording, a head that is not an ``nn.Linear`` or
    cannot be sliced)."""
    rank, p = world(group)
    head = model.get_output_embeddings()
    if p == 1 or hidden.device.type != "cpu" or type(head) is not nn.Linear or torch.is_grad_enabled():
        return None  # (the all-gather has no backward)
    V, D = head.out_features, head.in_features
    lo, hi, per = vocab_slice(V, rank, p)
    x = hidden.reshape(-1, D)
    part = _local(head, x, lo, hi)
    if part is None:
        return None
    return gather_vocab(part, V, per, group).reshape(*hidden.shape[:-1], V)
