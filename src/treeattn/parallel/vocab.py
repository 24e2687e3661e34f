"""The vocabulary split over the ranks (Megatron's vocab-parallel layers): rank ``r`` holds rows
``[lo, hi)`` of the embedding table and of the LM head (one tensor when they are tied).

- The embedding looks up the tokens that fall in its rows, zeros for the rest, and one
  all-reduce sums the ranks' lookups: each token's row comes from exactly one rank and every
  other adds zeros, so the sum is that row (bit for bit, but that ``-0.0`` becomes ``+0.0``). In a sequence-sharded forward
  (:func:`treeattn.parallel.tensor.sharded_tokens`) the ranks first all-gather the token ids
  and each keeps its own tokens' rows of the sum.
- The head computes the logits of its rows and one all-gather puts the vocabulary together,
  in rank order, the same bits on every rank.

Slices start at multiples of 64 rows (the packed CPU kernel's output groups,
:mod:`treeattn.ops.linear_cpu`), so each is a whole number of the kernel's groups."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..comm.collectives import all_gather, all_reduce, world
from ..comm.shm_small import SMALL
from .tensor import _SHARDED, _own, _own_rows_of_sum

__all__ = ["VocabParallelEmbedding", "VocabParallelHead", "gather_vocab", "vocab_slice"]

GROUP = 64  # rows per slice unit: the packed kernel's output groups


def vocab_slice(n: int, rank: int, p: int) -> tuple[int, int, int]:
    """``(lo, hi, per)``: rank ``rank``'s rows ``[lo, hi)`` of ``n``, ``per`` rows a rank at most."""
    per = -(-n // (GROUP * p)) * GROUP
    return min(n, rank * per), min(n, (rank + 1) * per), per


def gather_vocab(part: Tensor, n: int, per: int, group) -> Tensor:
    """Every rank's ``part [N, hi - lo]`` (its rows of ``n``, ``per`` a rank at most) put
    together as ``[N, n]`` in rank order (collective: every rank calls it alike). On the CPU
    the rows go in steps that each fit the shared-memory gather."""
    p = world(group)[1]
    out = torch.empty(p, part.shape[0], per, dtype=part.dtype, device=part.device)
    cpu = part.device.type == "cpu"
    step = max(1, SMALL // max(1, per * part.element_size())) if cpu else max(1, part.shape[0])
    for a in range(0, part.shape[0], step):
        mine = part[a : a + step]
        if mine.shape[1] < per:  # the last slice, padded to the others' width
            mine = torch.cat([mine, mine.new_zeros(mine.shape[0], per - mine.shape[1])], 1)
        out[:, a : a + step] = all_gather(mine.contiguous(), group)
    return out.permute(1, 0, 2).reshape(part.shape[0], p * per)[:, :n]


def _all_ids(ids: Tensor, sharded) -> Tensor:
    """Every rank's token ids ``[B, counts[r]]`` of a sequence-sharded forward, in rank order."""
    counts = sharded.counts
    n = max(counts)
    pad = ids if ids.shape[-1] == n else torch.cat([ids, ids.new_zeros(*ids.shape[:-1], n - ids.shape[-1])], -1)
    g = all_gather(pad.contiguous(), sharded.group)  # [p, B, n]
    return torch.cat([g[r, ..., :c] for r, c in enumerate(counts)], -1)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[lo, hi)`` of ``embedding`` (an ``nn.Embedding``, or a subclass whose forward
    scales the rows by its ``embed_scale``, as Gemma-3's) on this rank; its forward gives every
    token's whole row, as the embedding did (collective over ``group``; a ``-0.0`` in the table
    comes back ``+0.0``, the only bits that differ). On the CPU an id outside the vocabulary
    raises IndexError on every rank, as the embedding does; elsewhere (no host read per step)
    it gives a row of zeros: the callers check ids first (Session, generate, the server)."""

    def __init__(self, embedding: nn.Embedding, lo: int, hi: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.lo, self.hi, self.group = lo, hi, group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = _own(embedding.weight[lo:hi])
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = None if scale is None else torch.as_tensor(scale).clone()

    def forward(self, ids: Tensor) -> Tensor:
        sharded = _SHARDED.get()
        many = sharded is not None and len(sharded.counts) > 1
        if many:
            ids = _all_ids(ids, sharded)
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings})")  # (every rank sees every id here)
        local = ids - self.lo
        inside = (local >= 0) & (local < self.hi - self.lo)
        if self.hi > self.lo:
            y = F.embedding(local.clamp(0, self.hi - self.lo - 1), self.weight)
            y = y.masked_fill(~inside.unsqueeze(-1), 0.0)
        else:  # a vocabulary smaller than the ranks' slices: this rank holds no row
            y = self.weight.new_zeros(*ids.shape, self.embedding_dim)
        y = _own_rows_of_sum(y, sharded, self.group) if many else all_reduce(y, dist.ReduceOp.SUM, self.group)
        return y if self.embed_scale is None else y * self.embed_scale.to(y.dtype)

    def shards(self) -> dict[str, tuple[str, tuple]]:
        """Each parameter's name -> (its whole tensor's name in the wrapped embedding, this rank's index)."""
        return {"weight": ("weight", (slice(self.lo, self.hi),))}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (rows {self.lo}:{self.hi} here)"


class VocabParallelHead(nn.Module):
    """Output rows ``[lo, hi)`` of the LM head ``head`` on this rank (``weight``: the tied
    embedding's rows, shared; else the head's own), run by ``inner`` (an ``nn.Linear``: the CPU
    packing takes it); its forward gives every logit, all-gathered over ``group``."""

    def __init__(self, head: nn.Linear, lo: int, hi: int, per: int, group: dist.ProcessGroup | None,
                 weight: nn.Parameter | None = None) -> None:  # fmt: skip
        super().__init__()
        self.lo, self.hi, self.per, self.group = lo, hi, per, group
        self.in_features, self.out_features = head.in_features, head.out_features
        self.inner = nn.Linear(head.in_features, hi - lo, bias=head.bias is not None, device="meta")
        self.inner.weight = weight if weight is not None else _own(head.weight[lo:hi])
        if head.bias is not None:
            self.inner.bias = _own(head.bias[lo:hi])

    def forward(self, x: Tensor) -> Tensor:
        part = self.inner(x.reshape(-1, self.in_features))
        return gather_vocab(part, self.out_features, self.per, self.group).reshape(*x.shape[:-1], self.out_features)

    def shards(self) -> dict[str, tuple[str, tuple]]:
        """Each parameter's name -> (its whole tensor's name in the wrapped head, this rank's index)."""
        return {"inner.weight": ("weight", (slice(self.lo, self.hi),)), "inner.bias": ("bias", (slice(self.lo, self.hi),))}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (rows {self.lo}:{self.hi} here)"
