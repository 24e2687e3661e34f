"""Contrastive search (Su et al. 2022) over a :class:`treeattn.runtime.Session`: the ``top_k``
likeliest next tokens run in one :meth:`Session.step` as a depth-1 token tree (each sees the
history and only itself), each is scored ``(1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j)``
over the last hidden states ``h_j`` of every earlier token, and the best is kept.

The earlier tokens' hidden states stay sharded like their K/V: each rank keeps those of the
tokens it holds, at their cache slots, and the maximum similarity is one all-reduce (MAX) of
``[B, top_k]`` floats."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import all_reduce


class HiddenStore:
    """This rank's last hidden states (after the final norm) of the tokens it holds, at their
    slots of ``session.cache``; filled by the session's calls once attached as
    ``session.hidden``."""

    def __init__(self, session) -> None:
        self.s, self.h = session, None

    def _room(self, like: Tensor) -> None:
        c = self.s.cache
        if self.h is None or self.h.shape[1] < c.cap:
            h = torch.zeros(c.B, c.cap, like.shape[-1], dtype=torch.promote_types(like.dtype, torch.float32),
                            device=like.device)  # fmt: skip
            if self.h is not None:
                h[:, : self.h.shape[1]] = self.h
            self.h = h

    def store(self, b: Tensor, slots: Tensor, h: Tensor) -> None:
        """Hidden states ``h [N, H]`` of sequences ``b [N]`` at local ``slots [N]``."""
        if len(b):
            self._room(h)
            self.h[b, slots] = h.to(self.h.dtype)

    def store_block(self, start: int, h: Tensor) -> None:
        """Hidden states ``h [B, n, H]`` at slots ``start .. start + n - 1`` of every sequence."""
        self._room(h)
        self.h[:, start : start + h.shape[1]] = h.to(self.h.dtype)

    def max_similarity(self, q: Tensor) -> Tensor:
        """``[B, k]``: for each of ``q [B, k, H]`` the largest cosine similarity with the hidden
        state of any committed token of its sequence, on every rank (-inf: no token)."""
        c = self.s.cache
        S = c.used
        q = q.to(torch.promote_types(q.dtype, torch.float32))
        best = torch.full(q.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
        if S and self.h is not None:
            hn = torch.nn.functional.normalize(self.h[:, :S].to(q.dtype), dim=-1)
            sim = torch.nn.functional.normalize(q, dim=-1) @ hn.transpose(1, 2)  # [B, k, S]
            valid = (torch.arange(S)[None, :] < c.kv_lens[:, None]).to(q.device)
            best = sim.masked_fill(~valid[:, None, :], float("-inf")).amax(-1)
        return all_reduce(best, dist.ReduceOp.MAX, self.s.group)


def contrastive_step(session, logits: Tensor, alpha: float, k: int) -> tuple[int, Tensor]:
    """Choose and commit the next token of a one-sequence session from ``logits [1, V]`` (the
    distribution after the history); returns it and the logits ``[1, V]`` that follow it."""
    p = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)[0]
    top_p, top_i = p.topk(k)
    lg, hid = session.step(top_i[None].to(session.device), [-1] * k, return_hidden=True, check=False)
    penalty = session.hidden.max_similarity(hid)[0].to(top_p.device)
    penalty = torch.where(torch.isinf(penalty), 0.0, penalty)  # nothing earlier: no penalty
    j = int(((1 - alpha) * top_p - alpha * penalty.to(top_p.dtype)).argmax())  # the first best, as the reference
    session.keep([j], check=False)
    return int(top_i[j]), lg[:, j]
