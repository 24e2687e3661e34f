"""Committing the kept tokens of a :class:`~treeattn.runtime.Session` step: each kept token's K/V
(and last hidden state, where the session keeps them) stored at the rank and slot the cache's
placement gives its position; one slice copy a layer where the kept tokens and their slots
are both runs (one sequence, a chain's prefix on this rank), else a gather and a scatter."""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import ShardedKVCache


def store_kept(cache: ShardedKVCache, stash: dict, hidden, hid: Tensor | None, idx: Tensor, device) -> None:
    """Place ``len(idx)`` new tokens after every sequence and store the step's columns ``idx``
    (host int64) of ``stash`` (layer -> ``(k, v) [B, Hkv, T, D]``) and of ``hid [B, T, H]``
    (into ``hidden``, if not None) at this rank's share of them."""
    b, j, slots = cache.place(len(idx))
    cols_h = idx[j]
    cols = cols_h.to(device)
    bd, sd = b.to(device), slots.to(device)
    m = len(j)
    if cache.B == 1 and m > 0 and _run(cols_h) and _run(slots):
        c0, s0 = int(cols_h[0]), int(slots[0])
        for layer, (k, v) in stash.items():
            cache.store_span(layer, s0, k[:, :, c0 : c0 + m], v[:, :, c0 : c0 + m])
    else:
        for layer, (k, v) in stash.items():
            cache.store_slots(layer, bd, sd, k[bd, :, cols], v[bd, :, cols])
    if hidden is not None:
        hidden.store(bd, sd, hid[bd, cols])


def _run(x: Tensor) -> bool:
    """``x`` (host, int) is ``a, a + 1, ..., a + len - 1``."""
    return bool((x[1:] - x[:-1] == 1).all()) if len(x) > 1 else True




def adopt(cache: ShardedKVCache, history, ids: Tensor, kv, device) -> None:
    """Commit ``ids [1, n]`` after a one-sequence cache's tokens, their K/V given, not run:
    ``kv(layer)`` gives ``(k, v) [m, Hkv, D]``, the ``m`` of them this rank holds in position order."""
    b, _, slots = cache.place(ids.shape[1])
    bd, sd = b.to(device), slots.to(device)
    for layer in range(cache.num_layers):
        k, v = kv(layer)
        if k.shape[0] != len(slots):  # the caller laid them out by another placement
            raise RuntimeError(f"adopt: {k.shape[0]} K/V rows for this rank's {len(slots)} slots")
        cache.store_slots(layer, bd, sd, k, v)
    before = history.lens.clone()
    history.commit(ids, before, torch.full_like(before, ids.shape[1]))
