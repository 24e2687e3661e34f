"""A row of a batched step gets the same bits whatever shares its step: ``BatchRunner`` at p = 1
on tiny float32 models with packed linears and head dim 64 (so the shared-prefix pass of long
chunks takes the prefill kernel where this CPU has it), with and without a sliding window. A
request's logits alone equal, bitwise, its logits joining beside another long prompt, decoding
beside other rows and drafts (what makes batching leave greedy answers unchanged), under a
sliding window too, and verifying its own answer as a draft in one line."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from test_cascade_wide import spy  # noqa: E402

from treeattn.hf.linear import pack_linears  # noqa: E402
from treeattn.ops._decode_cpu import kernel_features  # noqa: E402
from treeattn.runtime.batch import PLACED_MAX, WIDE_LINE, BatchRunner  # noqa: E402

KERNEL = "prefill512" in kernel_features() and os.environ.get("TREEATTN_PREFILL_KERNEL") != "0"


def model(window: bool, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    kw = dict(hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=kv_heads, head_dim=64, vocab_size=512)  # fmt: skip
    torch.manual_seed(0)
    m = MistralForCausalLM(MistralConfig(sliding_window=40, **kw)) if window else LlamaForCausalLM(LlamaConfig(**kw))
    m = m.float().eval()
    pack_linears(m)
    return m


@pytest.mark.parametrize("window,kv_heads", [(False, 2), (True, 2), (False, 6), (False, 3)])
def test_a_rows_bits_do_not_depend_on_its_step(monkeypatch, window, kv_heads):
    """GQA groups of 3, and of 1 (MHA) and 2: a row's 1-3 query rows per KV head alone, 4 or
    more in a batched step's calls."""
    taken = spy(monkeypatch)
    m = model(window, kv_heads)
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 512, (n,), generator=g).tolist()  # noqa: E731
    r = BatchRunner(m, max_batch=4, prefill_chunk=64)
    doc = ids(150)
    r.prefill(0, doc)
    prompt, other, third = ids(PLACED_MAX + 9), ids(PLACED_MAX + 4), ids(WIDE_LINE + 2)  # third: placed, wide
    n = WIDE_LINE + 1  # the draft below: a line as long as a prompt chunk that takes the kernel

    # alone: the prompt (a chunk), then n tokens one at a time
    r.open(0, 0, len(doc))
    alone = [r.run([(0, prompt)])[0]]
    toks = [int(alone[0].argmax())]
    for _ in range(n):
        alone.append(r.run([(0, toks[-1:])])[0])
        toks.append(int(alone[-1].argmax()))
    r.close(0)
    assert taken == [len(prompt) if KERNEL else 0] * 2, taken  # 2 layers: only the prompt chunk's tokens

    # batched: joining beside another long prompt and a short one, decoding beside them and a draft
    taken.clear()
    for row in range(4):
        r.open(row, 0, len(doc))
    got = r.run([(1, other), (0, prompt), (2, third), (3, ids(2))])
    assert torch.equal(got[1], alone[0])
    assert taken == [len(prompt) + len(other) + len(third) if KERNEL else 0] * 2, taken  # a call a layer
    nxt = [int(x) for x in got.argmax(-1)]
    for i in range(n):
        d = ids(3)
        got = r.run([(2, [nxt[2]] + d), (0, toks[i : i + 1]), (1, [nxt[1]]), (3, [nxt[3]])], full=[2])
        assert torch.equal(got[4], alone[i + 1]), f"decode step {i}"  # row 2's line has 4 logits
        assert int(got[4].argmax()) == toks[i + 1]
        r.trim(2, int(r.rows.n[2]) - len(d))  # its draft rejected
        nxt = [None, int(got[5].argmax()), int(got[0].argmax()), int(got[6].argmax())]
    for row in range(4):
        r.close(row)

    # its own answer as a draft: one line, logits at every token, each token's rows bounded by
    # its own position (decode_cpu: a row's bits do not depend on the other rows' bounds)
    r.open(0, 0, len(doc))
    assert torch.equal(r.run([(0, prompt)])[0], alone[0])
    taken.clear()
    got = r.run([(0, toks[:n])], full=[0])
    assert taken == [], taken  # a line with logits at every token: the decode path, however long
    for i in range(n):
        assert torch.equal(got[i], alone[i + 1]), f"draft token {i}"


def test_no_token_split_where_rotary_frequencies_follow_the_input():
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    assert BatchRunner(LlamaForCausalLM(LlamaConfig(**kw))).runner.split_ok
    for kind in ("dynamic", "longrope"):
        extra = {"original_max_position_embeddings": 64, "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}
        scaling = {"rope_type": kind, "factor": 2.0, **(extra if kind == "longrope" else {})}
        assert not BatchRunner(LlamaForCausalLM(LlamaConfig(rope_scaling=scaling, **kw))).runner.split_ok, kind


def test_a_token_and_its_longest_draft_are_one_placed_line():
    from treeattn.serve.plan import MAX_DRAFT

    assert 1 + MAX_DRAFT <= PLACED_MAX


@pytest.mark.parametrize("window", [False, True])
def test_rows_reading_a_prefix_to_other_depths_get_their_bits_alone(window):
    """Rows that read 150, 90 and 31 tokens of one prefix (a longer conversation beside new
    questions): one pass over the prefix, each token bounded by its own keep, so each row's
    logits are the ones it gets alone, prompt chunk and decode steps."""
    m = model(window)
    g = torch.Generator().manual_seed(2)
    ids = lambda n: torch.randint(3, 512, (n,), generator=g).tolist()  # noqa: E731
    r = BatchRunner(m, max_batch=3, prefill_chunk=64)
    r.prefill(0, ids(150))
    keeps, prompts = (150, 90, 31), (ids(WIDE_LINE + 3), ids(4), ids(PLACED_MAX + 5))
    alone = []
    for row, (keep, p) in enumerate(zip(keeps, prompts, strict=True)):
        r.open(row, 0, keep)
        out = [r.run([(row, p)])[0]]
        for _ in range(3):
            out.append(r.run([(row, [int(out[-1].argmax())])])[0])
        alone.append(out)
        r.close(row)
    for row, keep in enumerate(keeps):
        r.open(row, 0, keep)
    got = r.run([(row, p) for row, p in enumerate(prompts)])
    for i in range(4):
        for row in range(3):
            assert torch.equal(got[row], alone[row][i]), (row, i)
        if i < 3:
            got = r.run([(row, [int(alone[row][i].argmax())]) for row in range(3)])
