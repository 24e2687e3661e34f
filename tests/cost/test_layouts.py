"""treeattn.cost.layouts: a whole model's decode step per layout of weights and K/V, checked
against closed forms written out here, and the shape of its answers (what fits, what wins
where)."""

import pytest

from treeattn.cost.layouts import LAYOUTS, MODELS, Shape, step, table
from treeattn.cost.presets import PRESETS

C = PRESETS["dgx-h100"]
M8, M70, M405 = MODELS["llama-3.1-8b"], MODELS["llama-3.1-70b"], MODELS["llama-3.1-405b"]


def test_bytes_per_rank_by_hand():
    L, h, d, e = 32, 4096, 128, 2
    # KVP only: every weight on every rank (the vocabulary-parallel head read by slices, held
    # whole); the sequence over all 8
    s = step(C, M8, 8, 131072, "kvp")
    per_layer = h * d * (32 + 2 * 8) * e + (32 * d * h + 3 * h * 14336) * e
    assert s.weight_bytes == L * per_layer + 128256 * h * e + 128256 * h * e
    assert s.kv_bytes == L * 8 * (131072 // 8) * 2 * d * e and s.kvp == 8 and s.tpa == 1
    # TP only on 8 = the KV heads: everything / 8, the sequence whole on each rank (one KV head)
    s = step(C, M8, 8, 131072, "tp")
    assert s.weight_bytes == M8.params() * e / 8 and s.kv_bytes == L * 1 * 131072 * 2 * d * e
    # TP only on 16 > the KV heads: each KV head (and its cache) held twice; Q/K/V over 8 only
    s16 = step(C, M8, 16, 131072, "tp")
    assert s16.tpa == 8 and s16.kv_bytes == s.kv_bytes and s16.weight_bytes > M8.params() * e / 16
    # KVP x TP on 16: TPA 8, KVP 2: half the K/V of TP only
    h16 = step(C, M8, 16, 131072, "kvp x tp")
    assert (h16.tpa, h16.kvp) == (8, 2) and h16.kv_bytes == s.kv_bytes / 2


def test_helix_traffic_does_not_grow_with_the_context():
    a, b = step(C, M70, 64, 131072, "kvp x tp", tpa=8), step(C, M70, 64, 1048576, "kvp x tp", tpa=8)
    assert a.comm_s == pytest.approx(b.comm_s) and b.kv_bytes == 8 * a.kv_bytes


def test_what_fits_and_what_wins():
    assert step(C, M70, 8, 131072, "kvp").fits is False  # 141 GB of weights on an 80 GB GPU
    assert all(step(C, M405, 8, 131072, lay).fits is False for lay in LAYOUTS)  # 810 GB over 8 GPUs
    assert step(C, M405, 64, 1048576, "kvp x tp").fits and not step(C, M405, 64, 1048576, "tp").fits
    # one node: TP only beats KVP only (weights dominate); long contexts over many ranks: KVP x TP wins
    assert step(C, M8, 8, 131072, "tp").seconds < step(C, M8, 8, 131072, "kvp").seconds
    for m in (M8, M70):
        best = min(LAYOUTS, key=lambda lay: step(C, m, 64, 1048576, lay).seconds)
        assert best == "kvp x tp", m.name
    # a model of one KV head (MLA-like, as SGLang's DCP targets): TP duplicates its cache on every
    # rank, so splitting the sequence too loses a little on short contexts and wins on long ones
    mla = Shape("one-KV-head 70B", 80, 8192, 64, 1, 128, 28672, 128256)
    short = step(C, mla, 8, 2048, "kvp x tp").seconds / step(C, mla, 8, 2048, "tp").seconds
    long = step(C, mla, 8, 262144, "kvp x tp").seconds / step(C, mla, 8, 262144, "tp").seconds
    assert short > 1 > long, (short, long)


def test_table_and_errors():
    t = table(C, ["llama-3.1-8b"], [131072], [8, 16])
    assert t.count("\n") == 3 and "| Llama-3.1-8B | 128k | 8 |" in t and "(TPA 8)" in t
    assert "(no fit)" in table(C, ["llama-3.1-70b"], [131072], [8])
    with pytest.raises(ValueError, match="layout must be one of"):
        step(C, M8, 8, 1024, "pipeline")
    with pytest.raises(ValueError, match="nodes"):
        step(C, M8, 4096, 1024, "tp")


def test_pick_tp_is_the_faster_of_the_two_layouts_treeattn_runs():
    from types import SimpleNamespace

    from treeattn.cost.layouts import pick_tp, shape_of

    c = PRESETS["dgx-h100"]
    for name, n, seq in (("llama-3.1-8b", 8, 131072), ("llama-3.1-8b", 2, 1 << 20), ("llama-3.1-70b", 8, 131072)):
        m = MODELS[name]
        tp, whole, split = pick_tp(c, m, n, seq)
        assert (whole.layout, split.layout, split.tpa) == ("kvp", "kvp x tp", 1)
        if whole.fits is False and split.fits:
            assert tp == n  # only the split fits (70B: 141 GB of weights per rank otherwise)
        else:
            assert tp == (n if split.seconds < whole.seconds else 1), (name, n, seq)
    assert pick_tp(c, MODELS["llama-3.1-8b"], 1, 4096)[0] == 1
    cfg = SimpleNamespace(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)  # fmt: skip
    assert shape_of(cfg).params() == MODELS["llama-3.1-8b"].params()
