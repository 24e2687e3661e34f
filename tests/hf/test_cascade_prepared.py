"""A batched step's attention prepares each call site's decode_cpu call at its first layer and
reuses one state buffer over its layers (``runtime._cascade``); its logits are bitwise those of the
step with neither (every layer through ``attention_state``, a fresh state each), at p = 1 and 2, on
tiny float32 models with alternating sliding windows and softcaps (gemma2), one window
(qwen2, some layers), and none (llama): joins, decoding rows, drafts, a row with no prefix, two
prefixes, rows of different keeps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from treeattn.launch import launch  # noqa: E402


def _steps(kind: str) -> list:
    from treeattn.hf.presets import build_model
    from treeattn.runtime.batch import BatchRunner

    m = build_model(f"tiny-{kind}", None, torch.float32, seed=0)[0]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (200,), generator=g).tolist()
    r = BatchRunner(m, None, 6, prefill_chunk=32)
    r.prefill(0, ids[:90])
    r.prefill(1, ids[100:150])
    out, last = [], {}
    for row, (pid, keep) in enumerate([(0, 90), (0, 60), (1, 50), (None, 0)]):  # joins
        r.open(row, pid, keep)
        out.append(r.run([(row, ids[160 + row : 180 + row])]))
        last[row] = int(out[-1].argmax())
    for step in range(5):  # decoding, drafts of 1-3 tokens verified on some rows
        lines = [(row, [last[row]] * (1 + (row + step) % 3)) for row in range(4)]
        out.append(r.run(lines, [row for row, t in lines if len(t) > 1]))
        at = 0
        for row, t in lines:
            last[row] = int(out[-1][at + len(t) - 1].argmax())
            at += len(t) if len(t) > 1 else 1
            if len(t) > 1:
                r.trim(row, int(r.rows.n[row]) - len(t) + 1)
    return out


def _compare(kind: str) -> None:
    import treeattn.runtime._cascade as cas

    prepared, attend = cas._prepared, cas.RowsStep._attend
    used, made = [], []

    def spy(memo, *a, **kw):
        call = prepared(memo, *a, **kw)
        used.append(call is not None)
        return call

    def none(memo, *a, **kw):
        made.append(1)
        return None

    def plain(self, *a, **kw):  # a fresh state each layer
        for key in [k for k in self._memo if k[0] == "states"]:
            del self._memo[key]
        return attend(self, *a, **kw)

    cas._prepared = spy
    try:
        fast = _steps(kind)
        cas._prepared, cas.RowsStep._attend = none, plain  # every call through attention_state
        slow = _steps(kind)
    finally:
        cas._prepared, cas.RowsStep._attend = prepared, attend
    assert any(used) and made, "the prepared calls were not reached"
    for i, (x, y) in enumerate(zip(fast, slow, strict=True)):
        assert torch.equal(x, y), f"{kind}, rank {dist.get_rank()}: step {i} differs"


def _worker(kinds) -> None:
    for kind in kinds:
        _compare(kind)


@pytest.mark.parametrize("p", [1, 2])
def test_prepared_calls_and_one_state_buffer_keep_the_bits(p):
    launch(_worker, p, (["gemma2", "qwen2-swa", "llama"],), timeout=600)
