import argparse
import csv

import pytest

from treeattn.bench import kernel


@pytest.mark.parametrize("small_pages", [False, True])
def test_bench_kernel_smoke(tmp_path, capsys, small_pages):
    out = tmp_path / "k.csv"
    a = argparse.Namespace(quick=False, seq=[300], dtypes=["float32", "bfloat16"], heads=["4/2"], dim=64,
                           backends=["flash_cpu", "decode_cpu"], threads=2, reps=1, csv=str(out), plot=None,
                           small_pages=small_pages)  # fmt: skip
    assert kernel.run(a) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["backend"] for r in rows} == {"flash_cpu", "decode_cpu", "decode_cpu_2t"} and len(rows) == 6
    assert all(float(r["ms"]) > 0 and float(r["pct_floor"]) > 0 for r in rows)
    text = capsys.readouterr().out
    assert "| float32 | 4/2 | 300 |" in text
    assert ("asked for 4 KiB pages: 0 of 512 MiB" in text) == small_pages  # MADV_NOHUGEPAGE holds
    assert ("asked for huge pages:" in text) != small_pages
