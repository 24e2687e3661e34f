"""A generation session: a transformers model and its KV cache sharded across ranks, kept
between calls. Prompts and answers are appended with :meth:`Session.extend`; tentative
tokens (a chain or a token tree) are run with :meth:`Session.step` and committed with
:meth:`Session.keep`; :meth:`Session.rewind` forgets a suffix."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .._host import peak_memory_bytes
from ..cache import PLACEMENTS, ShardedKVCache
from ..comm.collectives import all_reduce, world
from ..comm.strategies import STRATEGIES
from ..comm.validate import agree
from .attention import ATTN_NAME, StepContext, TreeAttnCache
from .families import unsupported_reason

ATTENTIONS = ("tree", "ring")
_OPS = ("extend", "step", "keep", "rewind")


def lm_logits(model: torch.nn.Module, hidden: Tensor) -> Tensor:
    """float32 logits (float64 for a float64 model) of the LM head for hidden states
    ``[..., hidden]`` (the model's own final-logit softcapping, e.g. Gemma-2, applied as its
    ``forward`` does)."""
    logits = model.get_output_embeddings()(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@functools.cache
def _cache_name(forward_cls: type) -> str:
    names = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def _cache_kw(decoder: torch.nn.Module, cache) -> dict:
    """The cache keyword of the decoder's forward: ``cache`` (transformers >= 5.24, where
    ``past_key_values`` is deprecated) or ``past_key_values``."""
    return {_cache_name(type(decoder)): cache}


def checksum(t: Tensor) -> int:
    """An order-sensitive integer digest of an integer tensor (for comparing across ranks)."""
    t = t.detach().cpu().to(torch.int64).reshape(-1)
    return int(((t + 1) * torch.arange(1, t.numel() + 1)).sum() % (1 << 61)) if t.numel() else 0


def model_problem(model: torch.nn.Module) -> str | None:
    """Why treeattn cannot run ``model`` exactly, or None."""
    if getattr(model, "config", None) is None:
        return f"model must be a transformers model with a .config, got {type(model).__name__}"
    why = unsupported_reason(model.config, training=model.training)
    if why is None and not getattr(model, "_supports_attention_backend", False):
        why = (
            f"{type(model).__name__}: its attention does not go through transformers' attention interface, "
            "so treeattn cannot run it"
        )
    return why


def prefill_windows(positions: list[Tensor], lo: int, hi: int, chunk: int | None) -> list[tuple[int, int]]:
    """Split the global positions ``[lo, hi)`` into consecutive windows in which no rank holds
    more than ``chunk`` tokens (``positions[r]``: rank r's sorted positions in ``[lo, hi)``;
    None: one window). Causal attention needs the windows in position order: a query may
    only run once every earlier key exists. Interleaved placement gives every rank
    ``chunk`` tokens per window; contiguous placement runs the ranks' chunks one after another."""
    if not chunk:
        return [(lo, hi)]
    out = []
    while lo < hi:
        end = hi
        for x in positions:
            i = int(torch.searchsorted(x, lo))
            if i + chunk < len(x):
                end = min(end, int(x[i + chunk]))
        out.append((lo, end))
        lo = end
    return out


def _right_padded(mask: Tensor, B: int, T: int) -> Tensor:
    m = mask.detach().cpu().to(torch.int64)
    if m.shape != (B, T):
        raise ValueError(f"attention_mask must be [B, T]={(B, T)}, got {tuple(m.shape)}")
    lens = m.sum(1)
    if not torch.equal(m, (torch.arange(T)[None, :] < lens[:, None]).to(torch.int64)):
        raise ValueError(
            "attention_mask must describe right padding (1...1 0...0 per row); left padding is not supported"
        )
    return lens


def tree_of(parents: Sequence[int] | None, T: int) -> tuple[list[int], Tensor, Tensor]:
    """``(parents, depth [T], sees [T, T] bool)`` of a block; ``sees[i, j]``: j is i or an
    ancestor of i. Raises ValueError for a parent that points forward or out of range."""
    if parents is None:
        parents = list(range(-1, T - 1))
    else:
        if isinstance(parents, Tensor):
            parents = parents.tolist()
        parents = list(parents)
        if len(parents) != T or not all(isinstance(x, int) and not isinstance(x, bool) for x in parents):
            raise ValueError(f"parents must be {T} ints (one per token), got {parents!r}")
        bad = [i for i, x in enumerate(parents) if not -1 <= x < i]
        if bad:
            i = bad[0]
            raise ValueError(
                f"parents[{i}] = {parents[i]}: a token's parent must be an earlier token of the block "
                f"(0 <= parent < {i}) or -1 (the last committed token)"
            )
    depth = torch.zeros(T, dtype=torch.int64)
    sees = torch.eye(T, dtype=torch.bool)
    for i, a in enumerate(parents):
        if a >= 0:
            depth[i] = depth[a] + 1
            sees[i] |= sees[a]
    return parents, depth, sees


class Session:
    """A model whose KV cache is sharded across the ranks of ``group`` and outlives a call:
    a long document is prefilled once, then questions, answers and speculative drafts are
    appended, verified and rewound without running the document again.

    Create it on every rank with the same arguments and make the same calls in the same
    order on every rank (every call is collective). Each call checks its arguments and
    the ranks agree on them (one small int64 all-gather, nothing pickled) before any other
    collective; a bad call raises the same ``ValueError`` on every rank and leaves the cache
    and the history exactly as they were.

    Tokens live on the rank and local slot that ``placement`` gives their global position
    (``"interleaved"``: position ``i`` on rank ``(i // block) % p``; ``"contiguous"``: the
    first prompt split in p contiguous parts, every later token on the rank holding the
    fewest tokens of its sequence), whichever call committed them, so a token kept after a
    :meth:`step` sits exactly where sequential decoding would have put it.

    Args:
        model: a transformers causal LM (Llama, Mistral, Qwen2, Gemma-2/3 families; see the
            README's table) in eval mode, the same weights on every rank. Its attention
            implementation is switched to ``"treeattn"`` during each call only.
        group: the sequence-parallel process group (default: the world; without
            torch.distributed initialised, one process).
        placement, block: KV placement (see :class:`treeattn.ShardedKVCache`).
        attention: ``"tree"`` (Tree prefill and decoding) or ``"ring"`` (Ring Attention).
        strategy: Tree decoding's reduction (one of ``treeattn.comm.STRATEGIES``).
        prefill_chunk: tokens per rank run through the model at a time by :meth:`extend`
            (bounds the activations); None: a whole extend at once.
        max_length: the most tokens a sequence may hold (default and upper bound: the
            model's ``max_position_embeddings``); the cache grows on demand up to it.

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
        block: int = 1,
    ) -> None:
        self.rank, self.p = world(group)
        err, limit = None, 0
        try:
            if attention not in ATTENTIONS:
                raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
            if placement not in PLACEMENTS:
                raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
            if strategy not in STRATEGIES:
                raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
            if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
                raise ValueError(f"prefill_chunk must be an int >= 1 or None, got {prefill_chunk!r}")
            if not isinstance(block, int) or block < 1:
                raise ValueError(f"block must be an int >= 1, got {block!r}")
            why = model_problem(model)
            if why is not None:
                raise ValueError(why)
            max_pos = getattr(model.config, "max_position_embeddings", None) or (1 << 62)
            if max_length is not None and (not isinstance(max_length, int) or not 1 <= max_length <= max_pos):
                raise ValueError(
                    f"max_length must be an int in [1, {max_pos}] (the model's max_position_embeddings), "
                    f"got {max_length!r}"
                )
            limit = max_length or max_pos
        except ValueError as e:
            err = str(e)
        ok = err is None
        cfg = model.config if ok else None
        fields = {
            "attention": ATTENTIONS.index(attention) if attention in ATTENTIONS else -1,
            "placement": PLACEMENTS.index(placement) if placement in PLACEMENTS else -1,
            "strategy": STRATEGIES.index(strategy) if strategy in STRATEGIES else -1,
            "prefill_chunk": prefill_chunk or 0 if ok else -1,
            "block": block if ok else -1,
            "max_length": limit,
            "num_hidden_layers": cfg.num_hidden_layers if ok else -1,
            "vocab_size": cfg.vocab_size if ok else -1,
            "hidden_size": cfg.hidden_size if ok else -1,
        }
        agree(fields, err, group=group, show={"attention": dict(enumerate(ATTENTIONS)),
                                              "placement": dict(enumerate(PLACEMENTS))})  # fmt: skip
        self.model, self.group = model, group
        self.placement, self.block, self.attention, self.strategy = placement, block, attention, strategy
        self.prefill_chunk, self.max_length = prefill_chunk, limit
        self.decoder = model.get_decoder()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.cache: ShardedKVCache | None = None
        self._tc: TreeAttnCache | None = None
        self._ids = torch.zeros(1, 0, dtype=torch.int64)  # committed ids, host, -1 beyond a row's length
        self._lens = torch.zeros(1, dtype=torch.int64)
        self._pending: tuple[Tensor, list[int], dict] | None = None  # the last step: tokens, parents, K/V
        self.last_call: dict = {}
        self.counters = dict(forwards=0, extend_tokens=0, extend_seconds=0.0, steps=0, step_tokens=0,
                             step_seconds=0.0, kept_tokens=0)  # fmt: skip

    # -- the committed history ---------------------------------------------------------
    def __len__(self) -> int:
        return int(self._lens.max())

    @property
    def batch(self) -> int:
        """Sequences in the session (fixed by the first :meth:`extend` or :meth:`step` of an
        empty session)."""
        return self._ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        """Committed tokens per sequence, ``[B]`` int64 (host); all equal unless the batch
        was extended with a right-padded ``attention_mask``."""
        return self._lens.clone()

    @property
    def tokens(self) -> Tensor:
        """Committed ids ``[B, len(self)]`` int64 on the host (a shorter sequence of a ragged
        batch is padded with -1)."""
        return self._ids[:, : len(self)].clone()

    def common_prefix(self, ids: Tensor | Sequence[int]) -> int:
        """Length of the longest prefix of ``ids`` (``[L]`` or ``[B, L]``) that is committed in
        every sequence: how much of a new prompt :meth:`rewind` + :meth:`extend` can reuse."""
        ids = torch.as_tensor(ids).detach().cpu().to(torch.int64)
        ids = ids.expand(self.batch, -1) if ids.ndim == 1 else ids
        if ids.ndim != 2 or ids.shape[0] != self.batch:
            raise ValueError(f"ids must be [L] or [B, L] with B={self.batch}, got {tuple(ids.shape)}")
        n = min(ids.shape[1], len(self))
        same = (ids[:, :n] == self._ids[:, :n]).all(0)
        return int(same.to(torch.int64).cumprod(0).sum())

    def stats(self) -> dict:
        """``cache_bytes`` (this rank's K/V buffers: ``allocated``, ``used``), ``peak_bytes``
        (this process's peak memory), the ``counters`` (forwards, tokens and seconds per
        kind of call, tokens kept) and ``last_call`` (``op``, ``tokens``, ``seconds``)."""
        cb = self.cache.memory_bytes() if self.cache is not None else {"allocated": 0, "used": 0}
        return dict(cache_bytes=cb, peak_bytes=peak_memory_bytes(self.device), counters=dict(self.counters),
                    last_call=dict(self.last_call))  # fmt: skip

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
                (any B ≥ 1 on an empty session).
            attention_mask: optional ``[B, T]`` right padding (1 for real tokens, then 0s):
                sequence ``b`` appends only its first ``mask[b].sum() >= 1`` tokens; needs a
                batch whose sequences have equal lengths.
            check: agree on the arguments across ranks first (one small all-gather). A loop
                whose ids come from identical computation on every rank may pass False.

        Returns:
            ``[B, V]`` float32 logits at each sequence's last appended token.

        Raises:
            ValueError: on every rank: bad ids or mask, a batch size that differs from the
                session's, more tokens than ``max_length`` (or the model's positions), or
                ranks that passed different ids.
        """
        err, lens = None, None
        try:
            B, T = self._check_ids(ids, "ids")
            lens = torch.full((B,), T, dtype=torch.int64) if attention_mask is None else _right_padded(
                attention_mask, B, T)  # fmt: skip
            if bool((lens < 1).any()):
                raise ValueError(f"every sequence must append at least one token, got lengths {lens.tolist()}")
            ragged = B > 1 and self.cache is not None and not self.cache.uniform()
            if attention_mask is not None and ragged and bool((lens != T).any()):
                raise ValueError("a right-padded attention_mask needs every sequence of the batch at the same length")
            self._check_room(lens, B)
        except ValueError as e:
            err = str(e)
        if check:
            self._agree("extend", err, ids, extra=checksum(lens) if lens is not None else -1)
        elif err is not None:
            raise ValueError(err)
        t0 = time.perf_counter()
        self._pending = None
        B, T = ids.shape
        self._ensure_cache(B)
        before = self._lens.clone()
        try:
            with self._treeattn():
                if T == 1 or self.cache.uniform():
                    out = self._decode_one(ids[:, 0]) if T == 1 else self._prefill(ids, lens)
                    self._commit(ids.detach().cpu().to(torch.int64), before, lens)
                else:  # a ragged batch: chains of prefill_chunk tokens, stepped and kept (kept = committed)
                    n = self.prefill_chunk or T
                    for a in range(0, T, n):
                        logits = self._step(ids[:, a : a + n], tree_of(None, min(n, T - a)))[0]
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
            ``[B, T, V]`` float32 logits (each token's next-token distribution); with
            ``return_hidden`` also ``[B, T, hidden]`` in the model's dtype.

        Raises:
            ValueError: on every rank: bad tokens or parents, tokens beyond ``max_length``
                (or the model's positions), ranks that passed different tokens or trees.
        """
        err, tree = None, None
        try:
            B, T = self._check_ids(tokens, "tokens")
            tree = tree_of(parents, T)
            self._check_room(torch.full((B,), int(tree[1].max()) + 1), B)
        except ValueError as e:
            err = str(e)
        if check:
            self._agree("step", err, tokens, extra=checksum(torch.tensor(tree[0])) if tree else -1)
        elif err is not None:
            raise ValueError(err)
        t0 = time.perf_counter()
        self._pending = None
        self._ensure_cache(tokens.shape[0])
        with self._treeattn():
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
        err = None
        try:
            if self._pending is None:
                raise ValueError("keep() needs a step() first (and each step can be kept once)")
            if isinstance(path, Tensor):
                path = path.tolist()
            path = list(path)
            parents = self._pending[1]
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(parents) for x in path):
                raise ValueError(f"path must be indices in [0, {len(parents)}) of the last step, got {path!r}")
            for i, x in enumerate(path):
                want = path[i - 1] if i else -1
                if parents[x] != want:
                    raise ValueError(
                        f"path {path} is not a root-to-leaf path of the last step: token {x} hangs off "
                        f"{parents[x]}, not {want}"
                    )
        except ValueError as e:
            err = str(e)
        if check:
            self._agree("keep", err, None, extra=checksum(torch.tensor(path)) if err is None else -1)
        elif err is not None:
            raise ValueError(err)
        self._keep(path)

    def rewind(self, n: int, *, check: bool = True) -> None:
        """Forget every committed token from position ``n`` on (``0 <= n <= len(self)``; a
        shorter sequence of a ragged batch keeps what it has below ``n``), and any pending
        step. Raises ValueError (on every rank) for ``n`` out of range or ranks that differ."""
        err = None
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self):
            err = f"rewind(n) needs an int 0 <= n <= len(session) = {len(self)}, got {n!r}"
        if check:
            self._agree("rewind", err, None, extra=n if err is None else -1)
        elif err is not None:
            raise ValueError(err)
        self._pending = None
        self._truncate(self._lens.clamp(max=n))

    # -- internals -------------------------------------------------------------------
    def _check_ids(self, ids, what: str) -> tuple[int, int]:
        if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.shape[1] < 1 or ids.shape[0] < 1:
            got = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise ValueError(f"{what} must be a [B, T] integer tensor with B, T >= 1, got {got}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{what} must be integer token ids, got {ids.dtype}")
        V = self.model.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"{what} must lie in [0, {V}) (the model's vocabulary)")
        B = ids.shape[0]
        if len(self) and B != self.batch:
            raise ValueError(f"{what} has batch {B}, but the session holds {self.batch} sequences (rewind(0) first)")
        return B, ids.shape[1]

    def _lens_for(self, B: int) -> Tensor:
        return self._lens if len(self) or B == self.batch else torch.zeros(B, dtype=torch.int64)

    def _check_room(self, add: Tensor, B: int) -> None:
        end = int((self._lens_for(B) + add).max())
        if end > self.max_length:
            raise ValueError(
                f"this call would take a sequence to {end} tokens, but the session holds at most "
                f"{self.max_length} (max_length, at most the model's max_position_embeddings); rewind first"
            )

    def _agree(self, op: str, err: str | None, ids: Tensor | None, extra: int) -> None:
        ok = err is None
        fields = {
            "call": _OPS.index(op),
            "batch": ids.shape[0] if ok and ids is not None else -1,
            "tokens": ids.shape[1] if ok and ids is not None else -1,
            "token ids checksum": checksum(ids) if ok and ids is not None else -1,
            "arguments checksum": extra,
            "committed tokens": int(self._lens.sum()),
        }
        agree(fields, err, group=self.group, show={"call": dict(enumerate(_OPS))})

    def _ensure_cache(self, B: int) -> None:
        if self.cache is not None and (self.batch == B or len(self)):
            return
        cfg = self.model.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = ShardedKVCache(cfg.num_hidden_layers, B, cfg.num_key_value_heads, hd, dtype=self.dtype,
                                    device=self.device, group=self.group, placement=self.placement,
                                    block=self.block)  # fmt: skip
        self._tc = TreeAttnCache(self.cache)
        self._ids = torch.zeros(B, 0, dtype=torch.int64)
        self._lens = torch.zeros(B, dtype=torch.int64)

    def _grow_ids(self, need: int) -> None:
        if need > self._ids.shape[1]:
            ids = torch.full((self.batch, max(need, 2 * self._ids.shape[1], 64)), -1, dtype=torch.int64)
            ids[:, : self._ids.shape[1]] = self._ids
            self._ids = ids

    def _truncate(self, lens: Tensor) -> None:
        """Back to ``lens [B]`` committed tokens per sequence (cache and history)."""
        self.cache.rewind(lens)
        cols = torch.arange(self._ids.shape[1])[None, :]
        self._ids[cols >= lens[:, None]] = -1
        self._lens = lens.clone()

    def _account(self, op: str, n: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.last_call = dict(op=op, tokens=n, seconds=dt)
        self.counters[f"{op}_tokens"] += n
        self.counters[f"{op}_seconds"] += dt
        if op == "step":
            self.counters["steps"] += 1

    @contextlib.contextmanager
    def _treeattn(self):
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_NAME)
        try:
            yield
        finally:
            self._tc.ctx = None
            self.model.set_attn_implementation(prev)

    def _forward(self, ctx: StepContext, ids: Tensor, pos: Tensor) -> Tensor:
        self._tc.ctx = ctx
        self.counters["forwards"] += 1
        return self.decoder(
            input_ids=ids,
            position_ids=pos.to(self.device),
            **_cache_kw(self.decoder, self._tc),
            use_cache=True,
            treeattn_ctx=ctx,
        ).last_hidden_state

    def _commit(self, ids: Tensor, before: Tensor, lens: Tensor) -> None:
        """History: sequence b's first ``lens[b]`` tokens of ``ids [B, T]`` (host) follow ``before[b]``."""
        T = ids.shape[1]
        self._grow_ids(int((before + lens).max()))
        real = torch.arange(T)[None, :] < lens[:, None]
        rows = torch.arange(self.batch)[:, None].expand(-1, T)
        self._ids[rows[real], (before[:, None] + torch.arange(T)[None, :])[real]] = ids[real]
        self._lens = before + lens

    def _decode_one(self, tok: Tensor) -> Tensor:
        c = self.cache
        pos = c.seq_lens.clone()
        c.begin_decode_step()
        ctx = StepContext(c, "decode", self.attention, self.strategy, self.group, kv_lens=c.kv_lens.clone().to(
            self.device), q_pos=pos)  # fmt: skip
        return lm_logits(self.model, self._forward(ctx, tok[:, None], pos[:, None])[:, -1])

    def _step(self, tokens: Tensor, tree: tuple[list[int], Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        parents, depth, sees = tree
        c = self.cache
        q_pos = self._lens[:, None] + depth[None, :]
        ctx = StepContext(c, "step", self.attention, self.strategy, self.group, kv_lens=c.kv_lens.to(self.device),
                          q_pos=q_pos, tree=sees, depth=depth)  # fmt: skip
        hidden = self._forward(ctx, tokens, q_pos)
        self._pending = (tokens.detach().cpu().to(torch.int64), parents, ctx.stash)
        return lm_logits(self.model, hidden), hidden

    def _keep(self, path: list[int]) -> None:
        tokens, _, stash = self._pending
        self._pending = None
        n, before = len(path), self._lens.clone()
        if n:
            idx = torch.tensor(path)
            c = self.cache
            try:
                b, j, slots = c.place(n)
                cols = idx[j].to(self.device)
                bd, sd = b.to(self.device), slots.to(self.device)
                for layer, (k, v) in stash.items():
                    c.store_slots(layer, bd, sd, k[bd, :, cols], v[bd, :, cols])
            except BaseException:
                self._truncate(before)
                raise
            self._commit(tokens[:, idx], before, torch.full_like(before, n))
        self.counters["kept_tokens"] += n * self.batch

    def _prefill(self, ids: Tensor, lens: Tensor) -> Tensor:
        """Every rank runs the tokens it will hold, window by window in position order, and
        stores their K/V; returns the float32 logits of each sequence's last token."""
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
            ctx = StepContext(c, "prefill", self.attention, self.strategy, self.group,
                              positions=[torch.cat([o, x[:j]]) for o, x, j in zip(old, new, b, strict=True)],
                              q_positions=q_pos, n_real=n, start=base + a[rank])  # fmt: skip
            pos = q_pos[rank] if n else torch.full((1,), L0, dtype=torch.int64)  # a placeholder keeps the model happy
            hidden = self._forward(ctx, ids[:, (pos - L0).to(ids.device)], pos[None, :].expand(B, -1))
            if last is None:
                acc = torch.promote_types(hidden.dtype, torch.float32)
                last = torch.zeros(B, hidden.shape[-1], dtype=acc, device=self.device)
            if n:  # who holds each sequence's last token in this window
                rows, cols = torch.nonzero(q_pos[rank][None, :] == (L0 + lens - 1)[:, None], as_tuple=True)
                last[rows.to(self.device)] = hidden[rows.to(self.device), cols.to(self.device)].to(last.dtype)
        last = all_reduce(last, dist.ReduceOp.SUM, self.group)
        return lm_logits(self.model, last.to(self.dtype))
