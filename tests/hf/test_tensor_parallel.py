"""Weights split over the ranks (treeattn.hf.tensor_parallel: the MLP and the attention output
projection, Megatron's column / row parallel) beside the sequence split of the KV cache: at p =
2, 3, 4 on tiny Llama, Qwen2, Mistral (sliding window) and Gemma-2 (softcaps) models, greedy
tokens identical to single-process transformers, Tree and Ring, both placements, chunked
prefill, packed linears, speculation (chains and token trees) and contrastive search; last-step logits within 2x single-process float32's error against
float64; each rank holding its share of the split weights; a Session over another group and
a model split twice refused on every rank."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from treeattn.launch import launch  # noqa: E402

NEW = 12


def tiny(kind: str):
    from treeattn.hf.presets import build_model

    return build_model(f"tiny-{kind}", None, torch.float32, seed=0)[0]


def reference_tokens(model, ids, new=NEW):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[:, ids.shape[1] :]


def vocab_case(whole, m, p: int) -> None:
    """The embedding table and the head by vocabulary rows (tied: one tensor), a rank's rows at
    most ``ceil(V / 64p) * 64``; the split embedding gives the whole one's rows bit for bit, for
    the same tokens on every rank and for each rank's own (a sequence-sharded forward)."""
    from treeattn.parallel.tensor import sharded_tokens
    from treeattn.parallel.vocab import VocabParallelEmbedding, VocabParallelHead

    rank = dist.get_rank()
    emb, head = m.get_input_embeddings(), m.get_output_embeddings()
    assert isinstance(emb, VocabParallelEmbedding) and isinstance(head, VocabParallelHead), (emb, head)
    V = whole.config.vocab_size
    assert emb.weight.shape[0] <= -(-V // (64 * p)) * 64 < V
    assert (head.inner.weight is emb.weight) == bool(whole.config.tie_word_embeddings)
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(emb(ids), whole.get_input_embeddings()(ids))
        counts = [3 + r for r in range(p)]
        mine = torch.randint(0, V, (2, counts[rank]), generator=torch.Generator().manual_seed(rank))
        with sharded_tokens(counts):
            got = emb(mine)
        assert torch.equal(got, whole.get_input_embeddings()(mine))
        bad = ids.clone()
        bad[1, 2] = V + 3 if rank == 0 else 5  # one rank's token outside the vocabulary, in a sharded forward
        with pytest.raises(IndexError, match="token ids must lie in"), sharded_tokens([7] * p):
            emb(bad)  # every rank raises (every rank sees every id): no rank is left waiting
        assert torch.equal(emb(ids), whole.get_input_embeddings()(ids))  # the group still in step


def tp_worker() -> None:
    from treeattn.comm.collectives import all_gather
    from treeattn.decoding import generate
    from treeattn.hf.linear import pack_linears
    from treeattn.hf.tensor_parallel import tensor_parallel, tensor_parallel_ranks
    from treeattn.parallel.tensor import RowParallel

    rank, p = dist.get_rank(), dist.get_world_size()
    cases = [("llama", "interleaved", "tree", None), ("qwen2", "contiguous", "ring", None),
             ("mistral", "interleaved", "tree", 16), ("gemma2", "contiguous", "tree", None),
             ("llama", "contiguous", "ring", 16), ("gemma3", "interleaved", "tree", 16)]  # fmt: skip
    for i, (kind, placement, attention, chunk) in enumerate(cases):
        whole = tiny(kind)
        ref64 = copy.deepcopy(whole).double()
        m = tensor_parallel(copy.deepcopy(whole))
        assert tensor_parallel_ranks(m) == p
        if i == 0:  # the split weights: this rank's share, and together the whole
            layer, full = m.model.layers[0], whole.model.layers[0]
            rows = all_gather(torch.tensor([layer.mlp.gate_proj.out_features]), None)
            assert int(rows.sum()) == full.mlp.gate_proj.out_features and rows.max() - rows.min() <= 1
            assert isinstance(layer.self_attn.o_proj, RowParallel)
            hd = full.self_attn.head_dim
            assert (layer.self_attn.o_proj.hi - layer.self_attn.o_proj.lo) % hd == 0
        if kind == "llama" and chunk:  # packed linears after the split (the row-parallel layers' inner too)
            assert pack_linears(m) > 0
            whole = copy.deepcopy(whole)
            pack_linears(whole)
        vocab_case(whole, m, p)
        L = (37, 150, 61, 90, 150, 70)[i]
        ids = torch.randint(0, whole.config.vocab_size, (1, L), generator=torch.Generator().manual_seed(L))
        info = {}
        out = generate(m, ids, max_new_tokens=NEW, placement=placement, attention=attention, prefill_chunk=chunk,
                       stop_at_eos=False, info=info)  # fmt: skip
        case = f"p={p} {kind} {placement} {attention} chunk={chunk}"
        ref = reference_tokens(whole, ids)
        assert torch.equal(out, ref), f"{case}: {out.tolist()} != {ref.tolist()}"
        full_ids = torch.cat([ids, out[:, :-1]], 1)
        l64 = ref64(full_ids).logits[:, -1]
        e_pt = (whole(full_ids).logits[:, -1].double() - l64).abs().max().item()
        e_ours = (info["last_logits"].double() - l64).abs().max().item()
        assert e_ours <= 2 * e_pt + 1e-5, f"{case}: logits err {e_ours:.3g} vs single-process {e_pt:.3g}"
    # speculation (prompt lookup, a chain and a token tree) and contrastive search over the split weights
    whole = tiny("llama")
    m = tensor_parallel(copy.deepcopy(whole))
    ids = torch.tensor([[7, 8, 9, 10, 11] * 6])
    ref = reference_tokens(whole, ids)
    for width in (1, 2):
        info = {}
        out = generate(m, ids, max_new_tokens=NEW, speculate="prompt-lookup", tree_width=width, adaptive_draft=False,
                       stop_at_eos=False, info=info)  # fmt: skip
        assert torch.equal(out, ref), f"p={p} speculation width {width}: {out.tolist()} != {ref.tolist()}"
        assert info["target_forwards"] < NEW  # drafts were accepted: several tokens per forward
    w64 = tiny("qwen2").double()
    m64 = tensor_parallel(copy.deepcopy(w64))
    ids = torch.randint(0, 512, (1, 15), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=NEW, penalty_alpha=0.6, top_k=4, stop_at_eos=False, prefill_chunk=4)
    assert torch.equal(generate(m64, ids, **kw), generate(w64, ids, **kw)), f"p={p} contrastive search"
    # a head tied to a table that is kept whole (not a plain nn.Embedding) stays whole too
    class Table(torch.nn.Embedding):
        pass

    w = tiny("llama")
    table = Table(w.config.vocab_size, w.config.hidden_size)
    table.weight = w.get_input_embeddings().weight
    w.set_input_embeddings(table)
    w.lm_head.weight = table.weight
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    ref = reference_tokens(w, ids)
    m = tensor_parallel(copy.deepcopy(w))
    assert type(m.lm_head) is torch.nn.Linear and m.lm_head.weight is m.get_input_embeddings().weight
    assert torch.equal(generate(m, ids, max_new_tokens=NEW, stop_at_eos=False), ref)
    # refused on every rank: a model split twice, a session over a group the model is not split over
    m = tensor_parallel(tiny("llama"))
    with pytest.raises(ValueError, match="split already"):
        tensor_parallel(m)
    groups = [dist.new_group([r]) for r in range(p)]
    from treeattn.runtime import Session

    with pytest.raises(ValueError, match=f"split over {p} ranks .* the group has 1"):
        Session(m, groups[rank])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_tensor_parallel_greedy_matches_single_process(p):
    launch(tp_worker, p, timeout=600)
