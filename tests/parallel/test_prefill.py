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


@pytest.mark.parametrize("block,rows", [(64, 1280), (4, 128)])
def test_causal_states_block_runs(block, rows):
    """One rank's queries against the other rank's keys under a block placement: the rows fall
    into one run per block, given to the fused kernel as whole blocks when the runs are few or
    long (block 64: 20 runs of 64 rows), else to the per-row path (block 4: 32 runs); both exact."""
    import treeattn.parallel.prefill as P

    L = 2 * rows
    pl = Placement("interleaved", 2, block)
    qpos, kpos = pl.prompt_positions(1, L), pl.prompt_positions(0, L)
    g = torch.Generator().manual_seed(block)
    q, k, v = (torch.randn(1, h, L, 16, generator=g) for h in (4, 2, 2))
    qs, ks, vs = q[:, :, qpos], k[:, :, kpos], v[:, :, kpos]
    out, lse = P.causal_states(qs, ks, vs, qpos, kpos)
    blocks = P._causal_blocks(qs, ks, vs, torch.searchsorted(kpos, qpos, right=True), None, None, "auto")
    assert (blocks is not None) == (block == 64)
    vis = (kpos[None, :] <= qpos[:, None])[None]
    ro, rl = reference(qs, ks, vs, mask=vis)
    po, pl_ = naive_attention(qs, ks, vs, mask=vis)
    assert max_err(out, ro) <= 2 * max_err(po, ro) + 1e-6
    assert max_err(lse, rl) <= 2 * max_err(pl_, rl) + 1e-5
