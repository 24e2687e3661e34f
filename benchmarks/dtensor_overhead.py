"""Why treeattn's tensor parallelism is its own small layers and not PyTorch's DTensor
(``torch.distributed.tensor.parallel``): one decode step's MLP of a SmolLM2-135M layer (576 ->
1536 -> 576, float32, gated SiLU), split over p = 2 gloo ranks of one thread, as

- ``treeattn``: ``treeattn.parallel.tensor`` (``ColumnParallel`` gate/up, ``RowParallel`` down,
  its all-reduce through /dev/shm);
- ``dtensor``: the same module through ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on a 1-D ``DeviceMesh`` (its all-reduce through the process group);
- ``whole``: the MLP unsplit on every rank (the floor the split must beat).

Each variant runs ``--calls`` forwards of a ``[1, 1, 576]`` input (a decode step), in turn, for
``--rounds`` rounds; it prints the median microseconds per call of each, and the outputs'
largest difference from the whole MLP. Not a test: nothing is asserted.

    python benchmarks/dtensor_overhead.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from treeattn.launch import launch


class MLP(nn.Module):
    def __init__(self, h: int = 576, m: int = 1536) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, m, bias=False), nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def worker(calls: int, rounds: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from treeattn.parallel.tensor import ColumnParallel, RowParallel, Tokens, split

    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = MLP().eval()
    ours = copy.deepcopy(whole)
    lo, hi = split(1536, rank, p)
    t = Tokens()
    ours.gate_proj = ColumnParallel(ours.gate_proj, lo, hi, t)
    ours.up_proj = ColumnParallel(ours.up_proj, lo, hi, t)
    ours.down_proj = RowParallel(ours.down_proj, lo, hi, None, sliced=False)
    mesh = DeviceMesh("cpu", torch.arange(p))
    dt = parallelize_module(copy.deepcopy(whole), mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                          "down_proj": RowwiseParallel()})  # fmt: skip
    x = torch.randn(1, 1, 576, generator=torch.Generator().manual_seed(1))
    variants = {"whole": whole, "treeattn": ours, "dtensor": dt}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        ref = whole(x)
        err = {k: (m(x) - ref).abs().max().item() for k, m in variants.items()}
        for _ in range(rounds):
            for k, m in variants.items():
                for _ in range(20):
                    m(x)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    m(x)
                times[k].append((time.perf_counter() - t0) / calls * 1e6)
    if rank == 0:
        print(f"p = {p}, SmolLM2-135M MLP (576 -> 1536 -> 576) float32, [1, 1, 576], {calls} calls x {rounds} rounds")
        print("| variant | median us/call | rounds | max |out - whole| |")
        print("|---|---|---|---|")
        for k in variants:
            print(f"| {k} | {statistics.median(times[k]):.0f} | {', '.join(f'{v:.0f}' for v in times[k])} | "
                  f"{err[k]:.2g} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    launch(worker, a.nproc, (a.calls, a.rounds), timeout=600)


if __name__ == "__main__":
    main()
