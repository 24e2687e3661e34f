"""A Session step at p = 1 reads nothing from the device: the model lives on the "meta" device
(shapes only: any read of a device value, .item(), bool(), .tolist(), .cpu(), raises), the token
ids come from the host, and prefill, decode steps, a speculative token tree, keep and rewind
run through. What the host needs (lengths, slots, positions) comes from the cache's host
metadata. The CUDA kernels' own guard: tests/ops/test_no_host_sync.py (FakeTensorMode)."""

import pytest
import torch

pytest.importorskip("transformers")

from treeattn.hf.presets import build_model  # noqa: E402
from treeattn.runtime import Session  # noqa: E402


def test_meta_reads_raise():
    """The harness: every kind of device-to-host read of a meta tensor raises."""
    x = torch.zeros(3, device="meta")
    for read in (lambda: bool(x.any()), lambda: x.cpu(), lambda: x.tolist(), lambda: int(x.sum()), lambda: x.item()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])  # full, sliding window, window + softcaps
@pytest.mark.parametrize("attention", ["tree", "ring"])
def test_session_step_reads_nothing_from_the_device(kind, attention):
    m = build_model(f"tiny-{kind}", None, torch.float32, 0)[0].to("meta")
    s = Session(m, attention=attention, prefill_chunk=16)
    host = lambda n: torch.zeros(1, n, dtype=torch.int64)  # noqa: E731
    logits = s.extend(host(40), check=False)  # chunked prefill (3 chunks), windows of 16 in mistral/gemma2
    assert logits.device.type == "meta" and logits.shape == (1, m.config.vocab_size)
    for _ in range(3):
        s.extend(host(1), check=False)  # decode steps
    lg = s.step(host(4), [-1, 0, 0, 2], check=False)  # a token tree
    assert lg.shape == (1, 4, m.config.vocab_size)
    s.keep([0, 2, 3], check=False)
    assert len(s) == 40 + 3 + 3
    s.rewind(len(s) - 2, check=False)  # keep all but the last two
    s.extend(host(1), check=False)
    assert len(s) == 40 + 3 + 3 - 2 + 1
