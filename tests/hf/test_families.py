"""Model families beyond Llama: sliding-window layers (Mistral, Qwen2 ``use_sliding_window``,
Gemma-2/3 alternating) and Gemma-2 attention-logit softcapping. Greedy tokens across ranks
must equal single-process transformers ``model.generate`` on prompts longer than the
window, for both placements, Tree and Ring attention, with chunked prefill. Families that
cannot be exact are refused with their name and the reason."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from treeattn.launch import launch  # noqa: E402

NEW = 12
FAMILIES = ("mistral", "qwen2-swa", "gemma2", "gemma3")  # tiny-* presets, sliding window 16


def tiny(kind: str):
    from treeattn.hf.presets import build_model

    return build_model(f"tiny-{kind}", None, torch.float32, seed=0)[0]


def reference_tokens(model, ids, new=NEW):
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[:, ids.shape[1] :]


def same_on_all_ranks(t: torch.Tensor) -> bool:
    from treeattn.comm.collectives import all_gather

    return all(torch.equal(x, t) for x in all_gather(t, None))


def families_worker():
    from treeattn.decoding import generate

    rank, p = dist.get_rank(), dist.get_world_size()
    models = {k: tiny(k) for k in FAMILIES}
    combos = [(pl, at) for pl in ("contiguous", "interleaved") for at in ("tree", "ring")]
    refs, prompts = {}, {}
    for i, kind in enumerate(FAMILIES):
        m = models[kind]
        L = 45 + 7 * i + p  # longer than the window (16), different per family and world size
        ids = prompts[kind] = torch.randint(0, m.config.vocab_size, (1, L), generator=torch.Generator().manual_seed(L))
        if rank == 0:
            refs[kind] = reference_tokens(m, ids)
        for j, (placement, attention) in enumerate(combos):
            chunk = (5, None, 8, 3)[(i + j) % 4]  # chunked prefill (tokens per rank per step) or all at once
            info = {}
            out = generate(m, ids, max_new_tokens=NEW, placement=placement, attention=attention, stop_at_eos=False,
                           prefill_chunk=chunk, info=info)  # fmt: skip
            case = f"p={p} {kind} {placement} {attention} L={L} prefill_chunk={chunk}"
            assert out.shape == (1, NEW) and same_on_all_ranks(out), case
            if rank == 0:
                assert torch.equal(out, refs[kind]), f"{case}: {out.tolist()} != {refs[kind].tolist()}"
                if j == (p - 1) % len(combos):  # last-step logits vs a float64 model: <= 2x float32's error
                    full = torch.cat([ids, out[:, :-1]], 1)
                    l64 = copy.deepcopy(m).double()(full).logits[:, -1]
                    e_pt = (m(full).logits[:, -1].double() - l64).abs().max().item()
                    e_ours = (info["last_logits"].double() - l64).abs().max().item()
                    assert e_ours <= 2 * e_pt + 1e-5, f"{case}: logits err {e_ours:.3g} vs single-process {e_pt:.3g}"
    if rank == 0 and p == 2:  # the prompts really exercise the window and the softcap
        nowin = copy.deepcopy(models["mistral"])
        nowin.config.sliding_window = None
        assert not torch.equal(reference_tokens(nowin, prompts["mistral"]), refs["mistral"]), "window changes nothing"
        nocap = copy.deepcopy(models["gemma2"])
        for layer in nocap.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        full = torch.cat([prompts["gemma2"], refs["gemma2"]], 1)
        gap = (nocap(full).logits - models["gemma2"](full).logits).abs().max().item()
        assert gap > 1e-2, f"the softcap changes the logits by only {gap:.3g}"
    if p == 3:
        # a right-padded batch: each sequence has its own window position
        m = models["gemma2"]
        lens = torch.tensor([50, 21])
        ids = torch.randint(1, 512, (2, 50), generator=torch.Generator().manual_seed(5))
        mask = (torch.arange(50)[None, :] < lens[:, None]).long()
        for attention in ("tree", "ring"):
            out = generate(m, ids * mask, attention_mask=mask, max_new_tokens=NEW, attention=attention,
                           stop_at_eos=False, prefill_chunk=6)  # fmt: skip
            assert same_on_all_ranks(out)
            if rank == 0:
                for b in range(2):
                    ref = reference_tokens(m, ids[b : b + 1, : lens[b]])
                    assert torch.equal(out[b : b + 1], ref), f"batch {attention} row {b}: {out[b]} != {ref[0]}"
    if p == 2:
        # Mistral's default config (window 4096) on a prompt longer than the window
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, initializer_range=0.2)  # fmt: skip
        assert cfg.sliding_window == 4096
        torch.manual_seed(0)
        m = MistralForCausalLM(cfg).eval()
        L = 4096 + 40
        ids = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(1))
        out = generate(m, ids, max_new_tokens=6, placement="contiguous", stop_at_eos=False, prefill_chunk=1024)
        assert same_on_all_ranks(out)
        if rank == 0:
            ref = reference_tokens(m, ids, 6)
            assert torch.equal(out, ref), f"default Mistral: {out.tolist()} != {ref.tolist()}"
        # a refused model: the same clear error on every rank, before any collective work
        from transformers import LlamaConfig, LlamaForCausalLM

        m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=64, attention_dropout=0.1))  # fmt: skip
        m.train()
        with pytest.raises(ValueError, match=r"Llama \(llama\): the model is in training mode"):
            generate(m, torch.tensor([[1, 2, 3]]), max_new_tokens=2)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_families_match_single_process(p):
    launch(families_worker, p, timeout=600)


def test_unsupported_reason():
    from transformers import (
        BloomConfig,
        FalconConfig,
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        Llama4TextConfig,
        LlamaConfig,
        MistralConfig,
        MptConfig,
        Qwen2Config,
        T5Config,
    )

    from treeattn.hf import unsupported_reason

    for cfg in (
        MistralConfig(),
        Qwen2Config(use_sliding_window=True),
        Gemma2Config(),
        Gemma3TextConfig(),
        LlamaConfig(),
        MptConfig(),  # ALiBi: hf.alibi (tests/hf/test_alibi.py)
        BloomConfig(),
    ):
        assert unsupported_reason(cfg) is None, type(cfg).__name__
    assert MistralConfig().sliding_window == 4096
    refused = {
        "GPT-OSS (gpt_oss): its attention has learned sink logits": GptOssConfig(),
        "Llama-4 (llama4_text): its chunked attention": Llama4TextConfig(),
        "Gemma-3 (gemma3_text): its attention is bidirectional": Gemma3TextConfig(use_bidirectional_attention=True),
        "falcon: its ALiBi position biases": FalconConfig(alibi=True),
        "t5: it is an encoder-decoder model": T5Config(),
    }
    for start, cfg in refused.items():
        why = unsupported_reason(cfg)
        assert why is not None and why.startswith(start) and why.endswith("cannot run it exactly"), why
    assert unsupported_reason(LlamaConfig(attention_dropout=0.1)) is None  # eval mode: dropout is off
    assert "training mode" in unsupported_reason(LlamaConfig(attention_dropout=0.1), training=True)


def test_cli_refuses_unsupported_family(capsys, tmp_path):
    from transformers import GptOssConfig

    from treeattn.cli import main

    GptOssConfig(num_hidden_layers=1).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    code = main(["generate", "--nproc", "2", "--model", str(tmp_path), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("treeattn generate: GPT-OSS (gpt_oss): its attention has learned sink logits"), err
