"""GPU suite: the Session's decode step as CUDA graphs (``cuda_graph=True``, runtime._graph) on
one GPU: greedy ``generate`` gives ``model.generate``'s tokens on tiny Llama, Mistral (sliding
window) and Qwen2 models; a Session's replayed steps give the eager steps' logits (Gemma-2:
windows and softcaps) across spans, cache reallocations, a rewind and a kept speculative step. Skipped
without CUDA; the same static step runs uncaptured on CPU in tests/hf/test_graph_decode.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_gpu_hf import hf_generate, tiny_cuda  # noqa: E402

from treeattn.decoding import generate  # noqa: E402
from treeattn.runtime import Session, _graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU suite: needs a CUDA device")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])  # gemma2's near-ties: the logits test below
def test_graph_generate_matches_transformers(kind, monkeypatch):
    monkeypatch.setattr(_graph, "QUANTUM", 16)  # several spans in 40 tokens
    m = tiny_cuda(kind)
    ids = torch.randint(0, m.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4)).cuda()
    ref = hf_generate(m, ids, new=40)
    calls, step = [], _graph.StaticDecode.__call__
    monkeypatch.setattr(_graph.StaticDecode, "__call__", lambda self, tok: calls.append(self) or step(self, tok))
    out = generate(m, ids, max_new_tokens=40, stop_at_eos=False, cuda_graph=True, prefill_chunk=16)
    assert torch.equal(out, ref), f"{kind}: {out.tolist()} != {ref.tolist()}"
    assert len(calls) == 39 and calls[-1].captures >= 2 and calls[-1].graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_steps_are_the_eager_steps(dtype, monkeypatch):
    monkeypatch.setattr(_graph, "QUANTUM", 16)
    m = tiny_cuda("gemma2", dtype)
    eager, graph = Session(m, prefill_chunk=16), Session(m, prefill_chunk=16, cuda_graph=True)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, m.config.vocab_size, (2, 21), generator=g)
    for s in (eager, graph):
        s.extend(prompt)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    for i in range(50):
        if i == 20:
            for s in (eager, graph):
                s.rewind(len(s) - 11)
        if i == 30:
            t = torch.randint(0, m.config.vocab_size, (2, 3), generator=g)
            for s in (eager, graph):
                s.step(t, [-1, 0, 1])
                s.keep([0, 1])
        tok = torch.randint(0, m.config.vocab_size, (2, 1), generator=g)
        torch.testing.assert_close(graph.extend(tok), eager.extend(tok), **tol)
    st = graph.fw.static
    assert st.calls == 50 and st.captures >= 3 and st.graphs
    assert torch.equal(graph.tokens, eager.tokens)
