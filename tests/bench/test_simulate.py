"""treeattn.bench.simulate: closed forms, model properties, calibration and the CLI."""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import replace

import pytest

from treeattn.bench import simulate as sim
from treeattn.bench.simulate import (
    PRESETS,
    Cluster,
    allgather_recursive_doubling,
    allgather_ring,
    allreduce_ring,
    allreduce_tree,
    attention_time,
    breakdown,
    calibrate,
    hierarchical_allgather,
    holdout_report,
    predict,
    ring_p2p_time,
)
from treeattn.comm.strategies import choose_strategy
from treeattn.comm.topology import Topology

A, B = 1e-5, 1e10  # alpha 10 us, beta 10 GB/s
PAPER = dict(batch=1, heads=16, kv_heads=16, head_dim=128, dtype_bytes=2)  # Fig. 3 shape, bf16
DGX = PRESETS["dgx-h100"]


# --- closed forms, against numbers computed by hand -----------------------------------------


def test_allreduce_closed_forms():
    # ring: 2*3*1e-5 + 2*3/4*1e6/1e10 = 6e-5 + 1.5e-4
    assert allreduce_ring(1e6, 4, A, B) == pytest.approx(2.1e-4, rel=1e-12)
    # tree: 2*ceil(log2 4)*1e-5 + 2*1e6/1e10 = 4e-5 + 2e-4; p = 5 -> 3 levels
    assert allreduce_tree(1e6, 4, A, B) == pytest.approx(2.4e-4, rel=1e-12)
    assert allreduce_tree(1e6, 5, A, B) == pytest.approx(2.6e-4, rel=1e-12)
    assert allreduce_ring(1e6, 1, A, B) == allreduce_tree(1e6, 1, A, B) == 0.0


def test_allgather_closed_forms():
    # ring: 3*1e-5 + 3*1e6/1e10; recursive doubling: 2*1e-5 + 3e-4 (p = 4), 3*1e-5 + 7e-4 (p = 8)
    assert allgather_ring(1e6, 4, A, B) == pytest.approx(3.3e-4, rel=1e-12)
    assert allgather_recursive_doubling(1e6, 4, A, B) == pytest.approx(3.2e-4, rel=1e-12)
    assert allgather_recursive_doubling(1e6, 8, A, B) == pytest.approx(7.3e-4, rel=1e-12)
    assert allgather_ring(1e6, 1, A, B) == allgather_recursive_doubling(1e6, 1, A, B) == 0.0


def test_hierarchical_allgather_closed_form():
    # 8 ranks/node x 16 nodes, 1 kB state: 7*(1us + 1e3/450e9) + 15*(5us + 1e3/50e9)
    want = 7 * (1e-6 + 1e3 / 450e9) + 15 * (5e-6 + 1e3 / 50e9)
    assert hierarchical_allgather(1e3, 8, 16, 1e-6, 450e9, 5e-6, 50e9) == pytest.approx(want, rel=1e-12)
    want_rd = 3 * 1e-6 + 7e3 / 450e9 + 4 * 5e-6 + 15e3 / 50e9
    assert hierarchical_allgather(1e3, 8, 16, 1e-6, 450e9, 5e-6, 50e9, algo="rd") == pytest.approx(want_rd, rel=1e-12)


def test_ring_p2p_closed_form():
    # T = 1e-5 + 1e6/1e10 = 1.1e-4 per hop, C = 1e-5 per block, p = 4
    assert ring_p2p_time(4, 1e6, 1e-5, A, B, first_hop_overlapped=True) == pytest.approx(1e-5 + 3 * 1.1e-4)
    # treeattn's ring_pass: C + T (hop 1 not overlapped) + 2*max(T, C) + C (last block)
    assert ring_p2p_time(4, 1e6, 1e-5, A, B) == pytest.approx(1e-5 + 1.1e-4 + 2 * 1.1e-4 + 1e-5)
    # compute-bound hops: C = 1 ms hides the transfer except on hop 1
    assert ring_p2p_time(4, 1e6, 1e-3, A, B) == pytest.approx(1e-3 + 1.1e-4 + 2 * 1e-3 + 1e-3)
    assert ring_p2p_time(1, 1e6, 1e-3, A, B) == 1e-3


def test_attention_time():
    assert attention_time(1e9, 1e12, 0.5, 1e-6) == pytest.approx(1e-6 + 2e-3)


# --- predict: composition and properties -------------------------------------------------------

SIMPLE = Cluster(
    name="simple",
    nodes=4,
    devices_per_node=4,
    intra_alpha=2e-6,
    intra_beta=100e9,
    inter_alpha=10e-6,
    inter_beta=10e9,
    device_mem_bw=1e12,
    attn_efficiency=0.5,
    collective_alpha=3e-6,
    attn_alpha=1e-6,
    allreduce_algo="ring",
    allgather_algo="ring",
)


def test_predict_composes_closed_forms():
    p, seq, b, h, d = 4, 1000, 2, 8, 64
    kv = b * h * (seq // p) * 2 * d * 2  # bf16 K and V of one shard
    out, lse = b * h * d * 4, b * h * 4  # float32 state
    attn = attention_time(kv, 1e12, 0.5, 1e-6)
    mem = 1 / 0.5e12
    ag = attn + 3e-6 + allgather_ring(out + lse, p, 2e-6, 100e9) + p * (out + lse) * mem
    ar3 = attn + 3 * 3e-6 + 2 * allreduce_ring(lse, p, 2e-6, 100e9) + allreduce_ring(out, p, 2e-6, 100e9)
    ar3 += 2 * (out + lse) * mem
    hop = ring_p2p_time(p, kv, attn, 3e-6 + 2e-6, 100e9)
    ring = 3e-6 + allgather_ring((b + 1) * 8, p, 2e-6, 100e9) + hop + p * (out + lse) * mem
    args = (p, seq, b, h, h, d, 2)
    assert predict(SIMPLE, *args, "local") == pytest.approx(attn, rel=1e-12)
    assert predict(SIMPLE, *args, "allgather") == pytest.approx(ag, rel=1e-12)
    assert predict(SIMPLE, *args, "hierarchical") == pytest.approx(ag, rel=1e-12)  # one node
    assert predict(SIMPLE, *args, "allreduce3") == pytest.approx(ar3, rel=1e-12)
    assert predict(SIMPLE, *args, "ring") == pytest.approx(ring, rel=1e-12)
    for s in sim.PREDICTED:
        bd = breakdown(SIMPLE, *args, s)
        assert bd["total_s"] == pytest.approx(predict(SIMPLE, *args, s), rel=1e-12)
        assert bd["compute_s"] + bd["comm_s"] == pytest.approx(bd["total_s"])
        assert bd["compute_s"] >= attn * (1 - 1e-12)
    # p = 1: no communication at all
    assert predict(SIMPLE, 1, seq, b, h, h, d, 2, "ring") == predict(SIMPLE, 1, seq, b, h, h, d, 2, "allreduce3")


def test_multinode_flat_collectives_use_inter_constants():
    p, seq, b, h, d = 16, 4096, 1, 8, 64  # 4 nodes of 4
    out, lse = b * h * d * 4, b * h * 4
    attn = predict(SIMPLE, p, seq, b, h, h, d, 2, "local")
    mem = p * (out + lse) / 0.5e12
    want = attn + 3e-6 + allgather_ring(out + lse, p, 10e-6, 10e9) + mem
    assert predict(SIMPLE, p, seq, b, h, h, d, 2, "allgather") == pytest.approx(want, rel=1e-12)
    # ring across nodes: every hop at the inter-node link
    kv = b * h * (seq // p) * 2 * d * 2
    ring = predict(SIMPLE, p, seq, b, h, h, d, 2, "ring")
    assert ring >= (p - 1) * (3e-6 + 10e-6 + kv / 10e9)


def test_auto_is_the_library_choice():
    for p in (8, 64, 1024):
        r = min(p, 8)
        pick = choose_strategy(16 * 128 * 4, 16 * 4, p, Topology(r), profile=DGX)
        assert predict(DGX, p, 1 << 20, **PAPER, strategy="auto") == predict(DGX, p, 1 << 20, **PAPER, strategy=pick)


@pytest.mark.parametrize("p", [2, 8, 16, 128])
def test_ring_grows_with_context(p):
    seqs = [10_000, 80_000, 640_000, 5_120_000, 40_960_000]
    times = [predict(DGX, p, s, **PAPER, strategy="ring") for s in seqs]
    assert all(a < b for a, b in zip(times, times[1:], strict=False))


@pytest.mark.parametrize("strategy", ["allreduce3", "allreduce2", "allgather", "hierarchical"])
@pytest.mark.parametrize("p", [2, 8, 64, 1024])
def test_tree_communication_does_not_depend_on_context(strategy, p):
    comms = [breakdown(DGX, p, s, **PAPER, strategy=strategy)["comm_s"] for s in (80_000, 1_280_000, 100_000_000)]
    assert comms[0] > 0
    assert comms == pytest.approx([comms[0]] * 3, rel=1e-12)


@pytest.mark.parametrize("preset", ["dgx-h100", "2x4090-pcie"])
def test_tree_local_part_shrinks_with_p(preset):
    c = PRESETS[preset]
    ps = [p for p in (1, 2, 4, 8, 16, 64, 256, 1024) if p <= c.nodes * c.devices_per_node]
    local = [breakdown(c, p, 5_120_000, **PAPER, strategy="allreduce3")["compute_s"] for p in ps]
    assert all(a > b for a, b in zip(local, local[1:], strict=False))
    assert [predict(c, p, 5_120_000, **PAPER, strategy="local") for p in ps] == sorted(
        [predict(c, p, 5_120_000, **PAPER, strategy="local") for p in ps], reverse=True
    )


def test_local_oversubscription_slows_compute():
    c = replace(PRESETS["local"], compute_slots=2)
    t2 = predict(c, 2, 1 << 20, 1, 8, 8, 64, 4, "local")
    t4 = predict(c, 4, 1 << 20, 1, 8, 8, 64, 4, "local")
    # half the keys per rank but two ranks per core: same streaming time, the fixed cost doubles
    assert t4 == pytest.approx(t2 + c.attn_alpha, rel=1e-12)
    assert predict(replace(c, compute_slots=0), 4, 1 << 20, 1, 8, 8, 64, 4, "local") < t4


def test_hierarchical_beats_flat_allgather_when_inter_node_is_slow():
    slow = replace(SIMPLE, inter_alpha=50e-6, inter_beta=1e9)
    for p in (8, 16):
        h = predict(slow, p, 100_000, 1, 8, 8, 64, 2, "hierarchical")
        f = predict(slow, p, 100_000, 1, 8, 8, 64, 2, "allgather")
        assert h < f
    for p in (64, 256, 1024):
        assert predict(DGX, p, 5_120_000, **PAPER, strategy="hierarchical") < predict(
            DGX, p, 5_120_000, **PAPER, strategy="allgather"
        )
    # on one node they are the same collective
    assert predict(DGX, 8, 80_000, **PAPER, strategy="hierarchical") == predict(
        DGX, 8, 80_000, **PAPER, strategy="allgather"
    )


def test_paper_headline_case():
    h = sim._headline()
    assert (h["p"], h["seq"], h["heads"], h["head_dim"]) == (128, 5_120_000, 16, 128)
    shard = 16 * (5_120_000 // 128) * 2 * 128 * 2  # 327.68 MB of bf16 K/V per GPU
    # ring across 16 nodes: 127 hops gated by a 50 GB/s NIC (8 us call + 5 us IB step each)
    assert h["ring_s"] == pytest.approx(127 * (13e-6 + shard / 50e9), rel=0.01)
    assert h["allreduce3_s"] < 1e-3 and h["speedup_vs_allreduce3"] > h["paper_speedup"]
    k = h["paper_speedup"]
    x = h["overhead_for_paper_speedup_s"]
    assert (h["ring_s"] + x) / (h["allreduce3_s"] + x) == pytest.approx(k)


def test_predict_rejects_bad_input():
    with pytest.raises(ValueError, match="strategy"):
        predict(DGX, 8, 1000, **PAPER, strategy="bogus")
    with pytest.raises(ValueError, match="nodes"):
        predict(PRESETS["2x4090-pcie"], 4, 1000, **PAPER, strategy="ring")
    with pytest.raises(ValueError, match="equal nodes"):
        predict(DGX, 12, 1000, **PAPER, strategy="hierarchical")
    with pytest.raises(ValueError, match="multiple"):
        predict(DGX, 8, 1000, 1, 16, 3, 128, 2, "ring")


# --- calibration ---------------------------------------------------------------------------------

TRUTH = replace(
    PRESETS["local"],
    compute_slots=2,
    collective_alpha=120e-6,
    intra_alpha=40e-6,
    intra_beta=1.5e9,
    p2p_alpha=250e-6,
    p2p_beta=4e9,
    attn_efficiency=0.7,  # 7 GB/s of 10
    attn_alpha=30e-6,
)
BASE = replace(PRESETS["local"], compute_slots=2)
METHODS = {
    "tree allreduce3": "allreduce3",
    "tree allreduce2": "allreduce2",
    "tree allgather": "allgather",
    "tree hierarchical": "hierarchical",
    "tree auto": "auto",
    "ring": "ring",
    "local": "local",
}


def synthetic_rows(cluster: Cluster, methods=METHODS) -> list[dict]:
    rows = []
    for p in (2, 3, 4):
        for seq in (4096, 65536, 1 << 20):
            for batch, heads, kv_heads, dim in ((1, 16, 16, 128), (64, 32, 8, 128)):
                for m in methods:
                    t = predict(cluster, p, seq, batch, heads, kv_heads, dim, 4, METHODS[m])
                    rows.append(
                        dict(method=m, p=p, seq=seq, batch=batch, heads=heads, kv_heads=kv_heads, dim=dim)
                        | dict(dtype="float32", median_s=t, bytes_sent=0, collectives=0)
                    )
    return rows


def test_calibration_recovers_known_constants():
    rows = synthetic_rows(TRUTH)
    single = predict(TRUTH, 1, 1 << 20, 1, 16, 16, 128, 4, "local")  # rank 0 alone over the full context
    rows.append(rows[0] | {"method": "single device", "p": 4, "seq": 1 << 20, "median_s": single})
    rows.append({"method": "mystery", "p": 2})  # unusable rows are skipped, not fatal
    cal = calibrate(rows, base=BASE)
    assert cal.skipped == 1 and cal.n_rows == len(rows) - 1
    want = {
        "collective_alpha": 120e-6,
        "intra_alpha": 40e-6,
        "intra_beta": 1.5e9,
        "p2p_alpha": 250e-6,
        "p2p_beta": 4e9,
        "attn_bw": 7e9,
        "attn_alpha": 30e-6,
    }
    assert set(want) <= set(cal.fitted)
    for k, v in want.items():
        assert cal.fitted[k] == pytest.approx(v, rel=0.05), k
    assert cal.cluster.attn_efficiency == pytest.approx(0.7, rel=0.05)
    assert cal.median_rel_err < 1e-3
    # the ring rows cover both overlap branches: transfer-bound (p = 2) and compute-bound (p = 4, 2 cores)
    big = dict(p=4, seq=1 << 20, batch=64, heads=32, kv_heads=8, head_dim=128, dtype_bytes=4)
    assert breakdown(TRUTH, **big, strategy="ring")["compute_s"] > 0.5 * predict(TRUTH, **big, strategy="ring")


def test_calibration_with_missing_methods():
    rows = synthetic_rows(TRUTH, methods=["local", "tree allgather"])
    cal = calibrate(rows, base=BASE)
    assert "p2p_alpha" in cal.fixed and "p2p_inv_beta" in cal.fixed  # no ring rows: defaults kept
    assert cal.cluster.p2p_alpha == BASE.p2p_alpha
    assert cal.fitted["attn_bw"] == pytest.approx(7e9, rel=0.05)
    assert cal.median_rel_err < 0.05
    with pytest.raises(ValueError, match="no usable rows"):
        calibrate([{"method": "ring"}, {"method": "tree allgather", "p": 2, "median_s": -1}])


def test_holdout_report_on_model_generated_rows():
    rows = synthetic_rows(TRUTH)
    rep = holdout_report(rows, fit_fraction=0.5, base=BASE)
    assert rep["n_fit"] + rep["n_holdout"] == len(rows)
    assert rep["n_holdout"] > 0 and len(rep["points"]) == rep["n_holdout"]
    assert rep["median_abs_rel_err"] < 1e-3
    assert all(math.isfinite(x["rel_err"]) for x in rep["points"])
    with pytest.raises(ValueError):
        holdout_report(rows, fit_fraction=0.0)


# --- CLI ----------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="treeattn")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sim.add_parser(sub)
    return parser.parse_args(["simulate", *argv])


def test_cli_writes_csv_json_png_with_provenance(tmp_path, capsys):
    out = tmp_path / "sim"
    args = parse("--preset", "dgx-h100", "--p", "8", "128", "--seq", "80k", "5.12M", "--out", str(out))
    assert args.seq == [80_000, 5_120_000]
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "| p | seq |" in text and "Paper headline case" in text
    with open(out / "simulate.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * len(sim.PREDICTED)
    assert {r["strategy"] for r in rows} == set(sim.PREDICTED)
    doc = json.loads((out / "simulate.json").read_text())
    prov = doc["provenance"]
    assert prov["date"] and prov["command"] and prov["args"]["preset"] == "dgx-h100"
    assert doc["cluster"]["inter_beta"] == 50e9 and doc["cluster"]["notes"]
    assert doc["headline"]["p"] == 128 and doc["calibration"] is None
    for png in ("latency_vs_p.png", "latency_vs_seq.png", "speedup_vs_p.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert png in doc["files"]


def test_cli_calibrates_local(tmp_path, capsys):
    results = tmp_path / "latency.json"
    results.write_text(json.dumps({"rows": synthetic_rows(TRUTH)}))
    args = parse("--preset", "local", "--calibrate", str(results), "--p", "2", "4", "--seq", "65536")
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "median |error| on held-back rows" in text and "| method | p | seq |" in text
    bad = parse("--calibrate", str(tmp_path / "missing.json"))
    assert bad.func(bad) == 2
    with pytest.raises(SystemExit):
        parse("--seq", "lots")
