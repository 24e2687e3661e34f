"""A transformers causal LM's weights split over the ranks, applied from outside the model (the
model keeps no distributed code): in every decoder layer the gated MLP's ``gate_proj`` and
``up_proj`` column parallel and its ``down_proj`` row parallel, the attention's ``o_proj`` row
parallel over whole query heads, each followed by one all-reduce (:mod:`treeattn.parallel.tensor`);
BLOOM's and MPT's layers alike under their own names (``_LAYOUTS``).
The embedding table and the LM head are split by vocabulary rows (one tensor when tied:
:mod:`treeattn.parallel.vocab`). Norms, residuals and Q/K/V stay whole on every rank (Q/K/V
split too with ``tpa``); every rank computes every head's attention over its own shard of the
sequence (Tree or Ring across the shards, as without this), then multiplies its heads' slice of
the output projection.

So each rank reads 1/p of the MLP and output projection weights per step (SmolLM2-135M: 71 %
of a layer's weights) and holds 1/p of them. Sizes that don't divide split unevenly (SmolLM2's
9 query heads over 2 ranks: 5 and 4; its MLP's 1536 by 768). The sums run in another order
than one process's, so logits differ from transformers' in the last bits (the tests hold
greedy tokens identical)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import world
from ..comm.validate import agree
from ..parallel.mesh import Mesh, make_mesh, mesh_problem
from ..parallel.tensor import ColumnParallel, RowParallel, Tokens, split
from ..parallel.vocab import VocabParallelEmbedding, VocabParallelHead, vocab_slice

_MARK = "_treeattn_tensor_parallel"  # the model attribute: the ranks it is split over
_MESH = "_treeattn_mesh"  # the model attribute: its Mesh
_HEADS = "_treeattn_heads"  # an attention layer's attribute: (lo, hi) of the query heads it computes


def tensor_parallel_ranks(model: nn.Module) -> int:
    """Over how many ranks :func:`tensor_parallel` split ``model`` (1: not split)."""
    return getattr(model, _MARK, 1)


def model_mesh(model: nn.Module) -> Mesh | None:
    """The TPA x KVP mesh :func:`tensor_parallel` split ``model`` over (None: not split)."""
    return getattr(model, _MESH, None)


def sequence_group(model: nn.Module, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group ``model``'s KV cache is sharded over when its forwards run on every rank of
    ``group``: the KVP group of its mesh when its attention heads are split (``tpa`` > 1),
    else ``group`` itself."""
    mesh = model_mesh(model)
    return mesh.seq if mesh is not None and mesh.tpa > 1 else group


def heads_here(layer: nn.Module, n_heads: int) -> tuple[int, int]:
    """The query heads ``[lo, hi)`` of the model's ``n_heads`` this rank's copy of the attention
    ``layer`` computes (all of them unless :func:`tensor_parallel` split the heads)."""
    return getattr(layer, _HEADS, (0, n_heads))


def kv_heads_here(model: nn.Module) -> int:
    """The KV heads this rank computes and stores (all of them, or its mesh's head slice)."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mesh = model_mesh(model)
    return (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) // (mesh.tpa if mesh is not None else 1)


@dataclass(frozen=True)
class _Layout:
    """Where a family keeps what is split: the decoder's layers, each layer's attention and MLP,
    the MLP's column- and row-parallel linears, the attention's output projection and its Q/K/V
    (three linears, or one fused linear of ``fused`` rows per head: BLOOM's [q k v] per head)."""

    layers: str = "layers"
    attn: str = "self_attn"
    mlp: str = "mlp"
    cols: tuple[str, ...] = ("gate_proj", "up_proj")
    row: str = "down_proj"
    out: str = "o_proj"
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    fused: int = 0


_LAYOUTS = {
    "bloom": _Layout("h", "self_attention", "mlp", ("dense_h_to_4h",), "dense_4h_to_h", "dense", ("query_key_value",), 3),
    "mpt": _Layout("blocks", "attn", "ffn", ("up_proj",), "down_proj", "out_proj", ()),  # Wqkv: [all q | k | v]
}


def _layout(model: nn.Module) -> _Layout:
    return _LAYOUTS.get(getattr(model.config, "model_type", ""), _Layout())


def _layers(model: nn.Module):
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    name = _layout(model).layers
    layers = getattr(dec, name, None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (model.get_decoder().{name})")
    return layers


def _check(model: nn.Module) -> str | None:
    if tensor_parallel_ranks(model) > 1:
        return "the model is split already (tensor_parallel was called on it)"
    if getattr(model.config, "slow_but_exact", False) and getattr(model.config, "pretraining_tp", 1) > 1:
        return "BLOOM with slow_but_exact=True sums its projections in slices of its own; it cannot be split"
    lay = _layout(model)
    for i, layer in enumerate(_layers(model)):
        mlp, attn = getattr(layer, lay.mlp, None), getattr(layer, lay.attn, None)
        names = [(mlp, n, lay.mlp) for n in (*lay.cols, lay.row)] + [(attn, lay.out, lay.attn)]  # all whole
        for owner, name, where in names:
            if type(getattr(owner, name, None)) is not nn.Linear:
                return (f"layer {i}: tensor parallelism needs the MLP ({lay.mlp}.{', '.join((*lay.cols, lay.row))}) "
                        f"and {lay.attn}.{lay.out} as nn.Linear layers; {where}.{name} is not")  # fmt: skip
    return None


@torch.no_grad()
def tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None, tpa: int = 1) -> nn.Module:
    """Split ``model``'s MLP and attention output projection weights over the ranks of
    ``group`` (in place, returned; call on every rank with the same model, before packing its
    linears: :func:`treeattn.hf.linear.pack_linears`). Afterwards every forward of the model is
    collective over ``group``: run it on every rank alike (a :class:`~treeattn.runtime.Session` over
    the same group does), never on one rank alone.

    ``tpa`` > 1 also splits the attention heads over ``tpa`` slices of ranks (Helix's TPA x
    KVP mesh, :mod:`treeattn.parallel.mesh`; ``tpa`` divides the ranks and the KV heads; the
    default process group only): each rank computes Q/K/V for its slice's heads, and a
    :class:`~treeattn.runtime.Session` shards each slice's K/V along the sequence over the slice's
    ``p / tpa`` ranks. Each rank then holds ``1/tpa`` of the K/V heads of ``tpa / p`` of the
    sequence: the same K/V bytes as ``tpa`` = 1, ``1/tpa`` of the Q/K/V weights.

    Raises:
        ValueError: on every rank, before any other collective, when the model cannot be split
            on some rank (no gated MLP, split already, a ``tpa`` that does not divide) or the
            ranks' models or ``tpa`` differ.
    """
    rank, p = world(group)
    err = _check(model)
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    hq, hkv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    err = err or mesh_problem(group, tpa, hkv)
    if err is None and tpa > 1:
        err = _qkv_problem(model)
    agree({"layers": len(_layers(model)) if err is None else -1, "hidden_size": c.hidden_size,
           "intermediate_size": getattr(c, "intermediate_size", -1), "num_attention_heads": hq,
           "head_dim": hd, "tpa": tpa if type(tpa) is int else -1, "vocab_size": c.vocab_size}, err,
          group=group)  # fmt: skip
    if p == 1:
        return model
    mesh = make_mesh(group, tpa, "cuda" if next(model.parameters()).device.type == "cuda" else "cpu")
    q_lo, q_hi = mesh.heads(hq)
    kv_lo, kv_hi = mesh.heads(hkv)
    lay = _layout(model)
    for layer in _layers(model):
        mlp, attn = getattr(layer, lay.mlp), getattr(layer, lay.attn)
        lo, hi = split(getattr(mlp, lay.cols[0]).out_features, rank, p)
        x = Tokens()  # the MLP's input, gathered once for both projections
        for name in lay.cols:
            setattr(mlp, name, ColumnParallel(getattr(mlp, name), lo, hi, x))
        setattr(mlp, lay.row, RowParallel(getattr(mlp, lay.row), lo, hi, group, sliced=False))
        if tpa > 1 and lay.fused:  # one linear, [q k v] per head: this slice's heads' rows
            name, w = lay.qkv[0], lay.fused * hd
            setattr(attn, name, ColumnParallel(getattr(attn, name), q_lo * w, q_hi * w, None))
            attn.num_heads = q_hi - q_lo
        elif tpa > 1:  # this rank's slice of the heads: its own tokens' Q/K/V, no communication
            attn.q_proj = ColumnParallel(attn.q_proj, q_lo * hd, q_hi * hd, None)
            attn.k_proj = ColumnParallel(attn.k_proj, kv_lo * hd, kv_hi * hd, None)
            attn.v_proj = ColumnParallel(attn.v_proj, kv_lo * hd, kv_hi * hd, None)
        if tpa > 1:
            setattr(attn, _HEADS, (q_lo, q_hi))  # (an ALiBi layer's slopes: hf.alibi)
        # the output projection: this rank's whole query heads of its slice's (all heads at tpa = 1)
        cuts, j, base = mesh.head_cuts(hq), mesh.seq_rank, q_lo * hd
        setattr(attn, lay.out, RowParallel(getattr(attn, lay.out), base + cuts[j] * hd, base + cuts[j + 1] * hd,
                                           group, sliced=True, base=base))  # fmt: skip
    _split_vocab(model, group, rank, p)
    setattr(model, _MARK, p)
    setattr(model, _MESH, mesh)
    return model


def _split_vocab(model: nn.Module, group, rank: int, p: int) -> None:
    """The embedding table and the LM head by vocabulary rows over the ranks (one tensor when
    tied); either stays whole where it is not a plain ``nn.Embedding`` (or a scaled one, as
    Gemma-3's) / ``nn.Linear``."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and emb is not None and getattr(head, "weight", None) is emb.weight
    scaled = type(emb).__name__.endswith("ScaledWordEmbedding") and hasattr(emb, "embed_scale")  # Gemma-3's
    ok_emb = isinstance(emb, nn.Embedding) and emb.max_norm is None and (type(emb) is nn.Embedding or scaled)
    ok_emb = ok_emb and not (tied and type(head) is not nn.Linear)  # (a tied head kept whole keeps the table)
    if ok_emb:
        lo, hi, _ = vocab_slice(emb.num_embeddings, rank, p)
        model.set_input_embeddings(VocabParallelEmbedding(emb, lo, hi, group))
    if type(head) is nn.Linear and (ok_emb or not tied):  # (a head tied to a table kept whole stays whole)
        lo, hi, per = vocab_slice(head.out_features, rank, p)
        new = VocabParallelHead(head, lo, hi, per, group, model.get_input_embeddings().weight if tied else None)
        name = next(n for n, m in model.named_children() if m is head)
        setattr(model, name, new)



def _qkv_problem(model: nn.Module) -> str | None:
    lay = _layout(model)
    if not lay.qkv:
        return (f"{type(model).__name__}: splitting the attention heads (tpa > 1) is not implemented for its "
                "fused Q/K/V (all queries, then all keys, then all values); tpa = 1 splits the rest")  # fmt: skip
    for i, layer in enumerate(_layers(model)):
        attn = getattr(layer, lay.attn, None)
        for name in lay.qkv:
            if type(getattr(attn, name, None)) is not nn.Linear:
                return (f"layer {i}: splitting the attention heads (tpa > 1) needs {lay.attn}."
                        f"{', '.join(lay.qkv)} as nn.Linear layers; {name} is not")  # fmt: skip
    return None
