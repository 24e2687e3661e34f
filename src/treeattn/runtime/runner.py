"""The one object that runs a model's forwards over the sharded K/V: :class:`ModelRunner`.

Every kind of step (:mod:`treeattn.runtime.steps`) is one forward of the transformers model with
the ``"treeattn"`` attention implementation reading the step: a chunk of prompt tokens as
chunked, sharded prefill (Tree or Ring per chunk), one new token per sequence as a decode step
(or its static, graph-captured form, :mod:`treeattn.runtime._graph`), a block of tentative tokens (a
chain or a token tree) kept aside, and the batched rows of the server over shared prefixes
(:class:`~treeattn.runtime._cascade.RowsStep`, built by :class:`~treeattn.runtime.batch.BatchRunner`). The
decoder call, the attention switch, the tensor-parallel token split and the LM head are here only;
what is committed and kept is the caller's (:class:`~treeattn.runtime.Session`, the batch)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from ..cache import ShardedKVCache
from ..comm.collectives import all_reduce, world
from ..hf.alibi import alibi_layers
from ..hf.attention import AttnSwitch, TreeAttnCache
from ..hf.model import cache_kw, lm_logits
from ..parallel.split import gather_rows
from ..parallel.tensor import sharded_tokens
from . import _graph
from .inputs import prefill_windows
from .steps import Decode, Prefill, Step, TokenTree

if TYPE_CHECKING:
    from ._cascade import RowsStep
from ..hf.tensor_parallel import kv_heads_here, model_mesh, sequence_group

_FLOPS_PER_BYTE = 30  # attention flops one rank does while gloo moves a byte (2-core host, order of magnitude)


class ModelRunner:
    """A model, its decoder and its parallel settings; :meth:`bind` gives it a
    :class:`~treeattn.cache.ShardedKVCache` (a Session's). ``group``: every rank (the LM head's
    split); ``seq``: the ranks the cache is sharded over (``group``, or a mesh's KVP group);
    ``counters["forwards"]`` counts the forwards run."""

    def __init__(self, model: torch.nn.Module, group=None, seq=None, *, attention: str = "tree", strategy: str = "auto",
                 prefill: str = "auto", prefill_chunk: int | None = 1024, counters: dict | None = None,
                 cuda_graph: bool = False) -> None:  # fmt: skip
        seq = sequence_group(model, group) if seq is None else seq
        self.model, self.group, self.seq = model, group, seq
        self.rank, self.p = world(seq)
        mesh = model_mesh(model)  # a mesh's KVP ranks take their heads of the Tree reduction (Helix)
        scatter = mesh is not None and mesh.kvp > 1 and mesh.tpa > 1 and attention == "tree"
        self.heads = mesh.head_cuts(model.config.num_attention_heads) if scatter else None
        self.decoder = model.get_decoder()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.attention, self.strategy, self.prefill_mode, self.prefill_chunk = attention, strategy, prefill, prefill_chunk
        self.cache: ShardedKVCache | None = None
        self._tc: TreeAttnCache | None = None
        self._switch = AttnSwitch(model)
        self.counters = dict(forwards=0) if counters is None else counters  # "forwards": the model's forward calls
        cfg = model.config
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        ropes = list(rope.values()) if rope and all(isinstance(x, dict) for x in rope.values()) else [rope]
        # a batched step's tokens split over the ranks needs every layer but attention token by token: rotary
        # frequencies chosen by the longest position in the input (dynamic NTK, LongRoPE) would differ
        self.split_ok = not any(r.get("rope_type", r.get("type")) in ("dynamic", "longrope") for r in ropes)
        graphs = self.device.type == "cuda"  # elsewhere the same static step, uncaptured
        alone = world(group)[1] == 1  # (a mesh of one KVP rank per slice still runs collectives)
        static = cuda_graph and alone and not alibi_layers(model)  # (ALiBi: no static step)
        self.static = _graph.StaticDecode(self, graphs) if static else None

    def bind(self, cache: ShardedKVCache) -> None:
        self.cache, self._tc = cache, TreeAttnCache(cache)
        if self.static is not None:
            self.static = _graph.StaticDecode(self, self.static.graphs)  # the old cache's graphs go

    @contextlib.contextmanager
    def treeattn(self):
        """The model's attention is treeattn's for the calls inside."""
        try:
            with self._switch():
                yield
        finally:
            if self._tc is not None:
                self._tc.ctx = None

    def forward(self, step: Step, ids: Tensor, pos: Tensor, view: TreeAttnCache | None = None) -> Tensor:
        """One forward of ``ids`` at positions ``pos`` (both ``[B, T]``) as ``step``, its K/V through
        ``view`` (default: the bound cache's); the last hidden states. Inside :meth:`treeattn`."""
        view = self._tc if view is None else view
        view.ctx = step
        return self.decoder(input_ids=ids.to(self.device), position_ids=pos.to(self.device),
                            **cache_kw(self.decoder, view), use_cache=True, treeattn_ctx=step).last_hidden_state  # fmt: skip

    def logits(self, hidden: Tensor) -> Tensor:
        """The LM head's float32 logits of ``hidden [..., hidden]`` (a split head gathered)."""
        return lm_logits(self.model, hidden, self.group, split=True)

    def _run(self, step: Step, ids: Tensor, pos: Tensor) -> Tensor:
        self.counters["forwards"] += 1
        return self.forward(step, ids, pos)

    def method(self, q_pos: list[Tensor], old: list[Tensor], new: list[Tensor], b: list[int]) -> str:
        """``"tree"`` or ``"ring"`` for one prefill chunk: the one with less traffic left exposed.
        Ring receives every other rank's keys and values up to this chunk, overlapped with the
        attention of the block held (hidden at ``_FLOPS_PER_BYTE``): big chunks hide it all, a few
        queries over a long cache do not. Tree gathers the chunk's queries and sends each rank its
        queries' states (an all-gather and an all-to-all of ``n_max`` rows), with nothing to hide behind."""
        if self.p == 1:
            return "tree"
        cfg = self.model.config
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        hkv = kv_heads_here(self.model)  # this rank's (a mesh's head slice)
        hq = cfg.num_attention_heads * hkv // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        e = self.dtype.itemsize
        keys = [len(o) + j for o, j in zip(old, b, strict=True)]
        ring = max((sum(keys) - m) * hkv * 2 * d * e - 4 * len(q) * m * hq * d / _FLOPS_PER_BYTE
                   for q, m in zip(q_pos, keys, strict=True))  # fmt: skip
        tree = (self.p - 1) * max(len(x) for x in q_pos) * hq * (d * e + (d + 1) * max(e, 4))  # states: float32+
        return "ring" if ring <= tree else "tree"

    def prefill(self, ids: Tensor, lens: Tensor, hidden_store=None) -> Tensor:
        """A block ``ids [B, T]`` (``lens [B]`` of them real) on a uniform cache: every rank runs
        the tokens it will hold, window by window in position order, and stores their K/V;
        returns the float32 logits of each sequence's last token."""
        c, rank = self.cache, self.rank
        B, T = ids.shape
        L0 = int(c.seq_lens[0])
        old = [c.rank_positions(r) for r in range(self.p)]
        new, base = c.begin_extend(lens, T)
        last = None
        for lo, hi in prefill_windows(new, L0, L0 + T, self.prefill_chunk):
            a = [int(torch.searchsorted(x, lo)) for x in new]
            b = [int(torch.searchsorted(x, hi)) for x in new]
            q_pos = [x[i:j] for x, i, j in zip(new, a, b, strict=True)]
            n = len(q_pos[rank])
            how = self.prefill_mode if self.prefill_mode != "auto" else self.method(q_pos, old, new, b)
            ctx = Prefill(c, how, self.strategy, self.seq, [torch.cat([o, x[:j]]) for o, x, j in zip(old, new, b, strict=True)],
                          q_pos, n, base + a[rank])  # fmt: skip
            pos = q_pos[rank] if n else torch.full((1,), L0, dtype=torch.int64)  # a placeholder keeps the model happy
            with sharded_tokens([max(1, len(x)) for x in q_pos], self.seq):  # each rank its own tokens (tensor parallel layers)
                hidden = self._run(ctx, ids[:, (pos - L0).to(ids.device)], pos[None, :].expand(B, -1))
            if hidden_store is not None and n:
                hidden_store.store_block(base + a[rank], hidden[:, :n])
            if last is None:
                acc = torch.promote_types(hidden.dtype, torch.float32)
                last = torch.zeros(B, hidden.shape[-1], dtype=acc, device=self.device)
            if n:  # who holds each sequence's last token in this window
                rows, cols = torch.nonzero(q_pos[rank][None, :] == (L0 + lens - 1)[:, None], as_tuple=True)
                last[rows.to(self.device)] = hidden[rows.to(self.device), cols.to(self.device)].to(last.dtype)
        last = all_reduce(last, dist.ReduceOp.SUM, self.seq)
        return self.logits(last.to(self.dtype))

    def decode(self, tok: Tensor, hidden_store=None) -> Tensor:
        """One token per sequence ``tok [B]``: placed, stored, then attention over the cache; its logits."""
        if self.static is not None and _graph.usable(self, hidden_store):
            return self.static(tok)
        c = self.cache
        pos = c.seq_lens.clone()
        c.begin_decode_step()
        ctx = Decode(c, self.attention, self.strategy, self.seq, c.lens_on_device(), pos, heads=self.heads)
        hidden = self._run(ctx, tok[:, None], pos[:, None])[:, -1]
        if hidden_store is not None:
            rows, slots = c.step_targets
            hidden_store.store(rows, slots, hidden[rows])
        return self.logits(hidden)

    def step(self, tokens: Tensor, tree: tuple[list[int], Tensor, Tensor], committed: Tensor) -> tuple:
        """Tentative ``tokens [B, T]`` in the token tree ``tree`` (:func:`~treeattn.runtime.inputs.tree_of`)
        after ``committed [B]`` tokens, nothing stored: ``(logits [B, T, V], hidden, K/V per layer)``."""
        _, depth, sees = tree
        c = self.cache
        q_pos = committed[:, None] + depth[None, :]
        ctx = TokenTree(c, self.attention, self.strategy, self.seq, c.lens_on_device(), q_pos, heads=self.heads,
                        tree=sees, depth=depth)  # fmt: skip
        hidden = self._run(ctx, tokens, q_pos)
        return self.logits(hidden), hidden, ctx.stash

    def rows(self, step: RowsStep, ids: list[int], pos: Tensor, want: list[int]) -> Tensor:
        """A batched step of the server (:class:`~treeattn.runtime.batch.BatchRunner`): the flat tokens
        ``ids`` at positions ``pos [N]`` as one sequence of ``step``'s lines, each rank running its
        ``step.cut`` of them (None: all), the per-token layers gathering the others' (tensor
        parallel); float32 logits at the flat token indices ``want``."""
        cut = step.cut
        a, b = (cut[self.rank], cut[self.rank + 1]) if cut else (0, len(ids))
        view = TreeAttnCache(_Lens(step.rows.L, pos.min().reshape(1)))
        split = sharded_tokens([cut[r + 1] - cut[r] for r in range(self.p)], self.seq) if cut else contextlib.nullcontext()
        self.counters["forwards"] += 1
        with self.treeattn(), split:
            hidden = self.forward(step, torch.tensor([ids[a:b]]), pos[None, a:b], view)[0]
        h = gather_rows(hidden, want, cut, self.rank, self.seq) if cut else hidden[torch.tensor(want).to(self.device)]
        return self.logits(h)


class _Lens:
    """What :class:`TreeAttnCache` reads of its store: layers and global lengths."""

    def __init__(self, num_layers: int, seq_lens: Tensor) -> None:  # [1]: the first new position
        self.num_layers, self.seq_lens = num_layers, seq_lens
