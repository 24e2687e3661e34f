"""p ranks of one thread on a host with one other CPU-bound process beside them: decode ms/token
idle against busy, the weights whole and split (``--tp``).

The collectives between co-located ranks go through /dev/shm rounds (``comm/shm_small.py``); a
rank that waits there must give its core up soon, or on 2 cores with a third busy process the
peer it waits for gets no core. The real SmolLM2-135M-Instruct model (float32, packed linears),
the GPL-3 text and a question (~7.7k tokens), greedy. Each round runs idle, then busy (a Python
busy loop started before the launch, killed after it), for each layout, in fresh launches,
``--runs`` rounds alternating. Not a test: it prints what it measured, the medians and every run.

    python benchmarks/busy_host.py --runs 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _fixture import document, smollm2_gguf  # benchmarks/_fixture.py, beside this script
from speculative import QUESTIONS
from tp_decode import treeattn_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--question", choices=list(QUESTIONS), default="explain")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=33)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--layouts", choices=("whole", "split", "both"), default="both")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import resolve_model
    from treeattn.launch import launch

    d = str(resolve_model(str(smollm2_gguf())))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    ids = chat_ids(tok, document(a.doc) + QUESTIONS[a.question])
    layouts = {"whole": [False], "split": [True], "both": [False, True]}[a.layouts]
    print(f"{a.doc}: {ids.shape[1]:,} prompt tokens, greedy, {a.max_new_tokens} new tokens; p={a.nproc}, "
          "1 thread per rank", flush=True)  # fmt: skip
    rows: dict[tuple[bool, bool], list[float]] = {}
    for run in range(a.runs):
        for split in layouts:
            for busy in (False, True):
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        launch(treeattn_run, a.nproc, (d, ids, a.max_new_tokens, split, tmp), timeout=7200)
                        r = json.loads(Path(tmp, "row.json").read_text())
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                rows.setdefault((split, busy), []).append(r["ms"])
                print(f"run {run}: weights {'split' if split else 'whole'}, {'busy' if busy else 'idle'}: "
                      f"{r['ms']:.1f} ms/token", flush=True)  # fmt: skip
    print("\n| weights | idle ms/token (runs) | busy ms/token (runs) | busy / idle (medians) |")
    print("|---|---|---|---|")
    for split in layouts:
        idle, busy = rows[(split, False)], rows[(split, True)]
        print(f"| {'split (--tp)' if split else 'whole'} | {', '.join(f'{x:.1f}' for x in idle)} | "
              f"{', '.join(f'{x:.1f}' for x in busy)} | {statistics.median(busy) / statistics.median(idle):.2f}x |")


if __name__ == "__main__":
    main()
