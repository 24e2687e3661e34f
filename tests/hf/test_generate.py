"""End-to-end generation across ranks vs single-process transformers generate."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from treeattn.launch import launch  # noqa: E402

NEW = 24


def tiny(kind: str):
    from treeattn.hf.presets import build_model

    return build_model(f"tiny-{kind}", None, torch.float32, seed=0)[0]


def same_on_all_ranks(t: torch.Tensor) -> bool:
    from treeattn.comm.collectives import all_gather

    return all(torch.equal(x, t) for x in all_gather(t, None))


def reference_tokens(model, ids, new=NEW, **kw):
    # an explicit mask: generate would otherwise infer one from pad_token_id occurrences;
    # by default no EOS stop (random weights): every sequence runs to `new` tokens
    kw = {"eos_token_id": None, "pad_token_id": 0, **kw}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kw)
    return out[:, ids.shape[1] :]


def greedy_worker(prompt_lens):
    from treeattn.decoding import generate

    rank, p = dist.get_rank(), dist.get_world_size()
    models = {k: tiny(k) for k in ("llama", "qwen2")}
    ref64 = {k: copy.deepcopy(m).double() for k, m in models.items()}
    combos = [(k, pl, at, None) for k in models for pl in ("contiguous", "interleaved") for at in ("tree", "ring")]
    # chunked prefill: 16 prompt tokens per rank per step; contiguous placement must run the
    # ranks' chunks in position order (a query needs every earlier key, on every layer)
    combos += [("llama", pl, at, 16) for pl in ("contiguous", "interleaved") for at in ("tree", "ring")]
    for i, (kind, placement, attention, chunk) in enumerate(combos):
        L = prompt_lens[i % len(prompt_lens)] if chunk is None else 150
        m = models[kind]
        ids = torch.randint(0, m.config.vocab_size, (1, L), generator=torch.Generator().manual_seed(L))
        info = {}
        out = generate(
            m, ids, max_new_tokens=NEW, placement=placement, attention=attention, info=info, stop_at_eos=False,
            prefill_chunk=chunk,
        )  # fmt: skip
        case = f"p={p} {kind} {placement} {attention} L={L} prefill_chunk={chunk}"
        assert out.shape == (1, NEW) and same_on_all_ranks(out), case
        if rank == 0:
            ref = reference_tokens(m, ids)
            assert torch.equal(out, ref), f"{case}: {out.tolist()} != {ref.tolist()}"
            # last-step logits: error vs a float64 model <= 2x the single-process float32 error
            full = torch.cat([ids, out[:, :-1]], 1)
            l64 = ref64[kind](full).logits[:, -1]
            l32 = m(full).logits[:, -1].double()
            ours = info["last_logits"].double()
            e_ours, e_pt = (ours - l64).abs().max().item(), (l32 - l64).abs().max().item()
            assert e_ours <= 2 * e_pt + 1e-5, f"{case}: logits err {e_ours:.3g} vs single-process {e_pt:.3g}"


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_greedy_matches_single_process(p):
    # prompts shorter than p, odd lengths, and one long prompt; each (model, placement,
    # attention) combination gets one of them, cycling
    lens = {1: [1, 600, 37, 2], 2: [1, 600, 37, 77], 3: [2, 1, 600, 129], 4: [3, 600, 1, 250]}[p]
    launch(greedy_worker, p, (lens,), timeout=600)


def batch_and_sampling_worker():
    from treeattn.decoding import generate

    rank = dist.get_rank()
    m = tiny("llama")
    lens = torch.tensor([5, 40, 17])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, m.config.vocab_size, (3, 40), generator=g)
    mask = (torch.arange(40)[None, :] < lens[:, None]).long()
    ids = ids * mask  # right padding with id 0
    for placement in ("contiguous", "interleaved"):
        out = generate(m, ids, attention_mask=mask, max_new_tokens=NEW, placement=placement, stop_at_eos=False)
        assert same_on_all_ranks(out)
        if rank == 0:
            for b in range(3):
                ref = reference_tokens(m, ids[b : b + 1, : lens[b]])
                assert torch.equal(out[b : b + 1], ref), f"{placement} prompt {b}: {out[b].tolist()} != {ref.tolist()}"
    # EOS: stop where model.generate stops. Make a token each sequence emits mid-way its EOS
    # (the generation config's ids, as a user's trained model has them): a sequence that
    # stopped is padded, generation ends when all have stopped.
    free = [reference_tokens(m, ids[b : b + 1, : lens[b]])[0] for b in range(3)]
    eos = [int(free[0][6]), int(free[1][4]), int(free[2][3])]
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = eos, 0
    for attention in ("tree", "ring"):
        out = generate(m, ids, attention_mask=mask, max_new_tokens=NEW, attention=attention, prefill_chunk=4)
        assert same_on_all_ranks(out)
        if rank == 0:
            for b in range(3):
                ref = m.generate(
                    ids[b : b + 1, : lens[b]], attention_mask=mask[b : b + 1, : lens[b]], max_new_tokens=NEW,
                    do_sample=False,
                )[:, lens[b] :]  # fmt: skip
                n = ref.shape[1]
                assert torch.equal(out[b : b + 1, :n], ref), f"EOS {attention} prompt {b}: {out[b]} != {ref[0]}"
                assert bool((out[b, n:] == 0).all()), f"EOS {attention} prompt {b}: not padded after EOS: {out[b]}"
            first = [min([i for i, t in enumerate(f.tolist()) if t in eos] or [NEW - 1]) + 1 for f in free]
            assert out.shape[1] == max(first) < NEW, (out.shape, first)
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = 2, None
    # sampling: same tokens on every rank and across two runs; other seed differs
    kw = dict(max_new_tokens=NEW, stop_at_eos=False, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    a = generate(m, ids[:1], **kw)
    b = generate(m, ids[:1], **kw)
    c = generate(m, ids[:1], **{**kw, "seed": 8})
    assert same_on_all_ranks(a) and torch.equal(a, b) and not torch.equal(a, c)
    t = generate(m, ids[:1], max_new_tokens=8, do_sample=True, typical_p=0.9, eta_cutoff=1e-3, seed=1)
    # a prompt plus max_new_tokens beyond the model's positions: the same clear error on every rank
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(m, ids[:1], max_new_tokens=m.config.max_position_embeddings)
    assert same_on_all_ranks(t)
    with pytest.raises(ValueError, match="right padding"):
        generate(m, ids, attention_mask=mask.flip(1), max_new_tokens=2)


def test_batch_and_sampling():
    launch(batch_and_sampling_worker, 3, timeout=600)


def test_cli_generate_tiny_preset():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "treeattn", "generate", "--nproc", "2", "--preset", "tiny-qwen2", "--prompt-len", "50",
         "--max-new-tokens", "8", "--compare-single"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "identical to single-process model.generate" in r.stderr and "time to first token" in r.stderr
    assert r.stdout.startswith("tokens[0]: [")  # stdout: the output only


def test_cli_generate_local_model_dir(tmp_path):
    import subprocess
    import sys

    m = tiny("llama")
    m.save_pretrained(tmp_path)  # safetensors
    assert any(f.suffix == ".safetensors" for f in tmp_path.iterdir())
    r = subprocess.run(
        [sys.executable, "-m", "treeattn", "generate", "--nproc", "2", "--model", str(tmp_path), "--prompt-ids",
         "5,9,2,7,1", "--max-new-tokens", "6", "--attention", "ring", "--compare-single"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "identical to single-process model.generate" in r.stderr
