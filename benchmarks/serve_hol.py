"""Head-of-line blocking: a question on a cached document while a new long document prefills.
`treeattn serve` with the real SmolLM2-135M-Instruct model at p ranks, greedy. A short
document (the Apache-2.0 text by default) is cached first. Then for ``--rounds`` rounds: the
time to first token of a question on it with the server idle, and again while a question on a
new long document (the GPL-3 text with the round's number in front, so it is never cached)
is being prefilled (asked ``--delay`` s after the long one starts); the long question's own
time to first token beside. Medians over the rounds; every answer of the cached question must
equal its idle answer. Not a test: it prints what it measured.

    python benchmarks/serve_hol.py --nproc 2
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script
from serve_batch import Server, ask, median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", default="/usr/share/common-licenses/Apache-2.0")
    ap.add_argument("--long", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delay", type=float, default=2.0, help="seconds after the long question starts")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=1024, help="the server's --prefill-chunk (tokens per rank a step)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's step token budget")
    a = ap.parse_args()
    import openai

    short, long_ = Path(a.short).read_text(), Path(a.long).read_text()
    q_short = short + "\n\nWhich license is this? Answer in one sentence."
    budget = [] if a.max_num_batched_tokens is None else ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    s = Server(str(smollm2_gguf()), a.nproc, "--max-batch", "4", "--cache-tokens", "20000", "--prefill-chunk",
               str(a.prefill_chunk), *budget)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=1200)
        first = ask(client, s.name, q_short, a.max_new_tokens)  # caches the short document
        idle, busy, long_ttft, same = [], [], [], []
        for k in range(a.rounds):
            r = ask(client, s.name, q_short, a.max_new_tokens)
            idle.append(r["ttft"])
            cached = r["cached"]
            same.append(r["text"] == first["text"])
            out: dict = {}
            started = threading.Event()

            def run_long(k=k, started=started, out=out) -> None:
                started.set()
                out["long"] = ask(client, s.name, f"Round {k}.\n\n{long_}\n\nWhat is this text about?", 8)

            t = threading.Thread(target=run_long)
            t.start()
            started.wait()
            time.sleep(a.delay)
            r = ask(client, s.name, q_short, a.max_new_tokens)
            t.join()
            busy.append(r["ttft"])
            same.append(r["text"] == first["text"])
            long_ttft.append(out["long"]["ttft"])
            print(f"round {k}: idle {idle[-1]:.2f} s, during the long prefill {busy[-1]:.2f} s "
                  f"(the long question's TTFT {long_ttft[-1]:.1f} s)", flush=True)  # fmt: skip
        print(f"\np = {a.nproc}, SmolLM2-135M float32, --prefill-chunk {a.prefill_chunk}, --max-num-batched-tokens "
              f"{a.max_num_batched_tokens}; {Path(a.short).name} cached "
              f"({cached} tokens), {Path(a.long).name} new each round; medians over {a.rounds} rounds")  # fmt: skip
        print("| TTFT of the question on the cached document | s | vs idle |")
        print("|---|---|---|")
        print(f"| idle | {median(idle):.2f} | 1.00x |")
        print(f"| while the new document prefills | {median(busy):.2f} | {median(busy) / median(idle):.2f}x |")
        print(f"the new document's question: TTFT {median(long_ttft):.1f} s; cached answers all equal alone: {all(same)}")
    finally:
        s.close()


if __name__ == "__main__":
    main()
