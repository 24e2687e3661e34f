"""treeattn.runtime.Session: a stateful property test (seeded random sequences of extend, chain and
tree steps, keep and rewind) on tiny float64 models at p = 1, 2, 3, both placements, Tree and
Ring. After every call the logits equal single-process transformers run fresh on the
committed history (plus the step's ancestors), and every rank's shard holds exactly the
committed tokens, each at the slot its placement gives it, with the K/V transformers computes."""

import random

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from treeattn.hf.model import cache_kw  # noqa: E402
from treeattn.launch import launch  # noqa: E402


def spread(model) -> tuple[float, float]:
    """Tolerances for logits and K/V: 2x the largest difference transformers itself shows
    between two exact orders of the same float64 computation (a 40-token forward, and the
    same tokens one at a time through its DynamicCache). Its RMSNorm computes in float32
    even in a float64 model, so these are float32-sized, not float64-sized."""
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, **cache_kw(model, DynamicCache()), use_cache=True)
        cache, logits = DynamicCache(), []  # no config: every layer keeps every token
        for t in range(40):
            o = model(ids[:, t : t + 1], **cache_kw(model, cache), use_cache=True)
            cache = o.past_key_values
            logits.append(o.logits[:, -1])
    e_logits = (torch.stack(logits, 1) - full.logits).abs().max().item()
    e_kv = max(
        max((a.keys - b.keys).abs().max().item(), (a.values - b.values).abs().max().item())
        for a, b in zip(full.past_key_values.layers, cache.layers, strict=True)
    )
    return 2 * max(e_logits, 1e-12), 2 * max(e_kv, 1e-12)


def tiny64(kind: str):
    from treeattn.hf.presets import build_model

    return build_model(f"tiny-{kind}", None, torch.float64, seed=0)[0]


class Reference:
    """The expected state of a session, computed independently: per sequence the committed
    ids and the owner rank of every position (the placement rules written out plainly)."""

    def __init__(self, model, placement: str, p: int, block: int = 1):
        self.m, self.placement, self.p, self.block = model, placement, p, block
        self.tol, self.kv_tol = spread(model)
        self.ids: list[list[int]] = []
        self.owner: list[list[int]] = []

    def _next_owner(self, b: int) -> int:
        pos = len(self.owner[b])
        if self.placement == "interleaved":
            return (pos // self.block) % self.p
        counts = [self.owner[b].count(r) for r in range(self.p)]
        return counts.index(min(counts))  # the rank with the fewest tokens, lowest on ties

    def extend(self, rows: list[list[int]]) -> None:
        if not any(self.ids):
            self.ids, self.owner = [[] for _ in rows], [[] for _ in rows]
        padded = max(len(r) for r in rows)
        empty = not any(self.ids)
        for b, r in enumerate(rows):
            if empty and padded > 1:  # a block on an empty session: the prompt split of the padded block
                if self.placement == "contiguous":
                    sizes = [padded // self.p + (q < padded % self.p) for q in range(self.p)]
                    own = [q for q in range(self.p) for _ in range(sizes[q])][: len(r)]
                else:
                    own = [(i // self.block) % self.p for i in range(len(r))]
                self.owner[b] += own
            else:
                for _ in r:
                    self.owner[b].append(self._next_owner(b))
            self.ids[b] += r

    def keep(self, rows: list[list[int]]) -> None:
        for b, r in enumerate(rows):
            for t in r:
                self.owner[b].append(self._next_owner(b))
                self.ids[b].append(t)

    def rewind(self, n: int) -> None:
        self.ids = [x[:n] for x in self.ids]
        self.owner = [x[:n] for x in self.owner]

    @torch.no_grad()
    def logits(self, seq: list[int]) -> torch.Tensor:
        return self.m(torch.tensor([seq])).logits[0, -1]

    @torch.no_grad()
    def keys(self, seq: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = DynamicCache()  # no config: sliding-window layers keep every token too
        self.m(torch.tensor([seq]), **cache_kw(self.m, cache), use_cache=True)
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def check_shards(s, ref: Reference, case: str) -> None:
    """Every rank's shard holds exactly the committed tokens at its placement's slots."""
    rank = dist.get_rank()
    c = s.cache
    assert s.tokens.shape[0] == len(ref.ids), case
    for b, seq in enumerate(ref.ids):
        assert s.tokens[b, : len(seq)].tolist() == seq, f"{case}: history {s.tokens[b].tolist()} != {seq}"
        mine = [i for i, o in enumerate(ref.owner[b]) if o == rank]
        n = int(c.kv_lens[b])
        assert c.positions[b, :n].tolist() == mine, f"{case}: seq {b} rank {rank} holds {c.positions[b, :n]}, {mine}"
        assert c.counts[b].tolist() == [ref.owner[b].count(r) for r in range(ref.p)], case
        if mine:
            for layer, (k, v) in enumerate(ref.keys(seq)):
                got_k, got_v = c.k[layer][b, :, :n], c.v[layer][b, :, :n]
                err = max((got_k - k[:, mine]).abs().max().item(), (got_v - v[:, mine]).abs().max().item())
                assert err <= ref.kv_tol, f"{case}: seq {b} layer {layer}: K/V off by {err:.3g}"


def random_tree(rng: random.Random, T: int) -> list[int]:
    return [-1] + [rng.randrange(-1, i) for i in range(1, T)]


def run_case(kind, placement, attention, seed, ops, B=1, ragged=False, chunk=4, max_step=6, prefill=None):
    from treeattn.cache import auto_block
    from treeattn.runtime import Session

    p = dist.get_world_size()
    rng = random.Random(seed)
    m = tiny64(kind)
    V = m.config.vocab_size
    prefill = prefill or attention  # by default the prefill of the same kind as the decoding
    block = rng.choice([None, 1, 3])  # None: chosen by the first call's length
    s = Session(m, placement=placement, attention=attention, prefill_chunk=chunk, prefill=prefill, block=block)
    ref = Reference(m, placement, p)
    case = f"p={p} {kind} {placement} {attention} prefill={prefill} block={block} seed={seed}"
    pending = None  # (tokens per sequence, parents) of the last step

    def toks(T):
        return [[rng.randrange(V) for _ in range(T)] for _ in range(B)]

    # the first call: a prompt (ragged: right padded)
    rows = toks(rng.randrange(2, 30))
    if ragged:
        rows = [r[: rng.randrange(1, len(r) + 1)] for r in rows]
    L = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (L - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows])
    out = s.extend(ids, attention_mask=mask if ragged else None)
    ref.block = s.cache.placement.block
    assert ref.block == (block or auto_block(L, p)), case
    ref.extend(rows)
    for b in range(B):
        assert (out[b] - ref.logits(ref.ids[b])).abs().max() <= ref.tol, f"{case}: first extend"
    check_shards(s, ref, case)
    for i in range(ops):
        op = rng.choice(["extend", "chain", "tree", "tree", "keep", "keep", "rewind"])
        what = f"{case} op {i} {op}"
        if op == "keep" and pending is None:
            op = "chain"
        if op == "extend":
            T = rng.choice([1, 1, 2, 3, 9, 17])
            rows = toks(T)
            out = s.extend(torch.tensor(rows))
            ref.extend(rows)
            pending = None
            for b in range(B):
                e = (out[b] - ref.logits(ref.ids[b])).abs().max().item()
                assert e <= ref.tol, f"{what} T={T}: logits off by {e:.3g}"
            check_shards(s, ref, what)
        elif op in ("chain", "tree"):
            T = rng.randrange(1, max_step + 1)
            parents = random_tree(rng, T) if op == "tree" else None
            rows = toks(T)
            out, hidden = s.step(torch.tensor(rows), parents, return_hidden=True)
            assert out.shape == (B, T, V) and hidden.shape == (B, T, m.config.hidden_size), what
            par = parents or list(range(-1, T - 1))
            for t in range(T):
                anc, a = [], t
                while a >= 0:
                    anc.append(a)
                    a = par[a]
                for b in range(B):
                    seq = ref.ids[b] + [rows[b][j] for j in reversed(anc)]
                    e = (out[b, t] - ref.logits(seq)).abs().max().item()
                    assert e <= ref.tol, f"{what} parents={par} token {t}: logits off by {e:.3g}"
            pending = (rows, par)
        elif op == "keep":
            rows, par = pending
            leaf = rng.randrange(-1, len(par))  # -1: keep nothing
            path = []
            while leaf >= 0:
                path.append(leaf)
                leaf = par[leaf]
            path.reverse()
            s.keep(path)
            ref.keep([[r[j] for j in path] for r in rows])
            pending = None
            check_shards(s, ref, f"{what} path={path}")
        else:
            n = rng.randrange(0, len(s) + 1)
            s.rewind(n)
            ref.rewind(n)
            pending = None
            check_shards(s, ref, f"{what} n={n}")
            if n == 0:  # an empty session takes a new prompt
                rows = toks(rng.randrange(1, 12))
                s.extend(torch.tensor(rows))
                ref.extend(rows)
                check_shards(s, ref, what)
        assert len(s) == max(len(x) for x in ref.ids), what


def session_worker(seed0):
    p = dist.get_world_size()
    cases = [(k, pl, at) for k in ("llama", "qwen2") for pl in ("contiguous", "interleaved") for at in ("tree", "ring")]
    for i, (kind, placement, attention) in enumerate(cases):
        run_case(kind, placement, attention, seed0 + i, ops=14, chunk=(4, None, 7)[i % 3])
    # a batch of two, and a ragged (right-padded) batch whose later blocks run as chain steps
    run_case("llama", "interleaved", "tree", seed0 + 50, ops=10, B=2)
    run_case("qwen2", "contiguous", "ring" if p > 1 else "tree", seed0 + 51, ops=10, B=2, ragged=True)
    # sliding windows (the block's mask and kv_start per query) and Gemma-2's softcaps
    # (steps longer than the window of 16: the window also masks inside the block)
    run_case("mistral", "interleaved", "tree", seed0 + 60, ops=10, chunk=8, max_step=20)
    run_case("gemma2", "contiguous", "ring", seed0 + 61, ops=10, chunk=8, max_step=20)
    # the other prefill under windows and softcaps, and auto (per chunk, by bytes: both occur)
    run_case("mistral", "contiguous", "tree", seed0 + 62, ops=8, chunk=8, max_step=20, prefill="ring")
    run_case("gemma2", "interleaved", "ring", seed0 + 63, ops=8, chunk=8, max_step=20, prefill="tree")
    run_case("llama", "interleaved", "tree", seed0 + 64, ops=12, chunk=3, prefill="auto")


@pytest.mark.parametrize("p", [1, 2, 3])
def test_session_random_sequences_match_transformers(p):
    launch(session_worker, p, (100 * p,), timeout=900)


def same_on_all_ranks(msg: str) -> bool:
    b = torch.zeros(600, dtype=torch.int64)
    raw = list(msg.encode()[:600])
    b[: len(raw)] = torch.tensor(raw, dtype=torch.int64)
    got = [torch.zeros_like(b) for _ in range(dist.get_world_size())]
    dist.all_gather(got, b)
    return all(torch.equal(g, b) for g in got)


def bad_calls_worker():
    from treeattn.runtime import Session

    rank, p = dist.get_rank(), dist.get_world_size()
    m = tiny64("llama")
    V = m.config.vocab_size
    ref = Reference(m, "contiguous", p)
    s = Session(m, placement="contiguous", prefill_chunk=4, max_length=60)
    g = torch.Generator().manual_seed(5)

    def t(n):
        return torch.randint(0, V, (1, n), generator=g)

    s.rewind(0)  # a fresh session: nothing to forget, nothing to reuse
    assert len(s) == 0 and s.common_prefix([1, 2, 3]) == 0
    rows = t(20)
    s.extend(rows)
    ref.extend(rows.tolist())

    def refused(call, match: str) -> None:
        before = s.tokens
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert same_on_all_ranks(str(e.value)), f"ranks raised different errors: {e.value}"
        assert torch.equal(s.tokens, before), f"{match}: the history changed"
        check_shards(s, ref, f"after the refused call ({match})")

    refused(lambda: s.keep([0]), r"keep\(\) needs a step\(\) first")
    refused(lambda: s.step(t(3), [-1, 2, 0]), r"parents\[1\] = 2: a token's parent must be an earlier token")
    refused(lambda: s.step(t(2), [-1, -2]), r"parents\[1\] = -2")
    refused(lambda: s.step(t(2), [-1]), r"parents must be 2 ints")
    refused(lambda: s.rewind(21), r"rewind\(n\) needs an int 0 <= n <= len\(session\) = 20, got 21")
    refused(lambda: s.rewind(-1), r"rewind\(n\) needs")
    refused(lambda: s.rewind(torch.tensor([3])), r"rewind\(n\) needs an int")
    refused(lambda: s.rewind(3.0), r"rewind\(n\) needs an int")
    s.rewind(torch.tensor(20))  # a 0-d integer tensor (or a numpy integer) is an int: nothing forgotten
    assert len(s) == 20
    refused(lambda: s.extend(t(41)), r"would take a sequence to 61 tokens, but the session holds at most 60")
    refused(lambda: s.step(t(41)), r"would take a sequence to 61 tokens")
    refused(lambda: s.extend(torch.tensor([[V]])), r"must lie in \[0, 512\) \(the model's vocabulary\)")
    refused(lambda: s.extend(t(2).float()), r"must be integer token ids")
    refused(lambda: s.extend(torch.zeros(2, 3, dtype=torch.int64)), r"ids has batch 2, but the session holds 1")
    refused(lambda: s.extend(t(3), attention_mask=torch.tensor([[0, 1, 1]])), r"right padding")
    refused(lambda: s.extend(t(2), attention_mask=[[1, 1]]), r"attention_mask must be a \[B, T\] tensor, got list")
    refused(lambda: s.step(t(2), 5), r"parents must be a sequence of 2 ints or None, got int")
    if p > 1:  # the same call with other arguments on one rank
        refused(lambda: s.extend(torch.tensor([[rank]])), r"ranks disagree on token ids checksum")
        other = torch.tensor([[2, 0]]) if rank else torch.tensor([[0, 1]])  # equal sums of (id + 1) * index
        refused(lambda: s.extend(other), r"ranks disagree on token ids checksum")
        refused(lambda: s.rewind(rank), r"ranks disagree on arguments checksum")
        refused(lambda: s.step(t(3) * 0 + 7, [-1, 0, 0] if rank else [-1, 0, 1]), r"ranks disagree on arguments")
    # a tree step, then bad paths: the step stays keepable
    block = t(4)
    s.step(block, [-1, 0, 0, 2])
    refused(lambda: s.keep([2]), r"not a root-to-leaf path of the last step: token 2 hangs off 0, not -1")
    refused(lambda: s.keep([0, 1, 3]), r"token 3 hangs off 2, not 1")
    refused(lambda: s.keep([0, 4]), r"path must be indices in \[0, 4\)")
    refused(lambda: s.keep(None), r"path must be a list of indices into the last step, got NoneType")
    if p > 1:
        refused(lambda: s.keep([0, 2] if rank else [0, 1]), r"ranks disagree on arguments checksum")
    s.keep([0, 2, 3])
    ref.keep([[block[0, j].item() for j in (0, 2, 3)]])
    check_shards(s, ref, "kept after refused keeps")
    refused(lambda: s.keep([0]), r"keep\(\) needs a step\(\) first \(and each step can be kept once\)")
    # the cache still answers exactly: a chain step over the untouched history
    nxt = t(3)
    out = s.step(nxt)
    for i in range(3):
        e = (out[0, i] - ref.logits(ref.ids[0] + nxt[0, : i + 1].tolist())).abs().max().item()
        assert e <= ref.tol, f"after the refused calls: logits off by {e:.3g}"
    # bad construction: the same error on every rank
    for kw, match in (
        (dict(placement="zigzag"), "placement must be one of"),
        (dict(attention="flash"), "attention must be one of"),
        (dict(prefill="ulysses"), "prefill must be one of"),
        (dict(strategy="fastest"), "strategy must be one of"),
        (dict(prefill_chunk=0), "prefill_chunk must be an int >= 1 or None"),
        (dict(max_length=m.config.max_position_embeddings + 1), "max_length must be an int in"),
        (dict(max_length=60 + rank), "ranks disagree on max_length"),
    ):
        if "disagree" in match and p == 1:
            continue
        with pytest.raises(ValueError, match=match) as e:
            Session(m, **kw)
        assert same_on_all_ranks(str(e.value))


@pytest.mark.parametrize("p", [1, 3])
def test_session_bad_calls_fail_alike_and_change_nothing(p):
    launch(bad_calls_worker, p, timeout=300)


def test_auto_block():
    from treeattn.cache import auto_block

    # 1 for p = 1 and short prompts; a power of two with at least 4 blocks per rank, at most 256
    assert [auto_block(T, 2) for T in (1, 7, 8, 16, 40, 1500, 2048, 4006, 10**6)] == [1, 1, 1, 2, 4, 128, 256, 256, 256]
    assert auto_block(10**6, 1) == 1 and auto_block(100, 3) == 8


def test_attention_switch_restores_the_models_own(monkeypatch):
    """A session runs treeattn's attention and leaves the model's own in place between calls
    (first call through transformers, later calls by the fast path): plain forwards of the
    same model in between give transformers' logits; a user who chose treeattn keeps it."""
    from treeattn.hf.attention import ATTN_NAME
    from treeattn.runtime import Session

    m = tiny64("llama")
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    own = m.config._attn_implementation
    from transformers import AttentionInterface

    seen, real = [], AttentionInterface._global_mapping[ATTN_NAME]
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_NAME, lambda *a, **k: seen.append(1) or real(*a, **k))
    s = Session(m)
    with torch.no_grad():
        want = m(ids).logits[0, -1]
    for i in range(3):
        n = len(seen)
        logits = s.extend(ids[:, 11:] if i else ids[:, :11], check=False)
        assert len(seen) > n, "treeattn's attention did not run"
        assert m.config._attn_implementation == own, m.config._attn_implementation
        n = len(seen)
        with torch.no_grad():
            plain = m(ids).logits[0, -1]
        assert len(seen) == n and torch.equal(plain, want), "a plain forward between calls ran treeattn"
        if i == 1:  # the whole of ids: the session's logits are the model's
            torch.testing.assert_close(logits[0], want, rtol=1e-9, atol=1e-9)
    m.set_attn_implementation(ATTN_NAME)
    s.extend(ids[:, :1], check=False)
    assert m.config._attn_implementation == ATTN_NAME
