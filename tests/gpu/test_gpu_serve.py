"""GPU suite: `treeattn serve --device cuda` at p = 1 answers one streamed request with the
tokens of model.generate on the GPU. Skipped without CUDA or without the 'serve' extra."""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU suite: needs a CUDA device")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from server import Server  # noqa: E402


def test_serve_streams_on_cuda():
    from treeattn.hf.presets import build_model

    m = build_model("tiny-llama", None, torch.float32, 0)[0].cuda()
    ids = [5, 9, 33, 2 + 7, 100, 5, 9, 33]
    x = torch.tensor([ids], device="cuda")
    ref = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    s = Server("--preset", "tiny-llama", "--nproc", "1", "--device", "cuda")
    try:
        ev = list(s.events("/v1/completions", {"model": "tiny-llama", "prompt": ids, "max_tokens": 12, "temperature": 0}))
        assert ev[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in ev[:-1] if e.get("choices"))
        assert [int(t) for t in re.findall(r"<(\d+)>", text)] == [t for t in ref if t != 2], s.output()
        status, health = s.request("GET", "/health")
        assert status == 200, health
    finally:
        code, _, left = s.stop()
    assert not left
