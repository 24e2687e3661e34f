import pytest
import torch
import torch.distributed as dist

from reference import max_err, naive_attention, reference
from treeattn.cache import Placement
from treeattn.launch import launch


def prefill_worker():
    from treeattn.parallel import ring_prefill

    rank, p = dist.get_rank(), dist.get_world_size()
    for i, (kind, block, L, heads, dtype) in enumerate(
        [
            ("interleaved", 1, 50, (8, 2), torch.float32),
            ("interleaved", 4, 37, (4, 4), torch.bfloat16),
            ("contiguous", 1, 41, (6, 3), torch.float32),
            ("contiguous", 1, 2, (4, 1), torch.float16),  # fewer tokens than ranks: empty blocks
        ]
    ):
        g = torch.Generator().manual_seed(i)
        q = torch.randn(2, heads[0], L, 16, generator=g).to(dtype)
        k = torch.randn(2, heads[1], L, 16, generator=g).to(dtype)
        v = torch.randn(2, heads[1], L, 16, generator=g).to(dtype)
        pl = Placement(kind, p, block)
        pos = [pl.prompt_positions(r, L) for r in range(p)]
        mine = pos[rank]
        out, lse = ring_prefill(q[:, :, mine], k[:, :, mine], v[:, :, mine], pos, return_lse=True)
        ro, rl = reference(q, k, v, causal=True)
        po, pl_ = naive_attention(q, k, v, causal=True)
        e, ep = max_err(out, ro[:, :, mine]), max_err(po[:, :, mine], ro[:, :, mine])
        assert out.dtype == dtype and e <= 2 * ep + 1e-6, f"case {i}: {e} vs plain torch {ep}"
        assert max_err(lse, rl[:, :, mine]) <= 2 * max_err(pl_[:, :, mine], rl[:, :, mine]) + 1e-5


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_ring_prefill_causal_exact(p):
    launch(prefill_worker, p, timeout=180)


def test_ring_prefill_chunks_query_rows(monkeypatch):
    """With a tiny mask budget the query rows are processed in many chunks: same result."""
    import treeattn.parallel.prefill as P

    monkeypatch.setattr(P, "_MASK_BUDGET", 64)  # single process: the budget applies here
    L = 33
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, L, 16, generator=g) for h in (4, 2, 2))
    pos = [torch.arange(L)]
    out = P.ring_prefill(q, k, v, pos)
    ro, _ = reference(q, k, v, causal=True)
    assert max_err(out, ro) < 1e-5
