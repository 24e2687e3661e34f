"""Speculative decoding over a Session: greedy output identical to non-speculative greedy
decoding for every drafter (prompt lookup, a draft model, chains and trees, and an oracle
that drafts the right continuation with planted mistakes, so every accepted length occurs),
at p = 1, 2, 3, both placements, Tree and Ring; after every step the sharded cache is the one
sequential decoding builds. Sampling: the distribution of the first tokens matches the
model's (and a verifier that skips the rejection rule fails the same check)."""

import copy
import random

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from test_session import Reference, check_shards, tiny64  # noqa: E402

from treeattn.launch import launch  # noqa: E402

NEW = 16
ORACLE = 40  # tokens the oracle drafter runs for: enough steps for every accepted length


def greedy_ref(m, ids, new=NEW):
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                     eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[:, ids.shape[1] :]


class Oracle:
    """Drafts the known greedy continuation, with a wrong token planted at a random depth half
    the time; with width > 1 the right chain and a wrong one, in random order."""

    def __init__(self, prompt_len: int, ref: list[int], V: int, seed: int):
        self.n0, self.ref, self.V, self.rng = prompt_len, ref, V, random.Random(seed)

    def propose(self, history, k, width):
        from treeattn.decoding.prompt_lookup import _trie

        at = len(history) - self.n0  # generated tokens so far, the pending one included
        good = self.ref[at : at + k]
        if good and self.rng.random() < 0.5:
            j = self.rng.randrange(len(good))
            good = good[:j] + [(good[j] + 1) % self.V] + good[j + 1 :]
        chains = [good] if good else []
        if width > 1 and good:
            chains.append([(good[0] + 2) % self.V] + good[1:])
            self.rng.shuffle(chains)
        return _trie(chains)


def spec_worker(seed0):
    from treeattn.decoding import generate
    from treeattn.decoding.sampler import Sampler
    from treeattn.decoding.speculative import Speculator
    from treeattn.runtime import Session

    p = dist.get_world_size()
    rng = random.Random(seed0)
    cases = [(k, pl, at) for k in ("llama", "qwen2") for pl in ("contiguous", "interleaved") for at in ("tree", "ring")]
    for i, (kind, placement, attention) in enumerate(cases):
        m = tiny64(kind)
        V = m.config.vocab_size
        base = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(seed0 + i))
        ids = torch.cat([base, base[:, :6], base, base[:, :4]], 1)  # repeats: prompt lookup finds n-grams
        ref = greedy_ref(m, ids, ORACLE)
        case = f"p={p} {kind} {placement} {attention}"
        # through generate: every drafter, chains and trees
        drafts = [("prompt-lookup", {}, 1), ("prompt-lookup", {}, 3), ("draft", {"draft_model": tiny64("qwen2")}, 1),
                  ("draft", {"draft_model": copy.deepcopy(m)}, 2)]  # fmt: skip
        spec, kw, width = drafts[i % len(drafts)]
        info = {}
        fixed = spec == "draft" and width == 2  # acceptance asserted below; else the adaptive policy
        out = generate(m, ids, max_new_tokens=NEW, stop_at_eos=False, placement=placement, attention=attention,
                       speculate=spec, tree_width=width, num_draft_tokens=rng.choice([1, 3, 4]), info=info,
                       adaptive_draft=not fixed, **kw)  # fmt: skip
        assert torch.equal(out, ref[:, :NEW]), f"{case} {spec} width {width}: {out.tolist()} != {ref.tolist()}"
        if spec == "draft" and width == 2:  # the draft model is the target itself
            assert info["mean_accepted_length"] > 1.5, f"{case}: an identical draft model accepts: {info}"
        # an oracle with planted mistakes, stepped by hand: the cache after every step
        s = Session(m, placement=placement, attention=attention, prefill_chunk=5)
        R = Reference(m, placement, p)
        logits = s.extend(ids)
        R.block = s.cache.placement.block  # the block the prompt's length chose
        R.extend(ids.tolist())
        width = 1 + i % 2
        sp = Speculator(Oracle(ids.shape[1], ref[0].tolist(), V, seed0 + i), 4, width, Sampler())
        got = [int(logits.argmax())]
        while len(got) < ORACLE:
            new = sp.step(s, got[-1], ORACLE - len(got))
            R.keep([[got[-1]] + new[:-1]])  # committed: the pending token and the accepted drafts
            check_shards(s, R, f"{case} oracle width {width} after {len(got)} tokens")
            got += new
        assert got == ref[0].tolist(), f"{case} oracle: {got} != {ref[0].tolist()}"
        acc = sp.stats.committed
        assert max(acc) >= 3 and len(set(acc)) > 1, f"{case}: accepted lengths {acc} do not vary"


@pytest.mark.parametrize("p", [1, 2, 3])
def test_speculative_greedy_is_exact(p):
    launch(spec_worker, p, (10 * p,), timeout=900)


def _biased_verify(self, logits, tokens, parents, draft):
    """The classic mistake, on a chain: after a rejection, sample the target again instead of
    the residual max(0, p - q) (and accept with probability p / q as usual)."""
    q = draft.q
    for i in range(1, len(tokens)):
        p = self.sampler.probs(logits[i - 1].float())
        if self.sampler.rand() * float(q[i - 1, tokens[i]]) >= float(p[tokens[i]]):
            return list(range(i)), self.sampler.draw(p)
    return list(range(len(tokens))), self.sampler.next(logits[-1].float())


_REAL_VERIFY = []


def _biased_tree_verify(self, logits, tokens, parents, draft):
    """Multi-step speculative sampling that forgets to move to the residual after a rejected
    trial: every trial is tested against the target's own distribution."""
    if draft.q is None:  # nothing drafted (the last token): the real rule
        return _REAL_VERIFY[0](self, logits, tokens, parents, draft)
    node, path = 0, [0]
    while True:
        p = self.sampler.probs(logits[node].float())
        trials = [i + 1 for i in draft.trials.get(node - 1, [])]
        for c in trials:
            if self.sampler.rand() * float(draft.q[c - 1, tokens[c]]) < float(p[tokens[c]]):
                break
        else:
            return path, self.sampler.draw(p)
        path.append(c)
        node = c


SAMPLES = 1200
NOISE = 0.5
TV_LIMIT = 0.09  # total variation over the 16 (t1, t2) cells; 1200 unbiased samples land near 0.03


def test_sampling_is_lossless(monkeypatch):
    """The first two sampled tokens (top-k 4: 16 cells) follow the model's own distribution
    with every drafter (a sampled draft chain: the rejection rule; a sampled draft tree of 3
    first tokens: multi-step speculative sampling; prompt lookup: sample and match); a
    verifier with a planted bias fails the same threshold."""
    from treeattn.decoding import generate
    from treeattn.decoding.speculative import Speculator

    m = tiny64("llama")
    d = copy.deepcopy(m)  # a draft model that mostly agrees with the target: the residual matters
    with torch.no_grad():
        w = d.get_output_embeddings().weight
        w += NOISE * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0), dtype=w.dtype)
    base = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([base, base], 1)  # repeated: prompt lookup drafts too
    K = 4

    def warped(logits):
        v, i = logits.topk(K)
        return i.tolist(), torch.softmax(v, -1).tolist()

    exact = {}
    with torch.no_grad():
        for a, pa in zip(*warped(m(ids).logits[0, -1]), strict=True):
            for b, pb in zip(*warped(m(torch.cat([ids, torch.tensor([[a]])], 1)).logits[0, -1]), strict=True):
                exact[(a, b)] = pa * pb

    def tv(**kw) -> float:
        counts = {}
        for seed in range(SAMPLES):  # fixed drafts: every step verifies one
            out = generate(m, ids, max_new_tokens=4, do_sample=True, top_k=K, seed=seed, stop_at_eos=False,
                           adaptive_draft=False, **kw)  # fmt: skip
            key = tuple(out[0, :2].tolist())
            counts[key] = counts.get(key, 0) + 1
        cells = set(counts) | set(exact)
        return 0.5 * sum(abs(counts.get(c, 0) / SAMPLES - exact.get(c, 0.0)) for c in cells)

    chain = dict(speculate="draft", draft_model=d, num_draft_tokens=2)
    got = {
        "draft chain (rejection rule)": tv(**chain),
        "draft tree (multi-step speculative sampling)": tv(
            speculate="draft", draft_model=d, num_draft_tokens=2, tree_width=3
        ),
        "prompt lookup (sample and match)": tv(speculate="prompt-lookup", num_draft_tokens=2),
    }
    _REAL_VERIFY[:] = [Speculator._verify]
    monkeypatch.setattr(Speculator, "_verify", _biased_verify)
    biased = {"chain, resampling the target": tv(**chain)}
    monkeypatch.setattr(Speculator, "_verify", _biased_tree_verify)
    biased["tree, no residual"] = tv(speculate="draft", draft_model=d, num_draft_tokens=2, tree_width=3)
    print(f"\ntotal variation from the model's distribution: {got}; biased verifiers {biased}")
    assert all(v <= TV_LIMIT for v in got.values()), got
    assert all(v > TV_LIMIT for v in biased.values()), f"a planted bias goes unnoticed: {biased}"


def bad_worker():
    from test_session import same_on_all_ranks

    from treeattn.decoding import generate
    from treeattn.hf.presets import build_model

    m = tiny64("llama")
    other_vocab = build_model("small-llama", None, torch.float64)[0]
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    cases = [
        (dict(speculate="bogus"), r"speculate must be one of \('prompt-lookup', 'draft'\) or None"),
        (dict(speculate="prompt-lookup", num_draft_tokens=0), "num_draft_tokens must be an int >= 1, got 0"),
        (dict(speculate="prompt-lookup", tree_width=0), "tree_width must be an int >= 1, got 0"),
        (dict(speculate="draft"), r'rank 0: speculate="draft" needs a draft_model \(on rank 0 of the group\)'),
        (dict(speculate="draft", draft_model=other_vocab), r"vocabulary \(4096 tokens\) differs from the target's"),
        (dict(draft_model=m), 'draft_model is given but speculate is not "draft"'),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            generate(m, ids, max_new_tokens=4, **kw)
        assert same_on_all_ranks(str(e.value)), str(e.value)
    with pytest.raises(ValueError, match=r"speculative decoding runs one sequence \(B = 1\), got a batch of 2") as e:
        generate(m, ids.expand(2, -1), max_new_tokens=4, speculate="prompt-lookup")
    assert same_on_all_ranks(str(e.value))
    # a drafter that fails on rank 0 fails every rank (nobody waits in the broadcast)
    from treeattn.decoding.sampler import Sampler
    from treeattn.decoding.speculative import Speculator
    from treeattn.runtime import Session

    class Broken:
        def propose(self, history, k, width):
            raise MemoryError("the draft model ran out of memory")

    s = Session(m)
    s.extend(ids)
    sp = Speculator(Broken(), 3, 1, Sampler())
    with pytest.raises(RuntimeError, match="the drafter failed on rank 0 of the group: MemoryError: the draft model"):
        sp.step(s, 5, 10)
    # the group is still in lockstep: a speculative run after the refusals is exact, and its
    # last logits are those plain decoding chose the last token from
    info, plain = {}, {}
    out = generate(m, ids, max_new_tokens=6, stop_at_eos=False, speculate="draft", draft_model=m, info=info,
                   adaptive_draft=False)  # fmt: skip
    assert torch.equal(out, greedy_ref(m, ids, 6))
    generate(m, ids, max_new_tokens=6, stop_at_eos=False, info=plain)
    assert info["target_forwards"] < 5 and (info["last_logits"] - plain["last_logits"]).abs().max() < 1e-9


def test_speculative_bad_arguments_fail_alike():
    launch(bad_worker, 2, timeout=300)


def test_cli_speculate_reports_acceptance():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "treeattn", "generate", "--nproc", "2", "--preset", "tiny-qwen2", "--prompt-len", "30",
         "--max-new-tokens", "12", "--speculate", "draft", "--draft-model", "tiny-qwen2", "--num-draft-tokens", "3",
         "--tree-width", "2", "--compare-single", "--fixed-draft"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "identical to single-process model.generate" in r.stderr, r.stderr
    # the draft model is the target (same preset, same seed): every draft is accepted
    assert "speculative (draft, 3 draft tokens, tree width 2): mean accepted length 3." in r.stderr, r.stderr
    assert "acceptance per draft position 1.00 1.00 1.00" in r.stderr, r.stderr
    c = subprocess.run(
        [sys.executable, "-m", "treeattn", "generate", "--nproc", "2", "--preset", "tiny-llama", "--prompt-ids",
         "5,9,2,7,1,4,4,8", "--max-new-tokens", "6", "--penalty-alpha", "0.6", "--top-k", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert c.returncode == 0, c.stderr
    from treeattn.hf.presets import build_model

    m = build_model("tiny-llama", None, torch.float32)[0]
    want = contrastive_reference(m, torch.tensor([[5, 9, 2, 7, 1, 4, 4, 8]]), 6, 0.6, 4)
    assert c.stdout.strip() == f"tokens[0]: {want}", (c.stdout, want)


def contrastive_reference(m, ids, new: int, alpha: float, k: int) -> list[int]:
    """The published rule written out plainly, one process, everything recomputed each step:
    candidates = the k likeliest next tokens; score = (1 - alpha) * p(v) - alpha * max over
    every earlier token j of cos(h_v, h_j), h = the decoder's last hidden state."""
    seq = ids[0].tolist()
    dec = m.get_decoder()
    with torch.no_grad():
        for _ in range(new):
            H = dec(torch.tensor([seq], device=ids.device)).last_hidden_state[0]
            p = torch.softmax(m.get_output_embeddings()(H[-1]), -1)
            top_p, top_i = p.topk(k)
            scores = []
            for pv, v in zip(top_p.tolist(), top_i.tolist(), strict=True):
                hv = dec(torch.tensor([seq + [v]], device=ids.device)).last_hidden_state[0, -1]
                sim = torch.nn.functional.cosine_similarity(hv[None], H, dim=-1).max().item()
                scores.append((1 - alpha) * pv - alpha * sim)
            seq.append(top_i.tolist()[max(range(k), key=lambda i: (scores[i], -i))])
    return seq[ids.shape[1] :]


def contrastive_worker():
    from treeattn.decoding import generate

    p = dist.get_world_size()
    for i, (kind, placement, attention) in enumerate(
        [("llama", "interleaved", "tree"), ("qwen2", "contiguous", "ring"), ("mistral", "contiguous", "tree")]
    ):
        m = tiny64(kind)
        ids = torch.randint(0, 512, (1, 14 + i), generator=torch.Generator().manual_seed(i))
        alpha, k = (0.6, 4) if i != 1 else (0.3, 3)
        ref = contrastive_reference(m, ids, 12, alpha, k)
        out = generate(m, ids, max_new_tokens=12, stop_at_eos=False, placement=placement, attention=attention,
                       penalty_alpha=alpha, top_k=k, prefill_chunk=4)  # fmt: skip
        case = f"p={p} {kind} {placement} {attention} alpha={alpha} k={k}"
        assert out[0].tolist() == ref, f"{case}: {out[0].tolist()} != {ref}"
        assert ref != greedy_ref(m, ids, 12)[0].tolist(), f"{case}: the penalty changes nothing"


@pytest.mark.parametrize("p", [1, 3])
def test_contrastive_search_matches_reference(p):
    launch(contrastive_worker, p, timeout=600)
