"""`treeattn bench <sub> --quick`: well-formed JSON/CSV/PNG with provenance, and numbers that
mean what they say (the quick presets run in well under a minute each)."""

import csv
import json
import subprocess
import sys

import pytest

PROV = {"date", "command", "torch", "treeattn", "device", "backend"}


def run_bench(sub: str, out) -> tuple[dict, list[dict]]:
    r = subprocess.run(
        [sys.executable, "-m", "treeattn", "bench", sub, "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / f"{sub if sub != 'comm' else 'comm'}.json").read_text())
    assert PROV <= set(data["provenance"]), data["provenance"]
    assert data["rows"], "no rows"
    with open(out / f"{sub}.csv") as f:
        lines = [line for line in f if not line.startswith("#")]
    assert len(list(csv.DictReader(lines))) == len(data["rows"])
    png = (out / f"{sub}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "|---|" in r.stdout  # markdown table
    return data["provenance"], data["rows"]


def test_latency_quick(tmp_path):
    prov, rows = run_bench("latency", tmp_path)
    assert prov["nproc"] == [1, 2] and "shape" in prov and prov["dtype"] == "float32"
    methods = {r["method"] for r in rows}
    assert {"local", "tree allgather", "tree auto", "ring", "single device"} <= methods
    for r in rows:
        assert 0 < r["p10_s"] <= r["median_s"] <= r["p90_s"]
        if r.get("max_err") is not None:
            assert r["max_err"] < 1e-5
    ring = {(r["p"], r["seq"]): r["bytes_sent"] for r in rows if r["method"] == "ring" and r["p"] == 2}
    assert ring[(2, 8192)] > 3 * ring[(2, 2048)]  # ring traffic grows with the context


def test_memory_quick(tmp_path):
    _, rows = run_bench("memory", tmp_path)
    for r in rows:
        assert r["resident_kv_bytes"] > 0 and r["measured_bytes"] >= r["resident_kv_bytes"]
    big = {r["method"]: r for r in rows if r["seq"] == max(x["seq"] for x in rows) and r["heads"] == 4}
    assert big["ring"]["step_peak_bytes"] > big["tree allgather"]["step_peak_bytes"]  # ring holds extra K/V blocks


def test_comm_quick(tmp_path):
    _, rows = run_bench("comm", tmp_path)
    tree = {(r["p"], r["seq"]): r["bytes_sent"] for r in rows if r["method"] == "tree allgather"}
    ring = {(r["p"], r["seq"]): r["bytes_sent"] for r in rows if r["method"] == "ring"}
    for p in (2, 3):
        assert tree[(p, 1024)] == tree[(p, 16384)]  # independent of the context
        assert ring[(p, 16384)] > 10 * ring[(p, 1024)]
    for r in rows:
        if r["method"] == "tree allreduce3":
            assert r["measured/eq"] == pytest.approx(1.0, rel=0.05)  # eq. 14 is Algorithm 3's volume


def test_e2e_quick(tmp_path):
    _, rows = run_bench("e2e", tmp_path)
    assert {r["attention"] for r in rows} == {"tree", "ring"}
    assert all(r["ttft_s"] > 0 and r["decode_s_per_token"] > 0 for r in rows)


def test_timed_interleaved_runs_methods_in_turn():
    import time

    from treeattn.bench.common import timed_interleaved

    calls = []
    fns = {"slow": lambda: (calls.append("slow"), time.sleep(0.004)), "fast": lambda: calls.append("fast")}
    ts = timed_interleaved(fns, reps=3, warmup=1)
    assert calls == ["slow", "fast"] * 4  # warm-up, then one step of each per repetition
    assert set(ts) == {"slow", "fast"} and all(len(v) == 3 for v in ts.values())
    assert min(ts["slow"]) >= 0.004 > max(ts["fast"])
