"""Tensor parallelism applied from outside a model (gpt-fast's ``tp.py``, Megatron's layers):
a linear layer's weight split over the ranks of a group by output rows (column parallel: each
rank computes its slice of the outputs) or by input columns (row parallel: each rank
multiplies its slice of the inputs, then one all-reduce sums the partial outputs).

Two kinds of forward. When every rank runs the same tokens (a decode step, a token tree, the
server's batched rows) the activations are replicated: column parallel needs no
communication and row parallel one all-reduce. When each rank runs tokens of its own (the
sequence-sharded prefill, announced by :func:`sharded_tokens`), a layer that needs every
token's inputs first all-gathers them (Megatron's sequence parallelism), and a row-parallel
layer keeps its own tokens' rows of the summed output.

The all-reduce is :func:`treeattn.comm.collectives.all_reduce`: for a decode step's few rows
through /dev/shm on one host, summed in rank order on every rank; either way every rank holds
the same bits, so a run's tokens do not depend on timing. A row-parallel layer's bias is added
once, after the sum. Every rank must run every forward alike (treeattn's ranks run in lockstep).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.collectives import all_gather, all_reduce, world
from ..comm.shm import shm_exchange


class _Sharded:
    """The sequence-sharded forward running: tokens per rank of ``group``, gathered inputs."""

    __slots__ = ("counts", "memo", "group")

    def __init__(self, counts: tuple[int, ...], group) -> None:
        self.counts, self.memo, self.group = counts, {}, group


_SHARDED: ContextVar[_Sharded | None] = ContextVar("treeattn_sharded_tokens", default=None)


@contextlib.contextmanager
def sharded_tokens(counts: list[int], group: dist.ProcessGroup | None = None):
    """The forwards inside run ``counts[r]`` tokens (dimension -2 of the activations) on rank
    ``r`` of ``group`` (the sequence group: the world, or this rank's KVP group of a mesh whose
    head slices run the same tokens), each rank its own: tensor-parallel layers gather the
    tokens over ``group`` and keep their own tokens' rows of a sum over their own group."""
    tok = _SHARDED.set(_Sharded(tuple(int(n) for n in counts), group))
    try:
        yield
    finally:
        _SHARDED.reset(tok)  # the gathered inputs go with it


def split(n: int, rank: int, p: int, unit: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s share ``[lo, hi)`` of ``n`` items in groups of ``unit`` (``n % unit ==
    0``) over ``p`` ranks: contiguous, the first ``(n / unit) % p`` ranks one group more."""
    q, r = divmod(n // unit, p)
    lo = rank * q + min(rank, r)
    return lo * unit, (lo + q + (rank < r)) * unit


def _own(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)  # the whole weight can go


def _linear(w: Tensor) -> nn.Linear:
    m = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    m.weight = _own(w)
    return m


class Tokens:
    """Every rank's tokens of a sequence-sharded forward, gathered: shared by the layers that
    read one input (a gated MLP's gate and up projections), gathered once per forward."""

    def all(self, x: Tensor, sharded: _Sharded) -> Tensor:
        """``x [..., counts[rank], C]`` -> ``[..., sum(counts), C]`` (rank order)."""
        counts, memo = sharded.counts, sharded.memo
        if len(counts) == 1:
            return x
        hit = memo.get(id(self))
        if hit is not None and hit[0] is x:
            return hit[1]
        blocks = _exchange(x, list(counts), sharded.group)
        if blocks is not None:
            out = torch.cat(blocks, -2)
        else:  # through the process group: padded to the longest
            n = max(counts)
            pad = x if x.shape[-2] == n else torch.cat([x, x.new_zeros(*x.shape[:-2], n - x.shape[-2], x.shape[-1])], -2)
            g = all_gather(pad.contiguous(), sharded.group)  # [p, ..., n, C]
            out = torch.cat([g[r, ..., :c, :] for r, c in enumerate(counts)], -2)
        memo.clear()  # one gathered input alive at a time (the layers read it right away), not one per layer
        memo[id(self)] = (x, out)
        return out


def _exchange(x: Tensor, counts: list[int], group) -> list[Tensor] | None:
    """Every rank's ``x [B, counts[r], C]`` in rank order, through /dev/shm (each rank publishes
    its block once, its peers read it in place: :mod:`treeattn.comm.shm`); None where the ranks
    share no memory. The peers' blocks are views, valid until the exchange after next."""
    ex = shm_exchange(group)
    if ex is None or x.dim() != 3:
        return None
    B, n, C = x.shape
    k, v = x.reshape(B, 1, n, C), x.new_empty(B, 1, n, 0)
    if not ex.fits(k, v, counts):
        return None
    rank = world(group)[0]
    out: list[Tensor | None] = [None] * len(counts)
    out[rank] = x
    for src, ks, _ in ex.exchange(k.contiguous(), v, counts):
        out[src] = ks.reshape(B, counts[src], C)
    return out


def _own_rows_of_sum(y: Tensor, sharded: _Sharded, group) -> Tensor:
    """This rank's rows (its tokens, at ``sum(counts[:rank])`` of the sequence group) of the sum
    over ``group``'s ranks of ``y [..., sum(counts), C]``: each rank reads its rows of every
    peer's ``y`` in place and adds them in rank order (a reduce-scatter); through the process
    group, or when the sequence group is not ``group`` (a mesh's KVP group), an all-reduce."""
    counts = sharded.counts
    rank, p = world(sharded.group)
    a, n = sum(counts[:rank]), counts[rank]
    N = sum(counts)
    same = sharded.group is group or world(group)[1] == p
    blocks = _exchange(y, [N] * p, group) if y.dim() == 3 and same else None
    if blocks is None:
        return all_reduce(y.contiguous(), dist.ReduceOp.SUM, group)[..., a : a + n, :]
    out = blocks[0][:, a : a + n].clone()
    for b in blocks[1:]:
        out += b[:, a : a + n]
    return out


class ColumnParallel(nn.Module):
    """Output rows ``[lo, hi)`` of ``linear`` on this rank (no communication, but the gather of
    a sequence-sharded forward's tokens; ``tokens`` None: none either, each rank computes its
    own tokens' rows, as a head slice's Q/K/V do)."""

    def __init__(self, linear: nn.Linear, lo: int, hi: int, tokens: Tokens | None) -> None:
        super().__init__()
        self.lo, self.hi, self.tokens = lo, hi, tokens
        self.in_features, self.out_features, self.whole = linear.in_features, hi - lo, linear.out_features
        self.inner = _linear(linear.weight[lo:hi])
        self.bias = None if linear.bias is None else _own(linear.bias[lo:hi])

    def forward(self, x: Tensor) -> Tensor:
        sharded = _SHARDED.get()
        if sharded is not None and self.tokens is not None:
            x = self.tokens.all(x, sharded)
        y = self.inner(x)
        return y if self.bias is None else y + self.bias

    def shards(self) -> dict[str, tuple[str, tuple]]:
        """Each parameter's name -> (its whole tensor's name in the wrapped linear, this rank's index)."""
        return {"inner.weight": ("weight", (slice(self.lo, self.hi),)), "bias": ("bias", (slice(self.lo, self.hi),))}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (rows {self.lo}:{self.hi} of {self.whole})"


class RowParallel(nn.Module):
    """Input columns ``[lo, hi)`` of ``linear`` on this rank: ``inner`` multiplies them (taken
    from an input holding columns ``[base, ...)`` when ``sliced``, the whole input at ``base``
    0; else the input is this rank's slice already, from a column-parallel layer), one
    all-reduce over ``group`` sums the ranks' products, then the bias."""

    def __init__(self, linear: nn.Linear, lo: int, hi: int, group: dist.ProcessGroup | None, sliced: bool,
                 base: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.lo, self.hi, self.sliced, self.group, self.base = lo, hi, sliced, group, base
        self.tokens = Tokens()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = _linear(linear.weight[:, lo:hi])
        self.bias = None if linear.bias is None else _own(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        sharded = _SHARDED.get()
        if sharded is not None and self.sliced:  # every rank's tokens, this rank's columns
            x = self.tokens.all(x, sharded)
        if self.sliced and (sharded is not None or x.shape[-1] != self.hi - self.lo):
            x = x[..., self.lo - self.base : self.hi - self.base]  # (else the input is its columns already:
            # a Tree reduction scattered over the heads returned this rank's heads only)
        if sharded is not None:  # this rank's tokens of the sum
            y = _own_rows_of_sum(self.inner(x), sharded, self.group)
        else:
            y = all_reduce(self.inner(x).contiguous(), dist.ReduceOp.SUM, self.group)
        return y if self.bias is None else y + self.bias

    def shards(self) -> dict[str, tuple[str, tuple]]:
        """Each parameter's name -> (its whole tensor's name in the wrapped linear, this rank's index)."""
        return {"inner.weight": ("weight", (slice(None), slice(self.lo, self.hi))), "bias": ("bias", ())}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (columns {self.lo}:{self.hi} here), out_features={self.out_features}"


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters on this rank (each tensor once)."""
    seen, n = set(), 0
    for t in module.parameters():
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n
