"""The static decode step (runtime._graph), the body of a CUDA-graph decode step, run eagerly on CPU:
the same logits as the eager step across spans, cache reallocations, rewinds, kept speculative
steps and batches; the eager step where it does not apply; no device read (the meta device).
The captured graphs themselves: tests/gpu/test_gpu_hf.py."""

import pytest
import torch

pytest.importorskip("transformers")

from treeattn.hf.presets import build_model  # noqa: E402
from treeattn.runtime import Session, _graph  # noqa: E402


def _pair(kind, dtype=torch.float64):
    m = build_model(f"tiny-{kind}", None, dtype, 0)[0]
    eager, static = Session(m, prefill_chunk=16), Session(m, prefill_chunk=16, cuda_graph=True)
    return m, eager, static


def test_span_of():
    assert [_graph.span_of(n) for n in (1, 256, 257, 2047, 2048, 2049, 9000)] == [256, 256, 512, 2048, 2048, 2304, 9216]
    assert _graph.span_of(300, limit=280) == 300 and _graph.span_of(260, limit=400) == 400  # never below n
    for n in range(1, 5000, 7):  # at most an eighth (or a quantum) more
        s = _graph.span_of(n)
        assert n <= s < n + max(_graph.QUANTUM, n // 8 + 1) and s % _graph.QUANTUM == 0


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "qwen2-swa"])  # full; windows; window + softcaps
def test_static_step_is_the_eager_step(kind, monkeypatch):
    monkeypatch.setattr(_graph, "QUANTUM", 8)  # many spans and several reallocations in 60 tokens
    from treeattn.cache import ShardedKVCache

    eager_store = ShardedKVCache.store_decode

    def store(self, *a):  # a replayed graph would keep the host's slot of its capture
        assert not getattr(self, "_static_probe", False), "a static step stored at a host slot"
        return eager_store(self, *a)

    monkeypatch.setattr(ShardedKVCache, "store_decode", store)
    m, eager, static = _pair(kind)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, m.config.vocab_size, (2, 21), generator=g)
    for s in (eager, static):
        s.extend(prompt)
    static.cache._static_probe = True
    versions = set()
    for i in range(40):
        if i == 15:  # back over a span boundary, then on
            for s in (eager, static):
                s.rewind(len(s) - 9)
        if i == 25:  # a kept speculative step (a chain of 3, 2 kept)
            t = torch.randint(0, m.config.vocab_size, (2, 3), generator=g)
            for s in (eager, static):
                s.step(t, [-1, 0, 1])
                s.keep([0, 1])
        tok = torch.randint(0, m.config.vocab_size, (2, 1), generator=g)
        a, b = eager.extend(tok), static.extend(tok)
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        versions.add(static.cache.version)
    assert static.fw.static.calls == 40 and len(versions) > 1  # every step static; the cache reallocated
    assert torch.equal(static.tokens, eager.tokens)
    for L in range(static.cache.num_layers):  # the same valid K/V in the cache
        for x, y in zip(eager.cache.local(L), static.cache.local(L), strict=True):
            n = int(eager.cache.kv_lens[0])
            assert torch.equal(x[..., :n, :] if x.ndim == 4 else x, y[..., :n, :] if y.ndim == 4 else y)


def test_static_step_not_taken_where_it_does_not_apply():
    """A ragged batch (sequences of different lengths) decodes eagerly; as do contrastive
    search's kept hidden states (hidden_store)."""
    m, eager, static = _pair("llama")
    ids = torch.randint(0, m.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 9:] = 0
    for s in (eager, static):
        s.extend(ids, mask)
    tok = torch.tensor([[5], [7]])
    torch.testing.assert_close(static.extend(tok), eager.extend(tok), rtol=1e-12, atol=1e-12)
    assert static.fw.static.calls == 0


def test_generate_with_static_steps_gives_the_same_tokens(monkeypatch):
    from treeattn.decoding import generate

    calls, step = [], _graph.StaticDecode.__call__
    monkeypatch.setattr(_graph.StaticDecode, "__call__", lambda self, tok: calls.append(1) or step(self, tok))

    m = build_model("tiny-gemma2", None, torch.float64, 0)[0]
    ids = torch.randint(0, m.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    info = {}
    want = generate(m, ids, max_new_tokens=12, stop_at_eos=False)
    got = generate(m, ids, max_new_tokens=12, stop_at_eos=False, cuda_graph=True, info=info)  # uncaptured on CPU
    assert torch.equal(got, want) and len(calls) == 11


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_static_step_reads_nothing_from_the_device(kind):
    """The captured region must not read the device (a read breaks the capture): the static
    step on the meta device, where every read raises."""
    m = build_model(f"tiny-{kind}", None, torch.float32, 0)[0].to("meta")
    s = Session(m, prefill_chunk=16, cuda_graph=True)
    s.extend(torch.zeros(1, 40, dtype=torch.int64), check=False)
    for _ in range(3):
        out = s.extend(torch.zeros(1, 1, dtype=torch.int64), check=False)
    assert out.device.type == "meta" and s.fw.static.calls == 3


def test_static_step_up_to_max_length_and_a_new_batch():
    """Spans stop at what the session may hold (max_length), the limit still raises as before;
    a session emptied and started on another batch size gets a fresh static step."""
    m = build_model("tiny-llama", None, torch.float64, 0)[0]
    eager, static = Session(m, max_length=40), Session(m, max_length=40, cuda_graph=True)
    ids = torch.randint(0, m.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(6))
    for s in (eager, static):
        s.extend(ids)
    for i in range(10):
        tok = torch.tensor([[i + 3]])
        torch.testing.assert_close(static.extend(tok), eager.extend(tok), rtol=1e-12, atol=1e-12)
    assert len(static) == 40 and static.cache.cap <= 40
    with pytest.raises(ValueError, match="max_length"):
        static.extend(torch.tensor([[1]]))
    first = static.fw.static
    for s in (eager, static):
        s.rewind(0)
        s.extend(torch.cat([ids, ids]))  # B = 2 on an empty session: a new cache
    assert static.fw.static is not first and static.cache.B == 2
    tok = torch.tensor([[4], [5]])
    torch.testing.assert_close(static.extend(tok), eager.extend(tok), rtol=1e-12, atol=1e-12)
    assert static.fw.static.calls == 1
