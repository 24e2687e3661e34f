"""A transformers causal LM's weights split over the ranks, applied from outside the model (the
model keeps no distributed code): in every decoder layer the gated MLP's ``gate_proj`` and
``up_proj`` column parallel and its ``down_proj`` row parallel, the attention's ``o_proj`` row
parallel over whole query heads, each followed by one all-reduce (:mod:`treeattn.parallel.tensor`).
Norms, residuals, the embeddings and Q/K/V stay whole on every rank; every rank computes every
head's attention over its own shard of the sequence (Tree or Ring across the shards, as
without this), then multiplies its heads' slice of the output projection. The LM head is
already split over the vocabulary (:mod:`treeattn.hf._head`).

So each rank reads 1/p of the MLP and output projection weights per step (SmolLM2-135M: 71 %
of a layer's weights) and holds 1/p of them. Sizes that don't divide split unevenly (SmolLM2's
9 query heads over 2 ranks: 5 and 4; its MLP's 1536 by 768). The sums run in another order
than one process's, so logits differ from transformers' in the last bits (the tests hold
greedy tokens identical)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import world
from ..comm.validate import agree
from ..parallel.tensor import ColumnParallel, RowParallel, Tokens, split

_MARK = "_treeattn_tensor_parallel"  # the model attribute: the ranks it is split over


def tensor_parallel_ranks(model: nn.Module) -> int:
    """Over how many ranks :func:`tensor_parallel` split ``model`` (1: not split)."""
    return getattr(model, _MARK, 1)


def _layers(model: nn.Module):
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (model.get_decoder().layers)")
    return layers


def _check(model: nn.Module) -> str | None:
    if tensor_parallel_ranks(model) > 1:
        return "the model is split already (tensor_parallel was called on it)"
    for i, layer in enumerate(_layers(model)):
        mlp, attn = getattr(layer, "mlp", None), getattr(layer, "self_attn", None)
        names = [(mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj"), (attn, "o_proj")]  # all whole
        for owner, name in names:
            if type(getattr(owner, name, None)) is not nn.Linear:
                return (f"layer {i}: tensor parallelism needs a gated MLP (mlp.gate_proj, up_proj, down_proj) and "
                        f"self_attn.o_proj as nn.Linear layers; {name} is not")  # fmt: skip
    return None


@torch.no_grad()
def tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Split ``model``'s MLP and attention output projection weights over the ranks of
    ``group`` (in place, returned; call on every rank with the same model, before packing its
    linears: :func:`treeattn.hf.linear.pack_linears`). Afterwards every forward of the model is
    collective over ``group``: run it on every rank alike (a :class:`~treeattn.hf.Session` over
    the same group does), never on one rank alone.

    Raises:
        ValueError: on every rank, before any other collective, when the model cannot be split
            on some rank (no gated MLP, split already) or the ranks' models differ in shape.
    """
    rank, p = world(group)
    err = _check(model)
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    agree({"layers": len(_layers(model)) if err is None else -1, "hidden_size": c.hidden_size,
           "intermediate_size": getattr(c, "intermediate_size", -1), "num_attention_heads": c.num_attention_heads,
           "head_dim": hd}, err, group=group)  # fmt: skip
    if p == 1:
        return model
    for layer in _layers(model):
        mlp, attn = layer.mlp, layer.self_attn
        lo, hi = split(mlp.gate_proj.out_features, rank, p)
        x = Tokens(group)  # the MLP's input, gathered once for both projections
        mlp.gate_proj = ColumnParallel(mlp.gate_proj, lo, hi, x)
        mlp.up_proj = ColumnParallel(mlp.up_proj, lo, hi, x)
        mlp.down_proj = RowParallel(mlp.down_proj, lo, hi, group, sliced=False)
        lo, hi = split(attn.o_proj.in_features, rank, p, unit=hd)  # whole query heads
        attn.o_proj = RowParallel(attn.o_proj, lo, hi, group, sliced=True)
    setattr(model, _MARK, p)
    return model
