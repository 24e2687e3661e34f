"""BatchRunner: many sequences decoded together, one forward per step, over shared prefixes.

A *prefix* (a document, a system prompt, a conversation so far) is a :class:`Session` of one
sequence, prefilled once and sharded over the ranks. A *row* is a running sequence: it reads
the first ``keep`` tokens of one prefix (or none) and holds its own tokens in a
:class:`~treeattn.cache.RowCache`, laid out as if they continued the prefix. One call of
:meth:`BatchRunner.run` runs ``T`` new tokens for each of several rows in one forward: the
rows reading the same prefix attend to it together (one pass over its K/V per rank,
:mod:`treeattn.runtime._cascade`), and with Tree Attention every layer crosses the ranks in one
reduction, as for a single sequence.

Every rank makes the same calls with the same arguments in the same order (the server's
rank 0 decides them and broadcasts them); nothing here checks that: the calls are meant to
come from a plan every rank received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..cache import Placement, RowCache
from ..comm.collectives import world
from ..hf import model as S
from ..hf.families import max_positions
from ..hf.tensor_parallel import kv_heads_here
from ..parallel.split import cuts
from ._cascade import PrefixGroup, RowsStep, Shape
from .runner import ModelRunner
from .session import Session

# Lines of at most this many tokens (decode steps, drafts to verify, short chunks) are placed
# before the forward: each token is stored on its owner and attended there with the row's
# other keys, causally, and crosses the ranks in the step's one reduction. Longer chunks are
# stored after it, their own tokens attended by every rank as one causal block (one matmul,
# not a bound per query over the row's keys).
PLACED_MAX = 16
# Steps of at least this many tokens run their per-token layers (linear layers, norms, MLPs) on a
# 1/p share of the tokens per rank (:mod:`treeattn.parallel.split`) instead of all of them on every
# rank; smaller steps are bound by reading the weights, which every rank does either way.
SPLIT_MIN = 32
# Lines of at least this many tokens that want logits at their last token only (prompt chunks, not
# drafts) run their shared-prefix pass through the prefill kernel where it applies
# (:func:`treeattn.runtime._cascade.prefix_state`); the choice depends on the line alone, so a row gets
# the same bits whatever shares its step.
WIDE_LINE = 8


def _group(cache, by_keep: dict[int, list[int]]) -> PrefixGroup:
    """The tokens reading ``cache``, ``keep -> flat token indices``, as one group."""
    keeps, tokens, first = sorted(by_keep), [], []
    for k in keeps:
        first.append(len(tokens))
        tokens += by_keep[k]
    return PrefixGroup(cache, keeps, torch.tensor(tokens, dtype=torch.int64), first)


class BatchRunner:
    """Prefixes and running rows of one model on every rank of ``group``.

    Args:
        model: a transformers causal LM (as :class:`Session`), the same weights on every rank.
        group: the process group of the ranks (default: the world); the K/V are sharded over
            it, or over this rank's KVP group of a model whose heads are split (as :class:`Session`).
        max_batch: rows that may run at once.
        session_kw: :class:`Session` keyword arguments of every prefix (placement, block,
            attention, strategy, prefill, prefill_chunk); ``attention`` and ``strategy`` also
            decide the rows' decoding.
    """

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None = None, max_batch: int = 8,
                 **session_kw) -> None:  # fmt: skip
        why = S.model_problem(model)  # (an ALiBi family's layers get treeattn's forward here)
        if why is not None:
            raise ValueError(why)
        if type(max_batch) is not int or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.model, self.group, self.kw = model, group, dict(session_kw)
        self.runner = ModelRunner(model, group, attention=self.kw.get("attention", "tree"),
                                  strategy=self.kw.get("strategy", "auto"))  # fmt: skip
        self.seq = self.runner.seq  # the ranks the K/V are sharded over (a mesh's KVP group)
        self.rank, self.p = world(self.seq)
        cfg = model.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype, self.device = self.runner.dtype, self.runner.device
        self.rows = RowCache(cfg.num_hidden_layers, max_batch, kv_heads_here(model), hd, rank=self.rank,
                             p=self.p, dtype=self.dtype, device=self.device)  # fmt: skip
        self.prefixes: dict[int, Session] = {}
        self.row_prefix: list[int | None] = [None] * max_batch
        self.row_ids: list[list[int]] = [[] for _ in range(max_batch)]  # the row's own token ids
        self.max_pos = max_positions(cfg) or (1 << 62)

    # -- prefixes --------------------------------------------------------------------
    def prefill(self, pid: int, ids: list[int] | Tensor) -> None:
        """Append ``ids`` to prefix ``pid`` (created empty first if new) with the Session's
        chunked, sharded prefill."""
        if pid not in self.prefixes:
            self.prefixes[pid] = Session(self.model, self.group, **self.kw)
        t = torch.as_tensor(ids, dtype=torch.int64).reshape(1, -1)
        self.prefixes[pid].extend(t, check=False)

    def drop(self, pid: int) -> None:
        """Forget prefix ``pid`` (no open row may read it)."""
        if pid in self.row_prefix:
            raise RuntimeError(f"prefix {pid} is read by a running row")
        del self.prefixes[pid]

    def held(self, pid: int) -> int:
        """The most K/V tokens one rank holds of prefix ``pid``."""
        c = self.prefixes[pid].cache
        return int(c.counts.max()) if c is not None else 0

    # -- rows ------------------------------------------------------------------------
    def open(self, row: int, pid: int | None, keep: int) -> None:
        """Start ``row`` after the first ``keep`` tokens of prefix ``pid`` (None and 0: no prefix)."""
        if pid is None:
            pl = Placement(self.kw.get("placement", "interleaved"), self.p, self.kw.get("block") or 1)
            self.rows.open(row, 0, pl, torch.zeros(self.p, dtype=torch.int64))
        else:
            c = self.prefixes[pid].cache
            if not 0 < keep <= len(self.prefixes[pid]):
                raise ValueError(f"keep {keep} outside prefix {pid}'s {len(self.prefixes[pid])} tokens")
            own = c.owner[0, :keep].to(torch.int64)
            self.rows.open(row, keep, c.placement, torch.bincount(own, minlength=self.p))
        self.row_prefix[row], self.row_ids[row] = pid, []

    def close(self, row: int, adopt: bool = False) -> None:
        """End ``row``. ``adopt``: when it read its whole prefix, that prefix takes the row's
        tokens (a rank-local copy: they already sit where the prefix's layout puts them), so
        a later request that continues this sequence finds all of it cached."""
        pid = self.row_prefix[row]
        if adopt and pid is not None and self.row_ids[row] and int(self.rows.start[row]) == len(self.prefixes[pid]):
            self._adopt(self.prefixes[pid], row)
        self.rows.close(row)
        self.row_prefix[row], self.row_ids[row] = None, []

    def trim(self, row: int, n: int) -> None:
        """Keep the first ``n`` of ``row``'s own tokens (drop rejected draft tokens)."""
        self.rows.truncate(row, n)
        del self.row_ids[row][n:]

    @torch.no_grad()
    def run(self, lines: list[tuple[int, list[int]]], full: list[int] | tuple = ()) -> Tensor:
        """Run each line's tokens after what its row holds, all lines in one forward (a flat
        sequence of every line's tokens, each line causal in itself), and append them to the
        rows. ``lines``: ``(row, ids)`` pairs, each row at most once: one id for a decoding
        request, a chunk of a joining one, or a token and its draft to verify. Returns float32
        logits (float64 for a float64 model), line after line in the callers' order: at every
        token of the lines whose rows are in ``full``, at the last token of the others; ``[len(lines),
        V]`` without ``full``."""
        rows = [r for r, _ in lines]
        if len(set(rows)) != len(rows) or not all(ids for _, ids in lines):
            raise ValueError("each line needs a distinct row and at least one token")
        order = sorted(range(len(lines)), key=lambda i: (len(lines[i][1]), self._key(lines[i][0])))
        lines = [lines[i] for i in order]  # lines of one length, and of one prefix, lie together
        pos, ids, last, by_T = [], [], [], {}
        for r, t in lines:
            p0, n = int(self.rows.start[r] + self.rows.n[r]), len(ids)
            pos += range(p0, p0 + len(t))
            by_T.setdefault(len(t), ([], []))
            by_T[len(t)][0].append(r)
            by_T[len(t)][1].append(list(range(n, n + len(t))))
            ids += t
            last.append(len(ids) - 1)
        pos = torch.tensor(pos, dtype=torch.int64)
        shapes = [Shape(T, rs, torch.tensor(ix, dtype=torch.int64)) for T, (rs, ix) in by_T.items()]
        tree = self.kw.get("attention", "tree") != "ring"
        for s in shapes:  # short lines go to their owners before the forward (attended there)
            if s.T == 1 or (tree and s.T <= PLACED_MAX):
                i, j, slots = self.rows.place(s.rows, s.T)
                rid = torch.tensor(s.rows, dtype=torch.int64)[i]
                s.placed = (rid.to(self.device), slots.to(self.device), s.idx[i, j].to(self.device))
        reads: dict[int, dict[int, list[int]]] = {}  # prefix -> keep -> the tokens reading that much of it
        for (r, t), x in zip(lines, last, strict=True):
            if self.row_prefix[r] is not None:
                by_keep = reads.setdefault(self.row_prefix[r], {})
                by_keep.setdefault(int(self.rows.start[r]), []).extend(range(x - len(t) + 1, x + 1))
        N = len(ids)
        wide = torch.zeros(N, dtype=torch.bool)
        for (r, t), x in zip(lines, last, strict=True):
            if r not in full and len(t) >= WIDE_LINE:
                wide[x - len(t) + 1 : x + 1] = True
        cut = cuts(N, self.p) if self.p > 1 and self.runner.split_ok and N >= max(SPLIT_MIN, self.p) else None
        ctx = RowsStep(self.rows, shapes, pos, [_group(self.prefixes[pid].cache, rd) for pid, rd in reads.items()],
                       self.kw.get("attention", "tree"), self.kw.get("strategy", "auto"), self.seq, cut=cut,
                       wide=wide)  # fmt: skip
        back = torch.tensor(order).argsort().tolist()  # the callers' order
        want = [range(last[i] - len(lines[i][1]) + 1, last[i] + 1) if lines[i][0] in full else [last[i]] for i in back]
        logits = self.runner.rows(ctx, ids, pos, [x for w in want for x in w])
        for s in (s for s in shapes if s.placed is None):  # chunks: to the ranks and slots their rows give them
            i, j, slots = self.rows.place(s.rows, s.T)
            flat = s.idx[i, j].to(self.device)
            rid = torch.tensor(s.rows, dtype=torch.int64)[i].to(self.device)
            for layer, (k, v) in ctx.stash.items():
                self.rows.store(
                    layer, rid, slots.to(self.device), k[0, :, flat].transpose(0, 1), v[0, :, flat].transpose(0, 1)
                )
        for r, t in lines:
            self.row_ids[r].extend(t)
        return logits

    def _key(self, row: int) -> tuple[int, int]:
        pid = self.row_prefix[row]
        return (-1, 0) if pid is None else (pid, int(self.rows.start[row]))

    def _adopt(self, sess: Session, row: int) -> None:
        rc, m = self.rows, int(self.rows.kv_len[row])
        sess.adopt(torch.tensor([self.row_ids[row]]),
                   lambda layer: (rc.k[layer][row, :, :m].transpose(0, 1), rc.v[layer][row, :, :m].transpose(0, 1)))  # fmt: skip
