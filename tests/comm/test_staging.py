"""Host staging of device tensors under gloo (treeattn.comm.collectives), exercised on CPU:
with ``_staged`` forced on, every collective and send/recv goes through the staging code
(copies, contiguity, the receive's copy back after wait) and must give bitwise the results of
the direct path. On a GPU the same code lets p ranks share one device (tests/gpu)."""

import torch
import torch.distributed as dist

from treeattn.launch import launch


def staging_worker() -> None:
    import treeattn
    from treeattn.comm import _pg as C  # the process group's path, where staging lives
    from treeattn.comm import collectives
    from treeattn.parallel.prefill import ring_prefill, tree_prefill

    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 3, 16, generator=g)
    ks = [torch.randn(2, 2, 5 + r, 16, generator=g) for r in range(p)]
    T = 7 * p
    qp, kp = torch.randn(1, 4, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g)
    pos = [torch.arange(r, T, p) for r in range(p)]
    mine = pos[rank]
    qm = qp[:, :, mine].transpose(2, 3).contiguous().transpose(2, 3)  # a non-contiguous layout
    km = kp[:, :, mine]

    def run():
        res = [treeattn.tree_decode(q, ks[rank], ks[rank], strategy=s, return_lse=True)[0]
               for s in ("allreduce3", "allreduce2", "allgather")]  # fmt: skip
        res.append(treeattn.ring_decode(q, ks[rank], ks[rank]))
        res.append(ring_prefill(qm, km, km, pos))
        res.append(tree_prefill(qm, km, km, pos, mine))
        b = torch.arange(6.0) * (rank + 1)
        res.append(collectives.broadcast(b, None))
        return res

    direct = run()
    calls = []
    real = C._staged
    C._staged = lambda t, group: calls.append(1) or True
    try:
        staged = run()
    finally:
        C._staged = real
    assert calls, "the staging path never ran"
    for i, (a, b) in enumerate(zip(direct, staged, strict=True)):
        assert torch.equal(a, b), f"rank {rank}: result {i} differs through host staging"

    # NCCL coalesces a batch of sends and receives into one request: the same, staged or not
    real_batch = dist.batch_isend_irecv

    class Coalesced:
        def __init__(self, works):
            self.works = works

        def wait(self, *a, **kw):
            return all(w.wait(*a, **kw) for w in self.works)

    dist.batch_isend_irecv = lambda ops: [Coalesced(real_batch(ops))]
    try:
        for stage in (False, True):
            C._staged = lambda t, group, stage=stage: stage
            assert torch.equal(treeattn.ring_decode(q, ks[rank], ks[rank]), direct[3]), f"rank {rank} staged={stage}"
    finally:
        dist.batch_isend_irecv = real_batch
        C._staged = real


def test_staged_collectives_equal_direct():
    off = {"TREEATTN_SHM": "0"}  # the small collectives through the process group: staged like a GPU's
    launch(staging_worker, 2, timeout=180, env=off)
    launch(staging_worker, 3, timeout=180, env=off)
