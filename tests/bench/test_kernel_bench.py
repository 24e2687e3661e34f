import argparse
import csv

from treeattn.bench import kernel


def test_bench_kernel_smoke(tmp_path, capsys):
    out = tmp_path / "k.csv"
    a = argparse.Namespace(quick=False, seq=[300], dtypes=["float32", "bfloat16"], heads=["4/2"], dim=64,
                           backends=["flash_cpu", "decode_cpu"], threads=2, reps=1, csv=str(out), plot=None)  # fmt: skip
    assert kernel.run(a) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["backend"] for r in rows} == {"flash_cpu", "decode_cpu", "decode_cpu_2t"} and len(rows) == 6
    assert all(float(r["ms"]) > 0 and float(r["pct_floor"]) > 0 for r in rows)
    assert "| float32 | 4/2 | 300 |" in capsys.readouterr().out
