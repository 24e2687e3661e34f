"""End to end on one GPU: a Llama-3.2-1B-shaped model (16 layers, 32/8 heads x 64, random
weights), greedy, a long random prompt: a plain transformers forward loop (DynamicCache)
against treeattn at p = 1 (``treeattn.decoding.generate``, a Session loop), eager and with its
decode steps as CUDA graphs (``cuda_graph=True``), in one process, alternating. Time to first
token and the median ms per later token; tokens compared.

    python benchmarks/gpu_e2e.py --prompt 8192 --new 32 --dtypes bfloat16 float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def model_1b(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                      tie_word_embeddings=True, rope_theta=500000.0)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg).to(dtype).eval()
    return m


@torch.no_grad()
def hf_loop(m, ids, new: int) -> tuple[list[int], float, list[float]]:
    from transformers import DynamicCache

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = m(ids, past_key_values=DynamicCache(), use_cache=True)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    toks = [int(tok)]
    ttft = time.perf_counter() - t0
    cache, steps = out.past_key_values, []
    for _ in range(new - 1):
        ts = time.perf_counter()
        out = m(tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(int(tok))  # the host needs the token (EOS, streaming): one sync, as in treeattn
        steps.append(time.perf_counter() - ts)
    return toks, ttft, steps


def treeattn_run(m, ids, new: int, chunk, graph: bool = False, flash: bool = False) -> tuple[list[int], float, list[float]]:
    from treeattn.decoding import generate
    from treeattn.ops import causal

    causal.SQUARE_FLASH = flash  # the prompt's square causal block through aten's flash kernel

    info = {}
    torch.cuda.synchronize()
    try:
        out = generate(m, ids, max_new_tokens=new, stop_at_eos=False, prefill_chunk=chunk, info=info, cuda_graph=graph)
    finally:
        causal.SQUARE_FLASH = False
    return out[0].tolist(), info["ttft"], info["decode"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--pairs", type=int, default=2, help="alternating rounds (every run once) per dtype")
    ap.add_argument("--chunk", type=int, default=None, help="treeattn prefill_chunk (default: the whole prompt)")
    ap.add_argument("--square-flash", action="store_true",
                    help="one more run: the prompt's causal block through aten's flash kernel (ops.causal.SQUARE_FLASH)")
    ap.add_argument("--json")
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}; Llama-3.2-1B-shaped, random weights; prompt {a.prompt}, {a.new} new "
          f"tokens, greedy; {a.pairs} alternating rounds, the median of each\n")  # fmt: skip
    # first step: the first decode step alone (with graphs, it captures)
    print("| dtype | run | TTFT ms | vs transformers | ms/token | vs transformers | first step ms | tokens |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    runs = {"hf": lambda m, ids, n: hf_loop(m, ids, n), "treeattn": lambda m, ids, n: treeattn_run(m, ids, n, a.chunk),
            "treeattn, CUDA graphs": lambda m, ids, n: treeattn_run(m, ids, n, a.chunk, graph=True)}  # fmt: skip
    if a.square_flash:
        runs["treeattn, CUDA graphs, flash prefill"] = lambda m, ids, n: treeattn_run(m, ids, n, a.chunk, True, True)
    for dname in a.dtypes:
        m = model_1b(getattr(torch, dname))
        ids = torch.randint(0, m.config.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(1)).cuda()
        # a warm-up at the timed shapes: Triton compiles a variant per new kernel shape (with a
        # 512-token warm-up the bf16 TTFT median was 3.0 s on 2026-11-27, 0.12 s the day
        # before; a compilation inside the first timed run is the suspect, not confirmed)
        for run in runs.values():
            run(m, ids, 4)
        res = {k: [] for k in runs}
        for _ in range(a.pairs):
            for k, run in runs.items():
                res[k].append(run(m, ids, a.new))
        med = {k: (statistics.median(r[1] for r in v) * 1e3, statistics.median(statistics.median(r[2]) for r in v) * 1e3)
               for k, v in res.items()}  # fmt: skip
        first_ms = {k: statistics.median(r[2][0] for r in v) * 1e3 for k, v in res.items()}
        for k in runs:
            ref, got = res["hf"][0][0], res[k][0][0]
            first = next((i for i, (x, y) in enumerate(zip(ref, got, strict=True)) if x != y), None)
            rows.append(dict(dtype=dname, run=k, ttft_ms=med[k][0], ms_token=med[k][1], ttft_ratio=med[k][0] / med["hf"][0],
                             ms_token_ratio=med[k][1] / med["hf"][1], first_step_ms=first_ms[k], first_difference=first))  # fmt: skip
            print(f"| {dname} | {'transformers' if k == 'hf' else k} | {med[k][0]:.1f} | {med[k][0] / med['hf'][0]:.2f} | "
                  f"{med[k][1]:.2f} | {med[k][1] / med['hf'][1]:.2f} | {first_ms[k]:.1f} | "
                  f"{'identical' if first is None else f'differ from token {first}'} |", flush=True)  # fmt: skip
        del m
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
