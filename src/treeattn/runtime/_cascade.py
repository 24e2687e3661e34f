"""One layer's attention of a batched step over shared prefixes (cascade attention).

A step runs the new tokens of several *lines* as one flat sequence of ``N`` tokens (one
forward: the weights are read once). Line ``i`` is the next ``T_i`` tokens of one running
row: one token for a decoding request, a token and its draft to verify, a chunk of a joining
request's prompt. Each token reads the first ``keep`` tokens of its row's shared prefix (a
:class:`~treeattn.cache.ShardedKVCache` of one sequence), the row's own earlier tokens (a
:class:`~treeattn.cache.RowCache`), and the earlier tokens of its line (causal). The tokens
that read the same prefix attend to it together, whatever their ``keep``. Tree: in one pass
over this rank's slots of it, each token bounded by its own keep (and window), their queries
folded into one block, so each rank reads its shard of the prefix once per step whatever the
number of lines, and a token's bits do not depend on how deep the others read (Ring: the
prefix is cut at the distinct keeps into segments, one ring pass each). Each rank's prefix
and row states of a token go into one reduction with every other rank's, and are merged there
in one pass (the merge is associative: seed paper, §4). A short line's tokens are stored on
their owners first and attended there as the row's keys (each query bounded by its
position); a long chunk's own tokens, identical on every rank, are merged after the
reduction. Ring: each part's K/V goes round the ring, a line's own tokens merged after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..cache import RowCache, ShardedKVCache
from ..comm.strategies import reduce_states
from ..ops import DecodeCall, attention_state, prefill_states, prepare_decode
from ..ops.alibi import Alibi
from ..ops.state import empty_state, merge_into
from ..parallel import ring_decode
from ..parallel.split import gather_qkv
from ..parallel.tree import new_token_state
from .steps import Step

# The prefix pass of the tokens of prompt chunks (``batch.WIDE_LINE`` tokens or more, logits at
# the last only) runs through the prefill kernel on CPUs with AVX-512, each (query head, token)
# pair of a KV head one of its rows, 32 a block; every other token's (decode rows, drafts, short
# chunks) through the decode path. The choice follows the token's line alone,
# and neither path's result for a token depends on the others in its call, so a token gets the
# same bits whatever shares its step: batched answers, and answers with speculation, are those
# alone. SmolLM2's shapes (9/3 heads, D = 64), 3,861 keys, one thread, K/V out of cache, 30
# layers, ms at 18 / 48 / 96 / 375 rows: decode_cpu 19.3 / 41.7 / 84.2 / 302.6, the kernel
# 20.9 / 35.0 / 49.0 / 167.4 (a 32-row block costs the same however full). A non-finite result
# (a non-finite key or value read, or every key of a row scoring -inf) takes the decode path,
# which follows the ops' NaN contract.


@dataclass
class PrefixGroup:
    """The tokens that read ``cache``: ``tokens`` (flat indices, host int64) in increasing
    order of their keeps, ``keeps`` (increasing, distinct) and ``first[j]``, the index into
    ``tokens`` of the first token that reads ``keeps[j]`` tokens. Segment ``j`` of the prefix,
    this rank's slots ``[ends[j-1], ends[j])`` (``ends[-1]`` = 0), is read by ``tokens[first[j]:]``."""

    cache: ShardedKVCache
    keeps: list[int]
    tokens: Tensor
    first: list[int]
    ends: list[int] = field(default_factory=list)  # this rank's slots below each keep
    end: Tensor | None = None  # [1, len(tokens)] (device): each token's ends[j] (None: one keep)
    whole: list = field(default_factory=list)  # all tokens [(sel, pos or None, wide)] by prefix path (Tree)
    sels: list = field(default_factory=list)  # segment j's tokens: a slice where contiguous, else device indices

    @property
    def local(self) -> int:
        """This rank's slots the group reads."""
        return self.ends[-1] if self.ends else 0

    def segments(self):
        """``(j, a, b)``: segment ``j`` is this rank's slots ``[a, b)``."""
        a = 0
        for j, b in enumerate(self.ends):
            yield j, a, b
            a = b


@dataclass
class Shape:
    """The lines of one length ``T``: their rows and ``[n, T]`` flat token indices."""

    T: int
    rows: list[int]
    idx: Tensor  # [n, T] host
    placed: tuple | None = None  # (rows, slots, flat indices) of this rank's new tokens, stored first
    dev: dict = field(default_factory=dict)


@dataclass
class RowsStep(Step):
    """A batched forward of many rows' lines over shared prefixes (see the module's text)."""

    rows: RowCache
    shapes: list[Shape]
    q_pos: Tensor  # [N] global position of every token (host)
    groups: list[PrefixGroup]
    attention: str = "tree"
    strategy: str = "auto"
    group: dist.ProcessGroup | None = None
    stash: dict = field(default_factory=dict)  # layer -> (k, v) [1, Hkv, N, D] of the new tokens
    cut: list[int] | None = None  # the tokens split over the ranks (parallel.split): rank r ran [cut[r], cut[r + 1])
    wide: Tensor | None = None  # [N] bool (host): the tokens whose prefix pass may take the prefill kernel
    _win: dict = field(default_factory=dict)
    _memo: dict = field(default_factory=dict)  # per call site: what every layer of the step shares

    def __post_init__(self) -> None:
        dev = self.rows.device
        for s in self.shapes:
            s.dev.update(rows=_sel(torch.tensor(s.rows, dtype=torch.int64), dev), idx=s.idx.to(dev),
                         lens=self.rows.kv_len[s.rows].to(dev), sel=_sel(s.idx.reshape(-1), dev))  # fmt: skip
            if s.placed is not None and s.T > 1:  # causal: query j sees its row's slots up to its own position
                s.dev["end"] = self.rows.slots_before(s.rows, self.q_pos[s.idx] + 1).to(dev)
        wide = torch.zeros(len(self.q_pos), dtype=torch.bool) if self.wide is None else self.wide
        for g in self.groups:
            g.ends = g.cache.slots_before(torch.tensor([g.keeps]))[0].tolist()
            g.sels = [_sel(g.tokens[f:], dev) for f in g.first]
            if len(g.keeps) > 1:  # one keep: every token reads all of g.local
                n = torch.diff(torch.tensor(g.first + [len(g.tokens)]))
                g.end = torch.tensor(g.ends).repeat_interleave(n).reshape(1, -1).to(dev)
            g.whole = _parts(g.tokens, wide[g.tokens], g.sels[0], dev) if g.first else []

    def starts(self, window: int | None) -> tuple[list, list]:
        """Under a sliding window: each group's ``kv_start`` per segment (``[1, m_j]``, relative to
        the segment; the last entry: ``[1, m]`` over all its slots) and each shape's ``[n, T]``."""
        if window is None:
            return [None] * len(self.groups), [None] * len(self.shapes)
        if window not in self._win:
            dev, lo = self.rows.device, self.q_pos - window + 1
            gs = []
            for g in self.groups:  # per segment [1, m_j]: the window's first slot within the segment
                st = g.cache.slots_before(lo[g.tokens].reshape(1, -1))
                gs.append([(st[:, g.first[j] :] - a).clamp(0, b - a).to(dev) for j, a, b in g.segments()]
                          + [st.clamp(0, g.local).to(dev)])  # fmt: skip
            ss = [self.rows.slots_before(s.rows, lo[s.idx]).to(dev) for s in self.shapes]
            self._win[window] = (gs, ss)
        return self._win[window]

    def store(self, layer: int, k: Tensor, v: Tensor) -> None:  # kept aside: placed before, or stored after
        self.stash[layer] = (k, v)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale, window: int | None, softcap,
               alibi: Tensor | None = None) -> Tensor:  # fmt: skip
        """``q [1, Hq, N, D]``, the new tokens' ``k, v [1, Hkv, N, D]``; returns ``[1, Hq, N, Dv]``
        (with ``cut``: this rank's share of the tokens in, and out). ``alibi``: the layer's slopes
        ``[Hq]``, the bias from every key's global position (rows', prefixes', the line's own)."""
        if self.cut is not None:
            q, k, v = gather_qkv(q, k, v, self.cut, self.group)
            self.stash[layer] = (k, v)
            a, b = self.cut[self.rows.rank], self.cut[self.rows.rank + 1]
            return self._attend(layer, q, k, v, scale, window, softcap, alibi)[:, :, a:b]
        return self._attend(layer, q, k, v, scale, window, softcap, alibi)

    def _pos(self, key, make) -> Tensor:
        """A step's positions on the device, made once (the layers share them)."""
        if key not in self._memo:
            self._memo[key] = make().to(self.rows.device)
        return self._memo[key]

    def _row_bias(self, slopes: Tensor | None, i: int, s: Shape, u: int) -> Alibi | None:
        """ALiBi of shape ``i``'s lines ``[n, T]`` over their rows' ``u`` local slots."""
        if slopes is None:
            return None
        qp = self._pos(("qpos", i), lambda: self.q_pos[s.idx])
        return Alibi(slopes, qp, self._pos(("kpos", i, u), lambda: self.rows.positions[s.rows, :u]))

    def _prefix_bias(self, slopes: Tensor | None, gi: int, g: PrefixGroup, t, a: int, b: int) -> Alibi | None:
        """ALiBi of the tokens ``t`` over prefix slots ``[a, b)`` of group ``gi``."""
        if slopes is None:
            return None
        qp = self._pos("qpos", lambda: self.q_pos)[t].reshape(1, -1)
        return Alibi(slopes, qp, self._pos(("gpos", gi), lambda: g.cache.positions[:, : g.local])[:, a:b])

    def _attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale, window: int | None, softcap,
                slopes: Tensor | None = None) -> Tensor:  # fmt: skip
        g_starts, s_starts = self.starts(window)
        N, Dv = q.shape[2], v.shape[3]
        ring = self.attention == "ring"
        # Tree: each token's state on this rank over its row's own keys ([0]) and over its prefix
        # ([1]), both merged with every rank's in the step's one reduction; Ring: one state
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if ring:
            so, sl = (x.to(acc) for x in empty_state((1, 1, q.shape[1], N, Dv), q.device))
        else:  # one buffer for the step's layers: each writes the same places (the rest stays empty)
            key = ("states", q.shape[1], Dv, acc)
            if key not in self._memo:
                self._memo[key] = tuple(x.to(acc) for x in empty_state((2, 1, q.shape[1], N, Dv), q.device))
            so, sl = self._memo[key]
        out, lse = so[0], sl[0]
        kw = dict(group=self.group, scale=scale, softcap=softcap, return_lse=True, check=False)
        for i, (s, st) in enumerate(zip(self.shapes, s_starts, strict=True)):
            qs, sel = _lines(q, s), s.dev["sel"]
            if s.placed is not None:  # the lines' tokens: stored on their owners first, then attended there
                rid, slots, flat = s.placed
                self.rows.store(layer, rid, slots, k[0, :, flat].transpose(0, 1), v[0, :, flat].transpose(0, 1))
            ks, vs = self.rows.local(layer, s.dev["rows"])
            new = {} if s.placed is not None else dict(new_k=_lines(k, s), new_v=_lines(v, s))
            bias = self._row_bias(slopes, i, s, ks.shape[2])
            if ring:  # the row's keys round the ring, the line's own earlier tokens merged after
                o, l_ = ring_decode(qs, ks, vs, kv_lens=s.dev["lens"], kv_start=st, window=window, alibi=bias, **new,
                                    **kw)  # fmt: skip
                o = o.to(acc)
            elif bias is not None:  # (the torch path: the one that adds the bias)
                o, l_ = attention_state(qs, ks, vs, scale=scale, kv_lens=s.dev["lens"], kv_start=st,
                                        kv_end=s.dev.get("end"), softcap=softcap, keep_fp32=True, alibi=bias)  # fmt: skip
            else:
                memo = self._memo.setdefault(("row", i, window, softcap, qs.shape, ks.shape, qs.dtype, ks.dtype), {})
                o, l_ = row_state(qs, ks, vs, s.dev["lens"], st, scale, softcap, s.dev.get("end"), memo)
            out[0, :, sel], lse[0, :, sel] = _flat(o), _flat(l_)
        for gi, (g, st) in enumerate(zip(self.groups, g_starts, strict=True)):
            if not ring:  # one pass over this rank's slots of the prefix, each token to its own keep
                for j, (t, pos, wide) in enumerate(g.whole if g.local else ()):
                    sp, en = (
                        x if x is None or pos is None else x[:, pos] for x in (None if st is None else st[-1], g.end)
                    )
                    kp = g.cache.k[layer]
                    memo = self._memo.setdefault(("prefix", gi, j, window, softcap, q.shape, q.dtype, kp.shape[1],
                                                  kp.dtype), {})  # fmt: skip
                    bias = self._prefix_bias(slopes, gi, g, t, 0, g.local)
                    if bias is not None:
                        kp, vp = _prefix(g, layer, 0, g.local)
                        o, l_ = attention_state(q[:, :, t], kp, vp, scale=scale, kv_start=sp, kv_end=en,
                                                softcap=softcap, keep_fp32=True, alibi=bias)  # fmt: skip
                    else:
                        o, l_ = prefix_state(q[:, :, t], g, layer, sp, scale, softcap, 0, g.local, wide=wide, end=en,
                                             memo=memo)  # fmt: skip
                    so[1][:, :, t], sl[1][:, :, t] = o, l_  # a token reads one prefix: its state, not a merge
                continue
            for j, a, b in g.segments():  # every rank the same segments: the same ring calls
                t, sj = g.sels[j], None if st is None else st[j]
                kp, vp = _prefix(g, layer, a, b)
                lens = torch.full((1,), b - a, device=q.device)
                o, l_ = ring_decode(q[:, :, t], kp, vp, kv_lens=lens, kv_start=sj, alibi=self._prefix_bias(slopes, gi, g, t, a, b),
                                    **kw)  # fmt: skip
                _merge_at(out, lse, t, o.to(acc), l_)
        if ring:
            return out.to(q.dtype)
        out, lse = reduce_states(so, sl, group=self.group, strategy=self.strategy, stacked=True)
        for s in self.shapes:  # a chunk's own tokens: the same on every rank, merged once
            if s.placed is None:
                bias = None
                if slopes is not None:
                    qp = self._pos(("qpos", ("own", s.T)), lambda s=s: self.q_pos[s.idx])
                    bias = Alibi(slopes, qp, qp)
                o, l_ = new_token_state(_lines(q, s), _lines(k, s), _lines(v, s), None, scale, softcap=softcap,
                                        window=window, alibi=bias)  # fmt: skip
                _merge_at(out, lse, s.dev["sel"], _flat(o)[None], _flat(l_)[None])
        return out.to(q.dtype)


def row_state(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, start, scale, softcap,
              end: Tensor | None = None, memo: dict | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """This rank's state of lines ``q [n, Hq, T, D]`` over their rows' own tokens on this rank
    (``end [n, T]``: query j's slots end there). ``memo``: see :func:`_prepared`."""
    call = _prepared(memo, q, k, v, kv_lens=lens, kv_start=start, kv_end=end, softcap=softcap)
    if call is not None:
        return call(q, k, v, scale, keep_fp32=True)
    return attention_state(q, k, v, scale=scale, kv_lens=lens, kv_start=start, kv_end=end, softcap=softcap,
                      keep_fp32=True)  # fmt: skip


def prefix_state(q: Tensor, g: PrefixGroup, layer: int, start, scale, softcap, a: int, b: int,
                 wide: bool = False, end: Tensor | None = None, memo: dict | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """This rank's state of tokens ``q [1, Hq, m, D]`` of group ``g`` over its prefix slots
    ``[a, b)`` (``start``, ``end [1, m]``: each token's first slot and the slot it stops
    before, relative to ``a``; None: 0 and ``b - a``): one pass over them for all the tokens.
    ``wide`` (the tokens of prompt chunks): through the prefill kernel where it applies
    (:mod:`treeattn.ops._prefill_cpu`, float32, AVX-512), else the decode path; a token's
    result depends on its own query, bounds and keys alone either way. ``memo``: see :func:`_prepared`."""
    kp, vp = _prefix(g, layer, a, b)
    if wide and q.device.type == "cpu":
        st, en = (None if x is None else x.reshape(-1) for x in (start, end))
        r = prefill_states(q, kp, vp, st, en, scale, softcap, "auto", min_fill=0.0, min_work=0, check=False)
        if r is not None:
            o, l_ = r
            if st is None and en is None:
                seen = l_
            else:  # -inf: only where no key is seen
                seen = l_.masked_fill((0 if st is None else st) >= (b - a if en is None else en), 0.0)
            if math.isfinite(float(o.sum() + seen.sum())):
                return o, l_
    # the decode path is decode_cpu however many tokens share the call (auto would hand many rows
    # with windows to flash_cpu: other rounding); a row's result there depends on its own bounds only
    be = "decode_cpu" if q.device.type == "cpu" else "auto"
    call = _prepared(memo, q, kp, vp, kv_start=start, kv_end=end, softcap=softcap, backend=be)
    if call is not None:
        return call(q, kp, vp, scale, keep_fp32=True)
    return attention_state(q, kp, vp, scale=scale, kv_start=start, kv_end=end, softcap=softcap, keep_fp32=True,
                      backend=be)  # fmt: skip


def _prepared(memo: dict | None, q: Tensor, k: Tensor, v: Tensor, **kw) -> DecodeCall | None:
    """The decode_cpu call ``attention_state`` makes for these arguments, its rows' bounds worked out
    at a step's first layer and kept in ``memo`` (one call site's) for the others, whose shapes and
    bounds are the same: the same kernel arguments, the same bits, without ~20 µs of checks and
    bounds a call. None where ``attention_state`` runs another kernel (or on other devices)."""
    if memo is None:
        return None
    if "call" not in memo:
        memo["call"] = prepare_decode(q, k, v, **kw) if q.device.type == "cpu" else None
    return memo["call"]


def _parts(tokens: Tensor, wide: Tensor, sel, dev) -> list[tuple]:
    """A segment's tokens (flat indices, host) by prefix path: ``(sel, pos, wide)``, ``pos`` the
    part's places among ``tokens`` (device; None: all of them)."""
    if bool(wide.all()) or not bool(wide.any()):
        return [(sel, None, bool(wide.any()))]
    return [(_sel(tokens[w], dev), w.nonzero()[:, 0].to(dev), f) for w, f in ((~wide, False), (wide, True))]


def _sel(idx: Tensor, device) -> slice | Tensor:
    """Flat token indices (host) as a slice when they are consecutive (views, merges in
    place), else as a device index tensor."""
    a = int(idx[0]) if len(idx) else 0
    if torch.equal(idx, torch.arange(a, a + len(idx))):
        return slice(a, a + len(idx))
    return idx.to(device)


def _merge_at(out: Tensor, lse: Tensor, sel: slice | Tensor, o: Tensor, l_: Tensor) -> None:
    """Merge the state ``(o, l_)`` of the tokens ``sel`` into ``(out, lse) [1, Hq, N(, Dv)]``,
    elementwise: a token's bits do not depend on which tokens share the call."""
    if isinstance(sel, slice):
        merge_into(out[:, :, sel], lse[:, :, sel], o, l_)
    else:
        oa, la = out[:, :, sel], lse[:, :, sel]  # copies
        merge_into(oa, la, o, l_)
        out[:, :, sel], lse[:, :, sel] = oa, la


def _prefix(g: PrefixGroup, layer: int, a: int, b: int) -> tuple[Tensor, Tensor]:
    return g.cache.k[layer][:, :, a:b], g.cache.v[layer][:, :, a:b]


def _lines(x: Tensor, s: Shape) -> Tensor:
    """``[1, H, N, D]`` -> the shape's lines ``[n, H, T, D]``."""
    n, T = s.idx.shape
    return x[0, :, s.dev["sel"]].reshape(x.shape[1], n, T, -1).transpose(0, 1)


def _flat(x: Tensor) -> Tensor:
    """``[n, H, T(, D)]`` -> ``[H, n*T(, D)]`` in the order of the shape's flat indices."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, *x.shape[3:])
