"""A generation session: a transformers model and its KV cache sharded across ranks, kept
between calls. Prompts and answers are appended with :meth:`Session.extend`; tentative
tokens (a chain or a token tree) are run with :meth:`Session.step` and committed with
:meth:`Session.keep`; :meth:`Session.rewind` forgets a suffix."""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .._host import peak_memory_bytes
from ..cache import ShardedKVCache, auto_block
from ..comm.collectives import world
from ..hf.tensor_parallel import kv_heads_here, sequence_group
from . import inputs as S
from ._calls import checked
from ._commit import adopt, store_kept
from ._history import History
from ._settings import agree_settings
from .runner import ModelRunner


class Session:
    """A model whose KV cache is sharded across the ranks of ``group`` and outlives a call:
    a long document is prefilled once, then questions, answers and speculative drafts are
    appended, verified and rewound without running the document again.

    Create it on every rank with the same arguments and make the same calls in the same order
    on every rank (every call is collective). Each call checks its arguments and the ranks
    agree on them (one small int64 all-gather, nothing pickled) before any other collective;
    a bad call raises the same ``ValueError`` on every rank and changes nothing.

    Tokens live on the rank and local slot that ``placement`` gives their global position
    (``"interleaved"``: position ``i`` on rank ``(i // block) % p``; ``"contiguous"``: the
    first prompt split in p contiguous parts, every later token on the rank holding the
    fewest tokens of its sequence), whichever call committed them, so a token kept after a
    :meth:`step` sits exactly where sequential decoding would have put it.

    Args:
        model: a transformers causal LM (Llama, Mistral, Qwen2, Gemma-2/3 families; see the
            README's table) in eval mode, the same weights on every rank. Its attention
            implementation is switched to ``"treeattn"`` during each call only.
        group: the process group of the ranks (default: the world; without torch.distributed
            initialised, one process). The KV cache is sharded along the sequence over it, or,
            for a model whose attention heads :func:`~treeattn.hf.tensor_parallel` split
            (``tpa`` > 1), over this rank's slice of it (:func:`~treeattn.hf.tensor_parallel.sequence_group`).
        placement, block: KV placement (see :class:`treeattn.cache.ShardedKVCache`). None: from the
            first call's ``T`` tokens, up to 256 with 4 blocks per rank (1 for short prompts);
            the prefill then sees the other ranks' keys as whole blocks, not triangles.
        attention: decoding by ``"tree"`` (Tree Attention) or ``"ring"`` (Ring Attention).
        prefill: how :meth:`extend` prefills a block, chunk by chunk: ``"tree"`` (queries
            gathered, states exchanged), ``"ring"`` (K/V passed around, overlapped with the
            attention) or ``"auto"`` (per chunk, the one moving fewer bytes per rank).
        strategy: Tree decoding's reduction (one of ``treeattn.comm.STRATEGIES``).
        prefill_chunk: tokens per rank run through the model at a time by :meth:`extend`
            (bounds the activations); None: a whole extend at once.
        max_length: the most tokens a sequence may hold (default and upper bound: the
            model's ``max_position_embeddings``); the cache grows on demand up to it.
        cuda_graph: on a CUDA model at p = 1, run each one-token :meth:`extend` of a batch
            whose sequences share one length as a replayed CUDA graph (one per span of the
            cache, captured at the first step that needs it; :mod:`treeattn.runtime._graph`):
            the same tokens, without the host time of ~900 kernel launches per token. On
            other devices the same static step runs uncaptured (no gain; the CPU tests run
            it). Ignored at p > 1.

    Raises:
        ValueError: on every rank, when any rank's arguments are invalid or differ, or the
            model cannot be run exactly (:func:`treeattn.hf.unsupported_reason`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        group: dist.ProcessGroup | None = None,
        placement: str = "interleaved",
        attention: str = "tree",
        strategy: str = "auto",
        prefill_chunk: int | None = 1024,
        max_length: int | None = None,
        *,
        block: int | None = None,
        prefill: str = "auto",
        cuda_graph: bool = False,
    ) -> None:
        self.seq = sequence_group(model, group)  # the ranks the cache is sharded over
        self.rank, self.p = world(self.seq)
        self.layout, limit = agree_settings(model, group, max_length=max_length, placement=placement, block=block,
                                            attention=attention, strategy=strategy, prefill=prefill,
                                            prefill_chunk=prefill_chunk, cuda_graph=cuda_graph)  # fmt: skip
        self.model, self.group = model, group
        self.placement, self.block, self.max_length = placement, block, limit
        self.counters = dict(forwards=0, extend_tokens=0, extend_seconds=0.0, steps=0, step_tokens=0,
                             step_seconds=0.0, kept_tokens=0)  # fmt: skip
        self.fw = ModelRunner(model, group, self.seq, attention=attention, strategy=strategy, prefill=prefill,
                           prefill_chunk=prefill_chunk, counters=self.counters, cuda_graph=cuda_graph)  # fmt: skip
        self.dtype, self.device = self.fw.dtype, self.fw.device
        self.cache: ShardedKVCache | None = None
        self.history = History()  # committed ids and lengths, on the host
        self._pending: tuple | None = None  # the last step: tokens, parents, K/V per layer, hidden states
        self.hidden = None  # a contrastive.HiddenStore when the hidden states of the tokens are kept
        self.last_call: dict = {}

    def __len__(self) -> int:
        return len(self.history)

    @property
    def attention(self) -> str:
        """``"tree"`` or ``"ring"`` decoding (as created)."""
        return self.fw.attention

    @property
    def strategy(self) -> str:
        """Tree decoding's reduction (as created)."""
        return self.fw.strategy

    @property
    def prefill(self) -> str:
        """How :meth:`extend` prefills a block (as created)."""
        return self.fw.prefill_mode

    @property
    def prefill_chunk(self) -> int | None:
        """Tokens per rank per prefill forward (as created)."""
        return self.fw.prefill_chunk

    @property
    def batch(self) -> int:
        """Sequences in the session (set by the first call on an empty session)."""
        return self.history.batch

    @property
    def lengths(self) -> Tensor:
        """Committed tokens per sequence, ``[B]`` int64 (host); all equal unless the batch
        was extended with a right-padded ``attention_mask``."""
        return self.history.lens.clone()

    @property
    def tokens(self) -> Tensor:
        """Committed ids ``[B, len(self)]`` int64 on the host (a shorter sequence of a ragged
        batch is padded with -1)."""
        return self.history.tokens()

    def common_prefix(self, ids: Tensor | Sequence[int]) -> int:
        """Length of the longest prefix of ``ids`` (``[L]`` or ``[B, L]``) that is committed in
        every sequence: how much of a new prompt :meth:`rewind` + :meth:`extend` can reuse."""
        return self.history.common_prefix(ids)

    def stats(self) -> dict:
        """``cache_bytes`` (this rank's K/V buffers: ``allocated``, ``used``), ``peak_bytes``
        (this process's peak memory), the ``counters`` (forwards, tokens and seconds per
        kind of call, tokens kept) and ``last_call`` (``op``, ``tokens``, ``seconds``; keep and
        rewind run no forward and report 0 s)."""
        cb = self.cache.memory_bytes() if self.cache is not None else {"allocated": 0, "used": 0}
        return dict(cache_bytes=cb, peak_bytes=peak_memory_bytes(self.device),
                    counters=dict(self.counters), last_call=dict(self.last_call))  # fmt: skip

    # -- calls -----------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, ids: Tensor, attention_mask: Tensor | None = None, *, check: bool = True) -> Tensor:
        """Run ``ids`` after what is committed and commit them (a prompt, a question, an answer).

        One token per sequence runs as a decoding step (the token is stored on its owner
        rank, attention over the sharded cache). Several run as a chunked prefill: each rank
        runs the tokens it will hold, ``prefill_chunk`` at a time, with Tree or Ring prefill
        across the ranks; a batch whose sequences differ in length runs them as chain steps
        instead (every rank runs every token).

        Args:
            ids: ``[B, T]`` int64 token ids, identical on every rank; ``B`` the session's batch
                (any B ≥ 1 on an empty session). Ids on the host: with ``check=False`` the call
                reads nothing from the device at p = 1 (ids on a GPU are copied to the host once,
                for the session's history; tests/hf/test_session_no_host_sync.py).
            attention_mask: optional ``[B, T]`` right padding (1 for real tokens, then 0s):
                sequence ``b`` appends only its first ``mask[b].sum() >= 1`` tokens; needs a
                batch whose sequences have equal lengths.
            check: agree on the arguments across ranks first (one small all-gather). A loop
                whose ids come from identical computation on every rank may pass False.

        Returns:
            ``[B, V]`` float32 logits (float64 for a float64 model) at each sequence's last
            appended token.

        Raises:
            ValueError: on every rank: bad ids or mask, a batch size that differs from the
                session's, more tokens than ``max_length`` (or the model's positions), or
                ranks that passed different ids.
        """
        def validate():
            B, T = self._check_ids(ids, "ids", check)
            lens = torch.full((B,), T, dtype=torch.int64) if attention_mask is None else S.right_padded(
                attention_mask, B, T)  # fmt: skip
            if bool((lens < 1).any()):
                raise ValueError(f"every sequence must append at least one token, got lengths {lens.tolist()}")
            ragged = B > 1 and self.cache is not None and not self.cache.uniform()
            if attention_mask is not None and ragged and bool((lens != T).any()):
                raise ValueError(
                    "a right-padded attention_mask needs every sequence of the batch at the same length and layout"
                )
            self._check_room(lens, B)
            return lens, S.checksum(lens)

        lens = self._checked("extend", validate, check, ids)
        t0 = time.perf_counter()
        self._pending = None
        B, T = ids.shape
        self._ensure_cache(B, T)
        before = self.history.lens.clone()
        try:
            with self.fw.treeattn():
                if T == 1 or self.cache.uniform():
                    out = self.fw.decode(ids[:, 0], self.hidden) if T == 1 else self.fw.prefill(ids, lens, self.hidden)
                    self.history.commit(ids.detach().cpu().to(torch.int64), before, lens)
                else:  # a ragged batch: chains of prefill_chunk tokens, stepped and kept (kept = committed)
                    n = self.prefill_chunk or T
                    for a in range(0, T, n):
                        logits = self._step(ids[:, a : a + n], S.tree_of(None, min(n, T - a)))[0]
                        self._keep(list(range(logits.shape[1])))
                    out = logits[:, -1]
        except BaseException:
            self._truncate(before)
            raise
        self._account("extend", int(lens.sum()), t0)
        return out

    @torch.no_grad()
    def step(
        self,
        tokens: Tensor,
        parents: Sequence[int] | Tensor | None = None,
        *,
        return_hidden: bool = False,
        check: bool = True,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run ``T`` tentative tokens per sequence in one forward, without committing them.

        Token ``i`` hangs off token ``parents[i]`` of the block (-1: off the last committed
        token); it sits at its parent's position + 1 (rotary positions follow the tree depth)
        and sees the committed cache and its own ancestors in the block only (Tree
        decoding's ``new_k/new_v/new_mask``: exact). Nothing is stored in the cache until
        :meth:`keep`; another call discards the step.

        Args:
            tokens: ``[B, T]`` int64 ids, identical on every rank.
            parents: ``T`` ints with ``-1 <= parents[i] < i`` (a token tree, e.g. SpecInfer's),
                the same tree for every sequence; None: a chain (``[-1, 0, 1, ...]``).
            return_hidden: also return the last hidden states (after the final norm).
            check: as :meth:`extend`.

        Returns:
            ``[B, T, V]`` float32 logits (float64 for a float64 model) of each token; with
            ``return_hidden`` also ``[B, T, hidden]`` in the model's dtype.

        Raises:
            ValueError: on every rank: bad tokens or parents, tokens beyond ``max_length``
                (or the model's positions), ranks that passed different tokens or trees.
        """
        def validate():
            B, T = self._check_ids(tokens, "tokens", check)
            tree = S.tree_of(parents, T)
            self._check_room(torch.full((B,), int(tree[1].max()) + 1), B)
            return tree, S.checksum(torch.tensor(tree[0]))

        tree = self._checked("step", validate, check, tokens)
        t0 = time.perf_counter()
        self._pending = None
        self._ensure_cache(*tokens.shape)
        with self.fw.treeattn():
            logits, hidden = self._step(tokens, tree)
        self._account("step", tokens.numel(), t0)
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def keep(self, path: Sequence[int] | Tensor, *, check: bool = True) -> None:
        """Commit tokens of the last :meth:`step` and drop the rest.

        Args:
            path: indices into the last step's tokens that form a path from the root down
                (``parents[path[0]] == -1``, ``parents[path[i]] == path[i - 1]``); for a chain,
                a prefix such as ``[0, 1, 2]``; ``[]`` drops everything. The same path for
                every sequence. The kept tokens' K/V go to the rank and slot the placement
                gives their positions; nothing of the dropped ones stays visible.
            check: as :meth:`extend`.

        Raises:
            ValueError: on every rank: no step to keep from, or ``path`` is not a path
                from the root of the last step's tree, or ranks passed different paths.
        """
        def validate():
            if self._pending is None:
                raise ValueError("keep() needs a step() first (and each step can be kept once)")
            kept = S.check_path(path, self._pending[1])
            return kept, S.checksum(torch.tensor(kept))

        path = self._checked("keep", validate, check)
        self._keep(path)
        self.last_call = dict(op="keep", tokens=len(path) * self.batch, seconds=0.0)

    def rewind(self, n: int, *, check: bool = True) -> None:
        """Forget every committed token from position ``n`` on (``0 <= n <= len(self)``; a
        shorter sequence of a ragged batch keeps what it has below ``n``), and any pending
        step. ``n``: an int (a numpy integer or a 0-d integer tensor is one too). Raises
        ValueError (on every rank) for ``n`` out of range or not an int, or ranks that differ."""
        def validate():
            m = n
            if not isinstance(m, bool) and not (isinstance(m, Tensor) and m.ndim):
                try:  # numpy integers and 0-d integer tensors too
                    m = operator.index(m)
                except TypeError:
                    pass
            if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= len(self):
                raise ValueError(f"rewind(n) needs an int 0 <= n <= len(session) = {len(self)}, got {m!r}")
            return m, m

        n = self._checked("rewind", validate, check)
        self._pending = None
        if self.cache is not None:
            self._truncate(self.history.lens.clamp(max=n))
        self.last_call = dict(op="rewind", tokens=0, seconds=0.0)

    def adopt(self, ids: Tensor, kv) -> None:
        """Commit ``ids [1, n]`` after the one sequence's tokens without running them: their K/V
        come from ``kv(layer)`` -> ``(k, v) [m, Hkv, D]``, the ``m`` of them this rank's placement
        holds, in position order (a batch row's own tokens). Not checked: every rank calls it alike."""
        self._pending = None
        adopt(self.cache, self.history, ids, kv, self.device)

    # -- internals -------------------------------------------------------------------
    def _check_ids(self, ids, what: str, values: bool) -> tuple[int, int]:
        S.check_ids(ids, what, self.model.config.vocab_size, values)
        B = ids.shape[0]
        if len(self) and B != self.batch:
            raise ValueError(f"{what} has batch {B}, but the session holds {self.batch} sequences (rewind(0) first)")
        return B, ids.shape[1]

    def _checked(self, op: str, validate, check: bool, ids: Tensor | None = None):
        return checked(op, validate, check=check, group=self.group, committed=int(self.history.lens.sum()), ids=ids)

    def _ensure_cache(self, B: int, T: int) -> None:
        if self.cache is not None and (self.batch == B or len(self)):
            return
        cfg = self.model.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = ShardedKVCache(cfg.num_hidden_layers, B, kv_heads_here(self.model), hd, dtype=self.dtype,
                                    device=self.device, group=self.seq, placement=self.placement,
                                    block=self.block or auto_block(T, self.p))  # fmt: skip
        self.cache.slot_limit = self.cache.placement.max_per_rank(self.max_length)
        self.fw.bind(self.cache)
        self.history = History(B)

    def _truncate(self, lens: Tensor) -> None:
        """Back to ``lens [B]`` committed tokens per sequence (cache and history)."""
        self.cache.rewind(lens)
        self.history.truncate(lens)

    def _account(self, op: str, n: int, t0: float) -> None:
        self.last_call = dict(op=op, tokens=n, seconds=time.perf_counter() - t0)
        self.counters[f"{op}_tokens"] += n
        self.counters[f"{op}_seconds"] += self.last_call["seconds"]
        self.counters["steps"] += op == "step"

    def _step(self, tokens: Tensor, tree: tuple) -> tuple[Tensor, Tensor]:
        """Run a block of tentative tokens; its K/V wait in ``_pending`` for :meth:`keep`."""
        logits, hidden, stash = self.fw.step(tokens, tree, self.history.lens)
        self._pending = (tokens.detach().cpu().to(torch.int64), tree[0], stash, hidden)
        return logits, hidden

    def _check_room(self, add: Tensor, B: int) -> None:
        """ValueError unless adding ``add [B]`` tokens keeps every sequence within ``max_length``."""
        base = self.history.lens if len(self) or B == self.batch else torch.zeros(B, dtype=torch.int64)
        end = int((base + add).max())
        if end > self.max_length:
            raise ValueError(
                f"this call would take a sequence to {end} tokens, but the session holds at most "
                f"{self.max_length} (max_length, at most the model's max_position_embeddings); rewind first"
            )

    def _keep(self, path: list[int]) -> None:
        tokens, _, stash, hid = self._pending
        self._pending = None
        n, before = len(path), self.history.lens.clone()
        if n:
            idx = torch.tensor(path)
            try:
                store_kept(self.cache, stash, self.hidden, hid, idx, self.device)
            except BaseException:
                self._truncate(before)
                raise
            self.history.commit(tokens[:, idx], before, torch.full_like(before, n))
        self.counters["kept_tokens"] += n * self.batch

