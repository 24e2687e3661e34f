"""The one model runner (runtime.runner.ModelRunner) driven directly over a ShardedKVCache, one kind of
step after another (prefill chunks, decode, a token tree, the static step), against transformers'
own forward in float64; and the step kinds that refuse what they cannot do (ALiBi in the static and
the batched step)."""

import pytest
import torch

pytest.importorskip("transformers")

from test_session import spread  # noqa: E402  (tests/hf: transformers' own spread of exact orders)

from treeattn.cache import ShardedKVCache  # noqa: E402
from treeattn.hf.presets import build_model  # noqa: E402
from treeattn.runtime import ModelRunner, Step  # noqa: E402
from treeattn.runtime.inputs import tree_of  # noqa: E402
from treeattn.runtime.steps import Static  # noqa: E402


def _cache(m, B=1):
    cfg = m.config
    return ShardedKVCache(cfg.num_hidden_layers, B, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                          dtype=torch.float64)  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "gemma2"])  # gemma2: windows and softcaps
def test_runner_steps_match_transformers(kind):
    m = build_model(f"tiny-{kind}", None, torch.float64, 0)[0]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.config.vocab_size, (2, 40), generator=g)
    with torch.no_grad():
        ref = m(ids).logits
    r = ModelRunner(m, prefill_chunk=16)  # three prefill chunks of the first 30 tokens
    r.bind(_cache(m, 2))
    with torch.no_grad(), r.treeattn():
        out = [r.prefill(ids[:, :30], torch.full((2,), 30))]
        out += [r.decode(ids[:, t]) for t in range(30, 35)]
        tree = tree_of([-1, 0, 1, 2, 3], 5)  # a chain of the last 5, kept aside
        logits, hidden, stash = r.step(ids[:, 35:], tree, r.cache.seq_lens.clone())
    tol = spread(m)[0]
    assert (torch.stack(out, 1) - ref[:, 29:35]).abs().max() <= tol and (logits - ref[:, 35:]).abs().max() <= tol
    assert r.counters["forwards"] == 2 + 5 + 1 and sorted(stash) == list(range(m.config.num_hidden_layers))
    assert hidden.shape == (2, 5, m.config.hidden_size) and int(r.cache.seq_lens[0]) == 35  # the block not stored


def test_step_kinds_refuse_what_they_cannot_do():
    m = build_model("tiny-llama", None, torch.float64, 0)[0]
    c = _cache(m)
    with pytest.raises(NotImplementedError):
        Step().store(0, None, None)
    st = Static(c, "tree", "auto", None, torch.ones(1, dtype=torch.int64), None, span=8,
                slot=torch.zeros(1, dtype=torch.int64), pos=torch.zeros(1, dtype=torch.int64))  # fmt: skip
    q = torch.zeros(1, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="ALiBi biases in a Static step are not implemented"):
        st.attend(0, q, q, q, None, None, None, torch.ones(4))
