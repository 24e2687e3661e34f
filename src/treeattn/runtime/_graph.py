"""A Session's decode step at p = 1 on CUDA as a replayed CUDA graph.

An eager decode step launches about 900 kernels from Python; on a GPU host that is tens of
milliseconds for a few milliseconds of GPU work. A graph replays them with one launch, but it
fixes every address and shape, so the step reads what changes from static device buffers:
the token, its position (at p = 1 also its slot; the cache's valid length is one more) and
its slot. The attention reads a fixed span of the cache (the length rounded up by an
eighth, :func:`span_of`) whose rows the kernels bound by the length on the device, and the
new K/V go to the slot read from the device. One graph per span: a step captures anew
only when the cache outgrows the span or is reallocated. The host metadata of the step is
the eager step's (:meth:`ShardedKVCache.begin_decode_step`).

A model whose forward reads a device value on the host (a dynamic RoPE scaling that looks at
the largest position, say) cannot be captured: the step raises and says so.

``graphs=False`` runs the same static step eagerly (the tests check it on CPU and on the
meta device, where any device read raises: a read would break the capture).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from ..hf.model import lm_logits
from .steps import Static

QUANTUM = 256  # spans are multiples of this (or of an eighth of the length, when larger)
KEEP = 8  # graphs kept (the most recent spans)


def span_of(n: int, limit: int | None = None) -> int:
    """Slots read by a static step over ``n`` valid ones: ``n`` rounded up to a multiple of
    ``max(QUANTUM, 2**floor(log2 n) / 8)`` (at most ~12 % more keys visited, never read), and
    no further than ``limit`` slots (a cache that may hold no more)."""
    q = max(QUANTUM, (1 << (max(n, 1).bit_length() - 1)) // 8)
    s = -(-n // q) * q
    return max(n, min(s, limit)) if limit else s


def usable(fw, hidden_store) -> bool:
    """Whether this decode step may run as a static step: one rank, a uniform cache (one
    length and slot for every sequence), no hidden states kept."""
    c = fw.cache
    return fw.p == 1 and hidden_store is None and c.uniform() and c.B > 0


class StaticDecode:
    """The decode step of one :class:`~treeattn.runtime.runner.ModelRunner` with static buffers;
    captured per span on CUDA when ``graphs``."""

    def __init__(self, fw, graphs: bool) -> None:
        self.fw, self.graphs = fw, graphs
        self.cache = None
        self.version = -1
        self.ids = self.meta = None
        self.kept: OrderedDict[int, tuple] = OrderedDict()  # span -> (graph, logits)
        self.captures = self.calls = 0

    def _reset(self) -> None:
        c = self.fw.cache
        self.cache, self.version = c, c.version
        self.kept.clear()
        self.ids = torch.zeros(c.B, 1, dtype=torch.int64, device=self.fw.device)
        self.meta = torch.zeros(2, dtype=torch.int64, device=self.fw.device)  # position (= slot), valid length

    def _forward(self, span: int) -> Tensor:
        fw, c = self.fw, self.fw.cache
        step = Static(c, fw.attention, fw.strategy, fw.seq, self.meta[1:].expand(c.B), None, span=span,
                      slot=self.meta[:1], pos=self.meta[0].expand(c.B))  # fmt: skip
        hidden = fw.forward(step, self.ids, self.meta[:1].expand(c.B, 1))[:, -1]
        return lm_logits(fw.model, hidden)

    def _capture(self, span: int) -> tuple:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: Triton compiles, the allocator settles
            self._forward(span)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = self._forward(span)
        self.captures += 1
        return g, out

    def __call__(self, tok: Tensor) -> Tensor:
        """Decode ``tok [B]`` (host or device) after the cache's tokens; ``[B, V]`` logits."""
        fw, c = self.fw, self.fw.cache
        pos = int(c.seq_lens[0])  # host metadata; at p = 1 the token's slot
        c.begin_decode_step()
        span = span_of(pos + 1, c.slot_limit)
        c.reserve(span)
        if c is not self.cache or c.version != self.version:  # another cache, or reallocated: the graphs read old buffers
            self._reset()
        self.ids.copy_(tok.reshape(c.B, 1), non_blocking=True)
        self.meta.copy_(torch.tensor([pos, pos + 1]), non_blocking=True)
        fw.counters["forwards"] += 1
        self.calls += 1
        if not self.graphs:
            return self._forward(span)
        if span not in self.kept:
            try:
                self.kept[span] = self._capture(span)
            except RuntimeError as e:  # e.g. a model whose forward reads the device (dynamic RoPE scaling)
                raise RuntimeError(f"cuda_graph: the decode step could not be captured ({e}); run without cuda_graph") from e
            if len(self.kept) > KEEP:
                self.kept.popitem(last=False)
        g, out = self.kept[span]
        self.kept.move_to_end(span)
        g.replay()
        return out.clone()
