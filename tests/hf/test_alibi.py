"""ALiBi families (BLOOM, MPT: treeattn.hf.alibi) at p = 2 and 3 against single-process
transformers: greedy tokens identical, Tree and Ring, both placements, whole and chunked
prefill, with the weights whole, split (tensor_parallel) and, for BLOOM, the heads split too
(tpa = p); prompt-lookup speculation (a chain and a token tree) and contrastive search; last
logits within 2x single-process float32's error against float64. In-process: the bias is
what makes the answer (zeroed slopes give other tokens), the layers still run plain
transformers calls, and what is not implemented (the batched server step, MPT's heads split)
is refused by name."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from test_tensor_parallel import reference_tokens  # noqa: E402

from treeattn.launch import launch  # noqa: E402

NEW = 10


def tiny(kind: str, dtype=torch.float32):
    from treeattn.hf.presets import build_model

    return build_model(f"tiny-{kind}", None, dtype, seed=0)[0]


def alibi_worker(base_named: str) -> None:
    from treeattn.decoding import generate
    from treeattn.hf.tensor_parallel import tensor_parallel

    rank, p = dist.get_rank(), dist.get_world_size()
    cases = [("bloom", "interleaved", "tree", None, 1), ("bloom", "contiguous", "ring", 8, 1),
             ("bloom", "interleaved", "ring", 8, p), ("bloom", "contiguous", "tree", None, p),
             ("mpt", "interleaved", "ring", 8, 0), ("mpt", "contiguous", "tree", None, 1)]  # fmt: skip
    for i, (kind, placement, attention, chunk, tp) in enumerate(cases):
        whole = tiny(kind)
        m = whole if tp == 0 else tensor_parallel(copy.deepcopy(whole), tpa=tp)  # tp 0: weights whole
        if kind == "bloom" and tp == p:  # this rank's heads' rows of the fused Q/K/V only
            attn = m.transformer.h[0].self_attention
            assert attn.num_heads * p == 6 and attn.query_key_value.out_features == 3 * attn.num_heads * attn.head_dim
        L = (37, 64, 45, 90, 64, 37)[i]
        ids = torch.randint(0, 512, (1, L), generator=torch.Generator().manual_seed(L))
        info = {}
        out = generate(m, ids, max_new_tokens=NEW, placement=placement, attention=attention, prefill_chunk=chunk,
                       stop_at_eos=False, info=info)  # fmt: skip
        case = f"p={p} {kind} {placement} {attention} chunk={chunk} {'whole' if tp == 0 else f'tp tpa={tp}'}"
        ref = reference_tokens(whole, ids, NEW)
        assert torch.equal(out, ref), f"{case}: {out.tolist()} != {ref.tolist()}"
        full = torch.cat([ids, out[:, :-1]], 1)
        l64 = copy.deepcopy(whole).double()(full).logits[:, -1]
        e_pt = (whole(full).logits[:, -1].double() - l64).abs().max().item()
        e_ours = (info["last_logits"].double() - l64).abs().max().item()
        assert e_ours <= 2 * e_pt + 1e-5, f"{case}: logits err {e_ours:.3g} vs single-process {e_pt:.3g}"
    whole = tiny("bloom")
    ids = torch.tensor([[7, 8, 9, 10, 11, 12] * 6])
    ref = reference_tokens(whole, ids, NEW)
    for width, m in ((1, whole), (2, tensor_parallel(copy.deepcopy(whole)))):
        info = {}
        out = generate(m, ids, max_new_tokens=NEW, speculate="prompt-lookup", tree_width=width, adaptive_draft=False,
                       stop_at_eos=False, info=info)  # fmt: skip
        assert torch.equal(out, ref), f"p={p} bloom speculation width {width}: {out.tolist()} != {ref.tolist()}"
        assert info["target_forwards"] < NEW, info
    w64 = tiny("mpt", torch.float64)
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=NEW, penalty_alpha=0.6, top_k=4, stop_at_eos=False, prefill_chunk=4)
    alone = [dist.new_group([r]) for r in range(p)][rank]  # (every rank creates every group)
    single = generate(w64, ids, group=alone, **kw)
    assert torch.equal(generate(w64, ids, **kw), single), f"p={p} mpt contrastive search"
    with pytest.raises(ValueError, match="fused Q/K/V"):  # on every rank
        tensor_parallel(tiny("mpt"), tpa=p)
    # a checkpoint of the base model's tensor names (bigscience's BLOOM files: "h.0...", no "transformer.")
    from treeattn.hf import load_split

    m = load_split(base_named, tpa=p)[0]
    whole = tiny("bloom")
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(30))
    out = generate(m, ids, max_new_tokens=NEW, stop_at_eos=False)
    assert torch.equal(out, reference_tokens(whole, ids, NEW)), f"p={p} bloom loaded from base names"


@pytest.fixture(scope="module")
def base_named(tmp_path_factory) -> str:
    """tiny-bloom saved with its base model's names, as bigscience's checkpoints are."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("bloom-base-names")
    tiny("bloom").save_pretrained(d)
    sd = load_file(d / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
    return str(d)


@pytest.mark.parametrize("p", [2, 3])
def test_alibi_families_match_single_process(p, base_named):
    launch(alibi_worker, p, (base_named,), timeout=900)


def test_bloom_slow_but_exact_and_mpt_positions():
    """BLOOM with pretraining_tp 2 and slow_but_exact sums its output projection in slices and
    without its bias, as transformers does; MPT takes ``max_seq_len`` positions, no more."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from treeattn.decoding import generate
    from treeattn.hf.presets import PRESETS
    from treeattn.runtime import Session

    cfg = AutoConfig.for_model("bloom", **PRESETS["tiny-bloom"][1], pretraining_tp=2, slow_but_exact=True)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in m.transformer.h:
            layer.self_attention.dense.bias.normal_(0, 1.0)  # a bias that matters: transformers leaves it out
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(40))
    info = {}
    out = generate(m, ids, max_new_tokens=NEW, stop_at_eos=False, info=info)
    assert torch.equal(out, reference_tokens(m, ids, NEW))
    full = torch.cat([ids, out[:, :-1]], 1)
    l64 = copy.deepcopy(m).double()(full).logits[:, -1]
    e_pt = (m(full).logits[:, -1].double() - l64).abs().max().item()
    assert (info["last_logits"].double() - l64).abs().max().item() <= 2 * e_pt + 1e-5
    cfg = AutoConfig.for_model("mpt", **{**PRESETS["tiny-mpt"][1], "max_seq_len": 32})
    mpt = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="32 positions"):
        generate(mpt, ids[:, :30], max_new_tokens=5)
    with pytest.raises(ValueError, match=r"max_length must be an int in \[1, 32\]"):
        Session(mpt, max_length=40)


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_the_bias_makes_the_answer(kind, monkeypatch):
    import treeattn.hf.alibi as A
    from treeattn.decoding import generate

    m = tiny(kind)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(64))
    ref = reference_tokens(m, ids, NEW)
    before = m(ids).logits
    assert torch.equal(generate(m, ids, max_new_tokens=NEW, stop_at_eos=False), ref)
    assert torch.equal(m(ids).logits, before)  # outside a treeattn step the layers run their own forward
    for layer in A.alibi_layers(m):  # the slopes zeroed: other tokens (the tests above would see a lost bias)
        layer._treeattn_slopes = None
    zero = {"bloom": "alibi_slopes", "mpt": "mpt_slopes"}[kind]
    real = getattr(A, zero)
    monkeypatch.setattr(A, zero, lambda *a: real(*a) * 0)
    assert not torch.equal(generate(m, ids, max_new_tokens=NEW, stop_at_eos=False), ref)


def test_mpt_slopes_are_transformers():
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from treeattn.hf.alibi import mpt_slopes

    for n in (1, 2, 3, 4, 6, 8, 12):
        assert torch.equal(mpt_slopes(n), -build_mpt_alibi_tensor(n, 2)[:, 0, 0]), n


def test_cli_generate_bloom_loaded_split(tmp_path):
    import subprocess
    import sys

    tiny("bloom").save_pretrained(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "treeattn", "generate", "--nproc", "2", "--model", str(tmp_path), "--tp", "2", "--tpa",
         "2", "--prompt-len", "40", "--max-new-tokens", "6", "--ignore-eos", "--compare-single"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "identical to single-process model.generate" in r.stderr, r.stderr


def test_server_runs_alibi_families():
    """``treeattn serve`` with an ALiBi family (tiny MPT, p = 2): requests at once, each answer
    single-process transformers' greedy tokens (the batched step biases rows, prefixes and a
    line's own tokens from their global positions; tests/hf/test_batch.py holds its logits)."""
    import concurrent.futures as cf
    import re

    from server import Server
    from treeattn.hf.presets import build_model

    m = build_model("tiny-mpt", None, torch.float32, 0)[0]
    s = Server("--preset", "tiny-mpt", "--nproc", "2", "--prefill-chunk", "8", "--max-batch", "3")
    try:
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, 500, (L,), generator=g).tolist() for L in (30, 30, 12)]
        prompts[1][:20] = prompts[0][:20]  # a shared beginning: the second reads the first's prefix

        def ask(ids):
            return s.request("POST", "/v1/completions", {"model": "tiny-mpt", "prompt": ids, "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True})  # fmt: skip

        ask(prompts[0])  # cached first
        with cf.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(ask, prompts))
        for ids, (st, body) in zip(prompts, got, strict=True):
            assert st == 200, body
            x = torch.tensor([ids])
            ref = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                             eos_token_id=None)[0, len(ids) :].tolist()  # fmt: skip
            assert [int(t) for t in re.findall(r"<(\d+)>", body["choices"][0]["text"])] == ref, (ids, body)
        assert got[1][1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        s.kill()
