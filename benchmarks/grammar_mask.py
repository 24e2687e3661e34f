"""What structured output costs per token (``treeattn serve``'s ``response_format``): the real
SmolLM2-135M-Instruct model (float32) answering a chat question, greedy, once plain and once
under a JSON schema (:mod:`treeattn.serve.grammar`, llguidance), single process with the
model's own KV cache. Per token it times the forward and, under the schema, the mask (the
matcher's bitmask, expanded and applied to the logits) and the matcher's step; it prints
medians over ``--runs`` answers and the ratio of the constrained tokens/s to the plain.

    python benchmarks/grammar_mask.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "is_capital", "continent"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "is_capital": {"type": "boolean"},
                         "continent": {"enum": ["Europe", "Asia", "Africa", "America"]}}}  # fmt: skip
ASK = "Paris: which city, is it a capital, which continent? Answer in JSON."


def answer(model, ids, eos, grammar=None, new=60):
    """Greedy tokens and per-token (forward, mask + step) seconds."""
    out, fwd, msk = [], [], []
    past, x = None, ids
    with torch.no_grad():
        for _ in range(new):
            t0 = time.perf_counter()
            r = model(x, past_key_values=past, use_cache=True)
            past, lg = r.past_key_values, r.logits[0, -1].float()
            t1 = time.perf_counter()
            if grammar is not None:
                lg = grammar.mask(lg)
            t = int(lg.argmax())
            done = grammar.take(t) if grammar is not None else False
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            msk.append(t2 - t1)
            out.append(t)
            if done or t in eos:
                break
            x = torch.tensor([[t]])
    return out, fwd, msk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treeattn.hf.models import resolve_model
    from treeattn.serve.grammar import Grammars

    torch.set_num_threads(1)
    d = str(resolve_model(str(smollm2_gguf())))  # the GGUF file converted once (cached)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    eos = [tok.eos_token_id]
    ids = tok.apply_chat_template([{"role": "user", "content": ASK}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]  # fmt: skip
    t0 = time.perf_counter()
    engine = Grammars(tok, model.config.vocab_size, eos)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = engine.compile({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    compile_s = time.perf_counter() - t0
    rows = {"plain": [], "schema": []}
    text = ""
    for _ in range(a.runs):
        for kind in rows:
            out, fwd, msk = answer(model, ids, eos, engine.matcher(g) if kind == "schema" else None)
            rows[kind].append((len(out), sum(fwd) + sum(msk), statistics.median(fwd), statistics.median(msk)))
            if kind == "schema":
                text = tok.decode(out, skip_special_tokens=True)
    print(f"SmolLM2-135M float32, 1 thread; vocabulary {model.config.vocab_size}; tokenizer set-up {setup * 1e3:.0f} ms "
          f"(once per server), schema compiled in {compile_s * 1e3:.1f} ms; {a.runs} answers each")  # fmt: skip
    print("| answer | tokens | tokens/s (median) | forward ms/token | mask + step us/token |")
    print("|---|---|---|---|---|")
    tps = {}
    for kind, rs in rows.items():
        tps[kind] = statistics.median(n / s for n, s, _, _ in rs)
        print(f"| {kind} | {rs[0][0]} | {tps[kind]:.1f} | {statistics.median(r[2] for r in rs) * 1e3:.2f} | "
              f"{statistics.median(r[3] for r in rs) * 1e6:.0f} |")  # fmt: skip
    print(f"constrained / plain tokens/s: {tps['schema'] / tps['plain']:.2f}x; the answer: {json.loads(text)}")


if __name__ == "__main__":
    main()
