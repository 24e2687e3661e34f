"""``treeattn serve`` with the weights whole and split (``--tp``): 8 clients at once over one cached document.

Both servers (SmolLM2-135M-Instruct float32, p = 2, ``--max-batch 8``; one with ``--tp 2``) are up at
once and take turns for ``--rounds`` rounds (the idle one only sends heartbeats), so the machine's
drift falls on both alike. Each round: the 8 questions of ``serve_batch.py`` over the document,
asked together, greedy, ``--max-new-tokens`` tokens. Prints tokens/s per round and the medians,
each rank's peak memory, and how many answers equal the same question asked alone (on the
weights-whole server). Not a test: it prints what it measured.

    python benchmarks/serve_tp.py --rounds 4
"""

from __future__ import annotations

import argparse
import statistics

from _fixture import document, smollm2_gguf  # benchmarks/_fixture.py, beside this script
from serve_batch import QUESTIONS, Server, ask, together


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3", help="the document (a text file)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    import openai

    gguf, doc = str(smollm2_gguf()), document(a.doc)
    texts = [doc + q for q in QUESTIONS]
    kinds = {"weights whole": [], f"weights split (--tp {a.nproc})": ["--tp", str(a.nproc)]}
    servers, clients, alone = {}, {}, None
    try:  # the servers go whatever happens (a failed round must not leave ranks running)
        for name, extra in kinds.items():
            s = servers[name] = Server(gguf, a.nproc, "--max-batch", "8", "--max-queue", "32", *extra)
            c = clients[name] = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=3600)
            ask(c, s.name, texts[0], 2)  # the document is prefilled once, then cached
            if alone is None:
                alone = [ask(c, s.name, t, a.max_new_tokens)["text"] for t in texts]
        rate = {k: [] for k in kinds}
        same = dict.fromkeys(kinds, 0)
        for r in range(a.rounds):
            for name in list(kinds)[:: 1 if r % 2 == 0 else -1]:
                got, wall = together(clients[name], servers[name].name, texts, a.max_new_tokens)
                rate[name].append(sum(g["tokens"] for g in got) / wall)
                same[name] += sum(g["text"] == x for g, x in zip(got, alone, strict=True))
            print(f"round {r}: " + "; ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rate.items()), flush=True)
        peaks = {k: s.peak_mib() for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.close()
    print(f"\n{a.doc}, p={a.nproc}, 8 clients at once, {a.max_new_tokens} new tokens at most, greedy, --max-batch 8; "
          f"{a.rounds} rounds, the servers taking turns\n")  # fmt: skip
    print("| server | tokens/s (rounds) | median | vs weights whole | answers same as alone | peak MiB per rank |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(rate["weights whole"])
    for k, v in rate.items():
        print(f"| {k} | {', '.join(f'{x:.1f}' for x in v)} | {statistics.median(v):.1f} | "
              f"{statistics.median(v) / base:.2f}x | {same[k]}/{8 * a.rounds} | "
              f"{', '.join(f'{x:.0f}' for x in peaks[k])} |")  # fmt: skip


if __name__ == "__main__":
    main()
