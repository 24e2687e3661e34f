"""GPU suite: tree_decode (every strategy) and ring_decode on CUDA tensors against float64,
at p = 1 under NCCL and at p = 2 and 3 sharing one GPU under gloo (CUDA tensors staged through
host memory by treeattn.comm.collectives); causal prefill across ranks on the GPU. Skipped
without CUDA (`make test-gpu` fails instead when torch has no CUDA device)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))

from treeattn.launch import launch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU suite: needs a CUDA device")
DEV = "cuda"  # where results must live (a dry run of the workers on CPU sets "cpu")


def gpu_decode_worker(strategies: list[str]) -> None:
    from test_decode import CONFIGS, DTYPES, HEADS, check_close, expected, make_case

    import treeattn

    torch.cuda.set_device(0)
    rank, p = dist.get_rank(), dist.get_world_size()
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    n = 0
    for s_idx, strategy in enumerate(strategies):
        for j, (dtype, heads) in enumerate((d, h) for d in DTYPES for h in HEADS):
            B, Tq, mode, ragged, Dv, scale = CONFIGS[(j + s_idx) % len(CONFIGS)]
            seed = 1000 * p + 37 * s_idx + j
            q, ks, vs, lens, new_k, new_v, new_mask = make_case(seed, p, dtype, heads, B, Tq, mode, ragged, Dv)
            what = f"cuda rank {rank}/{p} {dist.get_backend()} {strategy} {dtype} heads={heads} B={B} Tq={Tq} {mode}"
            kw = dict(scale=scale, kv_lens=cuda(lens[rank]), new_k=cuda(new_k), new_v=cuda(new_v),
                      new_mask=cuda(new_mask), return_lse=True)  # fmt: skip
            args = (q.cuda(), ks[rank].cuda(), vs[rank].cuda())
            if strategy == "ring":
                out, lse = treeattn.ring_decode(*args, **kw)
            else:
                out, lse = treeattn.tree_decode(*args, strategy=strategy, **kw)
            assert out.device.type == DEV and lse.device.type == DEV, what
            ref, pt = expected(q, ks, vs, lens, new_k, new_v, new_mask, scale)
            check_close(out.cpu(), lse.cpu(), q, ref, pt, what)
            kw["check"] = False  # the per-step path gives the same result
            again = (treeattn.ring_decode(*args, **kw) if strategy == "ring"
                     else treeattn.tree_decode(*args, strategy=strategy, **kw))  # fmt: skip
            assert torch.equal(again[0], out), what
            n += 1
    assert n == len(strategies) * 9


STRATEGIES = ["allreduce3", "allreduce2", "allgather", "hierarchical", "auto", "ring"]


@pytest.mark.parametrize("p,backend", [(1, "nccl"), (2, "gloo"), (3, "gloo")])
def test_decode_on_one_gpu(p, backend):
    launch(gpu_decode_worker, p, (STRATEGIES,), backend=backend, timeout=600, collective_timeout=120)


def gpu_prefill_worker() -> None:
    """Ring and Tree causal prefill of CUDA tensors (the Triton kernel with per-row bounds
    locally) against float64 causal attention over the whole sequence."""
    from reference import assert_within_tolerance
    from treeattn.parallel.prefill import ring_prefill, tree_prefill

    torch.cuda.set_device(0)
    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float32):
        T, Hq, Hkv, D = 40 * p + 3, 8, 2, 64
        q = torch.randn(1, Hq, T, D, generator=g).to(dtype)
        k = torch.randn(1, Hkv, T, D, generator=g).to(dtype)
        v = torch.randn(1, Hkv, T, D, generator=g).to(dtype)
        pos = [torch.arange(r, T, p) for r in range(p)]  # interleaved, block 1
        mine = pos[rank]
        qm, km, vm = q[:, :, mine].cuda(), k[:, :, mine].cuda(), v[:, :, mine].cuda()
        for name in ("ring", "tree"):
            if name == "ring":
                out, lse = ring_prefill(qm, km, vm, pos, return_lse=True)
            else:
                out, lse = tree_prefill(qm, km, vm, pos, pos[rank], return_lse=True)
            assert out.device.type == DEV, name
            vis = torch.arange(T)[None, :] <= mine[:, None]
            assert_within_tolerance(out.cpu(), lse.cpu(), q[:, :, mine], k, v, mask=vis.unsqueeze(0))


@pytest.mark.parametrize("p,backend", [(1, "nccl"), (2, "gloo")])
def test_prefill_on_one_gpu(p, backend):
    launch(gpu_prefill_worker, p, backend=backend, timeout=600, collective_timeout=120)
