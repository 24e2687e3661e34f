"""The attention heads split too (treeattn.hf.tensor_parallel(tpa=M): Helix's TPA x KVP mesh):
at p = 2 (TPA 2, KVP 1) and p = 4 (TPA 2, KVP 2: the Tree reduction scattered over the heads)
on tiny Llama, Qwen2 (Q/K/V biases) and Gemma-2 (softcaps, sliding windows) models, greedy
tokens identical to single-process transformers, Tree and Ring, both placements, chunked
prefill, speculation (a chain and a token tree), contrastive search and the server's batched
rows over a shared prefix; last-step logits within 2x single-process float32's error against
float64; each rank holding its slice's K/V heads and Q/K/V rows; a tpa that does not divide,
or differs between the ranks, refused on every rank."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from test_tensor_parallel import reference_tokens, tiny  # noqa: E402

from treeattn.launch import launch  # noqa: E402

NEW = 10


def rows_case(whole, m, p: int) -> None:
    """Two rows of the server's batch over one shared prefix (one reads all of it, one a part,
    each with a question of its own), decoded greedily together: each as transformers alone."""
    import treeattn.runtime.batch as batch
    from treeattn.runtime.batch import BatchRunner

    batch.SPLIT_MIN = 1  # the first step's tokens split over the KVP ranks (parallel.split)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 512, (40,), generator=g).tolist()
    asks = {0: (40, torch.randint(0, 512, (5,), generator=g).tolist()), 1: (23, [3, 4, 5])}
    runner = BatchRunner(m, max_batch=2, prefill_chunk=8)
    runner.prefill(0, prefix)
    for row, (keep, _) in asks.items():
        runner.open(row, 0, keep)
    lines, got = [(row, q) for row, (_, q) in asks.items()], {0: [], 1: []}
    for _ in range(NEW):
        logits = runner.run(lines)
        lines = [(row, [int(logits[i].argmax())]) for i, (row, _) in enumerate(lines)]
        for row, t in lines:
            got[row] += t
    for row, (keep, q) in asks.items():
        ref = reference_tokens(whole, torch.tensor([prefix[:keep] + q]), NEW)[0].tolist()
        assert got[row] == ref, f"p={p} batched row {row}: {got[row]} != {ref}"


def mesh_worker() -> None:
    from treeattn.comm.meter import metering
    from treeattn.decoding import generate
    from treeattn.hf.tensor_parallel import model_mesh, tensor_parallel
    from treeattn.runtime import Session

    rank, p = dist.get_rank(), dist.get_world_size()
    cases = [("llama", "interleaved", "tree", None), ("qwen2", "contiguous", "ring", 8),
             ("gemma2", "interleaved", "tree", 8), ("gemma2", "contiguous", "ring", None)]  # fmt: skip
    for i, (kind, placement, attention, chunk) in enumerate(cases):
        whole = tiny(kind)
        m = tensor_parallel(copy.deepcopy(whole), tpa=2)
        mesh = model_mesh(m)
        assert (mesh.tpa, mesh.kvp, mesh.head_slice, mesh.seq_rank) == (2, p // 2, rank // (p // 2), rank % (p // 2))
        hd, hkv = whole.model.layers[0].self_attn.head_dim, whole.config.num_key_value_heads
        assert m.model.layers[0].self_attn.k_proj.out_features == hkv // 2 * hd  # its slice's rows only
        L = (37, 150, 61, 90)[i]
        ids = torch.randint(0, whole.config.vocab_size, (1, L), generator=torch.Generator().manual_seed(L))
        info = {}
        with metering() as mt:
            out = generate(m, ids, max_new_tokens=NEW, placement=placement, attention=attention, prefill_chunk=chunk,
                           stop_at_eos=False, info=info)  # fmt: skip
        case = f"p={p} tpa=2 {kind} {placement} {attention} chunk={chunk}"
        ref = reference_tokens(whole, ids, NEW)
        assert torch.equal(out, ref), f"{case}: {out.tolist()} != {ref.tolist()}"
        scattered = "scatter" in mt.by_label
        assert scattered == (p == 4 and attention == "tree"), f"{case}: scattered over the heads: {scattered}"
        ref64 = copy.deepcopy(whole).double()
        full_ids = torch.cat([ids, out[:, :-1]], 1)
        l64 = ref64(full_ids).logits[:, -1]
        e_pt = (whole(full_ids).logits[:, -1].double() - l64).abs().max().item()
        e_ours = (info["last_logits"].double() - l64).abs().max().item()
        assert e_ours <= 2 * e_pt + 1e-5, f"{case}: logits err {e_ours:.3g} vs single-process {e_pt:.3g}"
        if i == 0:
            s = Session(m)
            s.extend(ids[:, :9])
            assert s.cache.Hkv == hkv // 2 and s.cache.p == p // 2, (s.cache.Hkv, s.cache.p)
            rows_case(whole, m, p)
    # speculation (prompt lookup: a chain and a token tree) and contrastive search over the mesh
    whole = tiny("llama")
    m = tensor_parallel(copy.deepcopy(whole), tpa=2)
    ids = torch.tensor([[7, 8, 9, 10, 11] * 6])
    ref = reference_tokens(whole, ids, NEW)
    for width in (1, 2):
        info = {}
        out = generate(m, ids, max_new_tokens=NEW, speculate="prompt-lookup", tree_width=width, adaptive_draft=False,
                       stop_at_eos=False, info=info)  # fmt: skip
        assert torch.equal(out, ref), f"p={p} tpa=2 speculation width {width}: {out.tolist()} != {ref.tolist()}"
        assert info["target_forwards"] < NEW
    w64 = tiny("qwen2").double()
    m64 = tensor_parallel(copy.deepcopy(w64), tpa=2)
    ids = torch.randint(0, 512, (1, 15), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=NEW, penalty_alpha=0.6, top_k=4, stop_at_eos=False, prefill_chunk=4)
    assert torch.equal(generate(m64, ids, **kw), generate(w64, ids, **kw)), f"p={p} tpa=2 contrastive search"
    # tree_decode's scattered reduction alone: this rank's heads of the whole reduction; bad cuts on one rank
    from treeattn import tree_decode

    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(0))
    k, v = torch.randn(1, 2, 5 + rank, 16, generator=g), torch.randn(1, 2, 5 + rank, 16, generator=g)
    cuts = [h * 4 // p for h in range(p + 1)]
    whole = tree_decode(q, k, v)
    mine = tree_decode(q, k, v, heads=cuts)
    assert torch.allclose(mine, whole[:, cuts[rank] : cuts[rank + 1]], atol=1e-6), (mine, whole)
    with pytest.raises(ValueError, match="heads must be"):
        tree_decode(q, k, v, heads=[0, 4] if rank == 0 else cuts)
    # refused on every rank, before any other collective: a tpa that does not divide, one that differs
    with pytest.raises(ValueError, match="tpa = 3 must divide"):
        tensor_parallel(tiny("llama"), tpa=3 if rank == 0 else 1)
    with pytest.raises(ValueError, match="tpa"):
        tensor_parallel(tiny("llama"), tpa=2 if rank == 0 else 1)


@pytest.mark.parametrize("p", [2, 4])
def test_mesh_greedy_matches_single_process(p):
    launch(mesh_worker, p, timeout=900)
