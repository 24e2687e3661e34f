import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treeattn", *args], capture_output=True, text=True, timeout=300)


def test_demo_small():
    r = run("demo", "--nproc", "2", "--seq", "8192", "--reps", "3", "--warmup", "1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "all exact" in out and "Ring / Tree(auto)" in out and "auto picked:" in out
    for name in ("allreduce3", "allreduce2", "allgather", "hierarchical", "ring"):
        assert f"| tree {name} |" in out or f"| {name} |" in out
    assert "Warning" not in r.stderr


def test_demo_gqa_bfloat16_three_ranks():
    r = run(
        "demo",
        "--nproc",
        "3",
        "--seq",
        "3001",
        "--heads",
        "8",
        "--kv-heads",
        "2",
        "--dim",
        "64",
        "--dtype",
        "bfloat16",
        "--reps",
        "2",
        "--warmup",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert "all exact" in r.stdout


def test_merge_demo():
    r = run("merge-demo", "--seq", "100000", "--nproc", "5")
    assert r.returncode == 0, r.stderr
    assert "depth 3 = ceil(log2 5)" in r.stdout and "exact within tolerance" in r.stdout


def test_bad_option_is_an_error():
    r = run("demo", "--dtype", "int8")
    assert r.returncode != 0 and "invalid choice" in r.stderr
