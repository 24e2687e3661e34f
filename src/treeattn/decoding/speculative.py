"""Speculative decoding over a :class:`treeattn.runtime.Session`: a drafter proposes a chain or a
token tree after the pending token, the target runs the whole block in one
:meth:`Session.step` (Tree decoding's token-tree mask, positions by depth) and
:meth:`Session.keep` commits the accepted path.

Drafters: prompt lookup (n-grams of the prompt and the generated text) and a draft model
(a smaller model with the same vocabulary). Verification: greedy (exactly the tokens of
non-speculative greedy decoding) or lossless sampling: Leviathan et al.'s rejection rule for
a chain sampled from the draft model, and for deterministic drafts (prompt lookup, the draft
model's top-W tree) a sample of the target at each node, walking down while it matches a
child. Drafting and the verdict run on the group's rank 0 and reach the other ranks as int64
tensors (one broadcast each), so every rank commits the same tokens whatever its numerics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..comm.collectives import broadcast, world
from ..hf.model import cache_kw
from .draft_policy import DraftPolicy
from .prompt_lookup import Draft, PromptLookup, _cut
from .sampler import Sampler

_MSG = 240  # bytes of a drafting error carried to the other ranks


class DraftModel:
    """A smaller causal LM with the target's vocabulary, run in this process with its own
    DynamicCache (cropped back to the committed history after each proposal). It drafts a
    chain of ``k`` tokens and, at every depth, ``width`` branches: greedy (``warp`` None), the
    ``width`` likeliest tokens, the chain going on from the likeliest; sampling, ``width``
    tokens drawn from the warped draft distribution (with replacement: duplicates merge into
    one node but stay separate trials), the chain going on from the first draw, with the
    distributions kept for the verifier. ``width`` 1: a chain; ``k - 1`` draft forwards
    either way (the other branches are leaves)."""

    def __init__(self, model: torch.nn.Module, sampler: Sampler | None = None) -> None:
        from transformers import DynamicCache

        self.model = model
        self.sampler = sampler if sampler is not None and sampler.sample else None
        self.cache, self.ids, self.chunk = DynamicCache(), [], 1024
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def _run(self, ids: list[int]) -> Tensor:
        x = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=x, **cache_kw(self.model, self.cache), use_cache=True)
        return out.logits[0, -1].float()

    def _sync(self, history: list[int]) -> Tensor:
        n = min(self.common(history), len(history) - 1)  # the last token runs again: its logits are needed
        self._crop(n)
        self.ids = history[:]
        for a in range(n, len(history), self.chunk):  # a long document in chunks: bounded activations
            logits = self._run(history[a : a + self.chunk])
        return logits

    def propose(self, history: Tensor, k: int, width: int) -> Draft:
        hist = history.tolist()
        logits = self._sync(hist)
        d, qs, trials, parent = Draft(), [], {}, -1
        for depth in range(k):
            if self.sampler is None:
                draws = logits.topk(min(width, logits.numel())).indices.tolist()
            else:
                q = self.sampler.probs(logits)
                draws = self.sampler.draws(q, width)
            node = {}
            for t in dict.fromkeys(draws):  # distinct tokens, in the order drawn
                node[t] = len(d.tokens)
                d.tokens.append(t)
                d.parents.append(parent)
                if self.sampler is not None:
                    qs.append(q)
            trials[parent] = [node[t] for t in draws]
            parent = node[draws[0]]
            if depth + 1 < k:
                logits = self._run([draws[0]])
        if self.sampler is not None:
            d.q, d.trials = torch.stack(qs), trials
        self._crop(len(hist))
        return d

    def common(self, history: list[int]) -> int:
        """Tokens of ``history`` this drafter's cache holds already (its common prefix)."""
        m = min(len(self.ids), len(history))
        if self.ids[:m] == history[:m]:  # the usual case, compared in C (rank 0 calls this every step)
            return m
        n = 0
        for a, b in zip(self.ids, history, strict=False):
            if a != b:
                break
            n += 1
        return n

    def advance(self, history: list[int], n: int) -> None:
        """Run up to ``n`` more tokens of ``history`` into the cache (all but its last token,
        whose logits a proposal needs): a long prompt a chunk at a time."""
        c = min(self.common(history), len(history) - 1)
        self._crop(c)
        upto = min(len(history) - 1, c + n)
        if upto > c:
            self._run(history[c:upto])
        self.ids = history[:upto] if upto > c else self.ids[:c]

    def fork(self, n: int) -> DraftModel:
        """A drafter of the same model whose cache starts as this one's first ``n`` tokens (a copy)."""
        import copy

        try:
            from transformers.cache_utils import DynamicLayer
        except ImportError:  # transformers before the cache's layers
            DynamicLayer = None  # noqa: N806

        new = DraftModel(self.model)
        new.sampler, new.chunk = self.sampler, self.chunk
        n = min(n, len(self.ids), self.cache.get_seq_length())
        new.ids = self.ids[:n]
        layers = getattr(self.cache, "layers", None)
        plain = DynamicLayer is not None and layers is not None
        if plain and all(type(x) is DynamicLayer and getattr(x, "keys", None) is not None for x in layers):
            for i, x in enumerate(layers):  # only the first n tokens are copied
                new.cache.update(x.keys[..., :n, :].clone(), x.values[..., :n, :].clone(), i)
        else:  # other cache layouts: a whole copy, cropped
            new.cache = copy.deepcopy(self.cache)
            new._crop(n)
        return new

    def _crop(self, n: int) -> None:
        cur = self.cache.get_seq_length()
        if cur > n:
            self.cache.crop(n - cur)  # negative: remove that many tokens (every transformers version)


@dataclass
class SpecStats:
    """Per target forward after the first token: tokens committed (1 + accepted drafts) and
    draft depth offered; ``accepted_at[j]`` / ``offered_at[j]``: steps whose draft reached
    depth j + 1 and whose accepted path did."""

    committed: list[int] = field(default_factory=list)
    offered_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def add(self, depth: int, accepted: int) -> None:
        self.committed.append(1 + accepted)
        for lst, n in ((self.offered_at, depth), (self.accepted_at, accepted)):
            lst.extend([0] * (n - len(lst)))
            for j in range(n):
                lst[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.committed) / len(self.committed) if self.committed else 0.0

    def rates(self) -> list[float]:
        """Acceptance rate per draft position (depth 1, 2, ...)."""
        acc = self.accepted_at + [0] * (len(self.offered_at) - len(self.accepted_at))
        return [a / o for a, o in zip(acc, self.offered_at, strict=True)]


class Speculator:
    """One speculative step at a time over a session of one sequence (B = 1): see the module
    docstring. ``sampler`` is the target's greedy or sampling rule (its generator draws the
    acceptance tests too).
    ``adaptive``: rank 0 drafts as deep as :class:`~treeattn.decoding.draft_policy.DraftPolicy`
    finds worth it (up to ``k``; none when no draft promises a gain); else ``k`` deep wherever
    the drafter has a draft.
    A step without a draft is a plain :meth:`Session.extend`."""

    def __init__(self, drafter, k: int, width: int, sampler: Sampler, *, group=None, adaptive: bool = False) -> None:
        self.drafter, self.k, self.width = drafter, k, width
        self.sampler, self.group = sampler, group
        self.rank, _ = world(group)
        self.stats = SpecStats()
        self.policy = DraftPolicy(k, width) if adaptive else None
        self._hist: list[int] = []  # rank 0: the committed ids as a list, extended as they grow

    def step(self, session, tok: int, budget: int) -> list[int]:
        """Commit the pending token ``tok`` and the accepted drafts; returns the new tokens
        (accepted drafts, then the target's next token). ``budget``: the most tokens to return."""
        room = session.max_length - len(session) - 1
        cap = max(0, min(self.k, budget - 1, room))
        n_max = cap * self.width
        buf = torch.full((1 + 2 * n_max + _MSG,), -1, dtype=torch.int64)  # n, tokens, parents, an error
        draft, kind = Draft(), None
        if self.rank == 0:
            try:
                if cap:
                    draft, kind = self._draft(session, tok, cap)
                n = len(draft.tokens)
                buf[0] = n
                buf[1 : 1 + n] = torch.tensor(draft.tokens, dtype=torch.int64)
                buf[1 + n_max : 1 + n_max + n] = torch.tensor(draft.parents, dtype=torch.int64)
            except Exception as e:  # every rank must hear of it, not wait in the broadcast
                msg = f"{type(e).__name__}: {e}".encode()[:_MSG]
                buf[0], buf[-_MSG:] = -1, 0
                buf[-_MSG : len(buf) - _MSG + len(msg)] = torch.tensor(list(msg), dtype=torch.int64)
        buf = broadcast(buf, self.group)
        n = int(buf[0])
        if n < 0:
            msg = bytes(x for x in buf[-_MSG:].tolist() if x > 0).decode(errors="replace")
            raise RuntimeError(f"the drafter failed on rank 0 of the group: {msg}")
        tokens = [tok] + buf[1 : 1 + n].tolist()
        parents = [-1] + [x + 1 for x in buf[1 + n_max : 1 + n_max + n].tolist()]
        t0 = time.perf_counter()
        if n:
            logits = session.step(torch.tensor([tokens], device=session.device), parents, check=False)[0]
        else:  # nothing drafted: a plain step, committed at once
            logits = session.extend(torch.tensor([[tok]], device=session.device), check=False)
        seconds = time.perf_counter() - t0
        verdict = torch.full((3 + n,), -1, dtype=torch.int64)  # path length, next token, path (root included)
        if self.rank == 0:
            path, nxt = self._verify(logits, tokens, parents, draft)
            verdict[0], verdict[1] = len(path), nxt
            verdict[2 : 2 + len(path)] = torch.tensor(path, dtype=torch.int64)
        verdict = broadcast(verdict, self.group)
        path = verdict[2 : 2 + int(verdict[0])].tolist()
        self.last_logits = logits[path[-1]][None]  # the distribution the next token came from
        if n:  # committing the kept path is part of what a drafted step costs (~1 ms of 35 here)
            t1 = time.perf_counter()
            session.keep(path, check=False)
            seconds += time.perf_counter() - t1
        d = max((_depth(parents, i) for i in range(len(tokens))), default=0)
        self.stats.add(d, len(path) - 1)
        if self.policy is not None:
            self.policy.observe_step(len(tokens), seconds)
            if kind is not None:
                self.policy.observe_acceptance(kind, d, len(path) - 1)
        return [tokens[i] for i in path[1:]] + [int(verdict[1])]

    def _draft(self, session, tok: int, cap: int) -> tuple[Draft, object]:
        """Rank 0: the draft for this step (at most ``cap`` deep) and its kind of evidence."""
        ids, n = session.tokens[0], len(self._hist)
        # committed ids only grow here (and a stale list costs drafts, never output): the new ones
        if n > len(ids) or (n and self._hist[-1] != int(ids[n - 1])):
            self._hist, n = [], 0
        self._hist += ids[n:].tolist()
        pol = self.policy
        if isinstance(self.drafter, PromptLookup):  # the evidence (the match) comes with the draft
            draft = self.drafter.propose(self._hist + [tok], cap, self.width)
            if pol is None or not draft.tokens:
                return draft, None
            return _cut(draft, pol.depth(draft.match, cap)), draft.match
        depth = pol.depth("model", cap) if pol is not None else cap
        if not depth:
            return Draft(), "model"
        t0 = time.perf_counter()
        draft = self.drafter.propose(torch.tensor(self._hist + [tok], dtype=torch.int64), depth, self.width)
        if pol is not None:
            pol.observe_drafting(depth, time.perf_counter() - t0)
        return draft, "model"

    def _verify(self, logits: Tensor, tokens: list[int], parents: list[int], draft: Draft):
        """``(path from the root, next token)``; ``tokens``/``parents``: the block (the pending
        token first), ``draft``: its drafted part (node i of the draft is block node i + 1)."""
        logits = logits.float()
        if draft.q is None:  # greedy, or a sample of the target at each node: lossless for fixed drafts
            return follow(logits, tokens, parents, self.sampler.next)
        node, path = 0, [0]
        while True:  # sampled drafts: SpecInfer's multi-step speculative sampling (one trial: Leviathan's rule)
            p = self.sampler.probs(logits[node])
            trials = [i + 1 for i in draft.trials.get(node - 1, [])]  # none at a leaf: the target's own draw
            for c in trials:
                q, t = draft.q[c - 1].to(p), tokens[c]
                if self.sampler.rand() * float(q[t]) < float(p[t]):
                    break
                resid = (p - q).clamp(min=0)
                p = resid / resid.sum() if float(resid.sum()) > 0 else p
            else:
                return path, self.sampler.draw(p)
            path.append(c)
            node = c


def follow(logits: Tensor, tokens: list[int], parents: list[int], choose) -> tuple[list[int], int]:
    """Verification of a fixed draft (generate's and the server's): from the block's root (node 0,
    the pending token) down its tree (``parents[i]`` of node ``i``, -1 at the root), the target's
    own choice ``choose(logits [V]) -> int`` at each node, followed while a child carries it.
    ``(path of nodes from the root, the token chosen after it)``: greedy output stays greedy's and
    a sampler's draws stay its own (lossless), whatever was drafted."""
    children: dict[int, dict[int, int]] = {}
    for i, a in enumerate(parents):
        if a >= 0:
            children.setdefault(a, {}).setdefault(tokens[i], i)
    node, path = 0, [0]
    while True:
        t = choose(logits[node])
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            return path, t
        path.append(nxt)
        node = nxt


def _depth(parents: list[int], i: int) -> int:
    d = 0
    while parents[i] >= 0:
        i, d = parents[i], d + 1
    return d
