"""A batched step's tokens split over the ranks for the model's per-token layers.

Every rank used to run every token of a batched step through the linear layers, norms and
MLPs: the same work ``p`` times. A step of many tokens (joining requests' prompts, wide
drafts) instead cuts its flat sequence into ``p`` contiguous shares; each rank runs its share
through the model, and each layer's attention first gathers every token's q, k and v (the
cascade attention reads every token's query against this rank's keys, and stores the new
tokens' K/V on their owners, as before), then returns this rank's share of the output. The
hidden states the logits need are gathered at the end. Per-token layers compute each token
alone, so a token's hidden state is the same whichever rank computes it (bitwise with
:mod:`treeattn.hf.linear`'s packed layers, whose rows do not depend on their neighbours).

Gathers go in row pieces of at most :data:`~treeattn.comm.shm_small.SMALL` bytes per rank, so
that on one host each piece goes through ``/dev/shm``.
"""

from __future__ import annotations

from bisect import bisect_right

import torch
from torch import Tensor

from ..comm.collectives import all_gather
from ..comm.shm_small import SMALL


def cuts(n: int, p: int) -> list[int]:
    """``p + 1`` cut points: rank ``r`` runs flat tokens ``[cuts[r], cuts[r + 1])``."""
    return [n * r // p for r in range(p + 1)]


def _gather(buf: Tensor, group) -> Tensor:
    """``buf [m, W]`` of every rank as ``[p, m, W]``, in row pieces that fit shared memory."""
    step = max(1, SMALL // max(1, buf.shape[1] * buf.element_size()))
    if buf.shape[0] <= step:
        return all_gather(buf.contiguous(), group)
    return torch.cat([all_gather(buf[a : a + step].contiguous(), group) for a in range(0, buf.shape[0], step)], 1)


def gather_qkv(q: Tensor, k: Tensor, v: Tensor, cut: list[int], group) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's share ``q [1, Hq, n, D]``, ``k, v [1, Hkv, n, D(v)]`` -> every token's, ``[1, H, N, D]``
    (collective: one gather)."""
    p, n = len(cut) - 1, q.shape[2]
    m = max(cut[r + 1] - cut[r] for r in range(p))
    parts = [x[0].transpose(0, 1).reshape(n, -1) for x in (q, k, v)]
    widths = [x.shape[1] for x in parts]
    buf = q.new_zeros(m, sum(widths))
    buf[:n] = torch.cat(parts, 1)
    g = _gather(buf, group)
    full = torch.cat([g[r, : cut[r + 1] - cut[r]] for r in range(p)])  # [N, W]
    out, at = [], 0
    for x, w in zip((q, k, v), widths, strict=True):
        out.append(full[:, at : at + w].reshape(-1, x.shape[1], x.shape[3]).transpose(0, 1)[None])
        at += w
    return out[0], out[1], out[2]


def gather_rows(h: Tensor, want: list[int], cut: list[int], rank: int, group) -> Tensor:
    """Rows ``want`` (flat token indices, any order) of the hidden states ``[N, H]`` whose share
    ``h [n, H]`` this rank holds: ``[len(want), H]`` on every rank (collective)."""
    p = len(cut) - 1
    owner = [bisect_right(cut, x) - 1 for x in want]
    at, idx = [0] * p, []
    for r in owner:  # each wanted row's place in its owner's buffer
        idx.append(at[r])
        at[r] += 1
    mine = [x - cut[rank] for x, r in zip(want, owner, strict=True) if r == rank]
    buf = h.new_zeros(max(at), h.shape[-1])
    if mine:
        buf[: len(mine)] = h[torch.tensor(mine, device=h.device)]
    g = _gather(buf, group)
    return g[torch.tensor(owner, device=h.device), torch.tensor(idx, device=h.device)]
