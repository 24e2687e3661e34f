"""A safetensors checkpoint loaded straight into its split over the ranks: each rank reads only
the rows or columns of the weights it keeps, so no rank ever holds the whole model.

The model is built with its parameters on the ``meta`` device (no memory; buffers such as the
rotary frequencies are computed for real), split by :func:`~treeattn.hf.tensor_parallel` (on
``meta`` still), then every parameter is read from the checkpoint's memory-mapped files: a
split layer's shard through ``safe_open(...).get_slice`` (only its part of the tensor is
copied), the rest whole. A tied output embedding is tied again afterwards. The result is the
model :func:`~treeattn.hf.models.load_model` followed by ``tensor_parallel`` gives, bit for
bit, at the cost of its shards instead of the whole model.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open  # a dependency of transformers
from torch import nn

from ..parallel.tensor import ColumnParallel, RowParallel
from ..parallel.vocab import VocabParallelEmbedding, VocabParallelHead
from .tensor_parallel import tensor_parallel


@contextlib.contextmanager
def _params_on_meta():
    """Every parameter made inside goes to the ``meta`` device as it is registered (buffers
    stay real). A parameter's first allocation is never written, so it takes no memory."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _checkpoint(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    where: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            where.update(dict.fromkeys(h.keys(), f))
    return where


def _sources(model: nn.Module) -> dict[str, tuple[str, tuple]]:
    """Each parameter's name -> (the checkpoint's tensor name, the index of this rank's part)."""
    split: dict[str, tuple[str, tuple]] = {}
    for mname, m in model.named_modules():
        if isinstance(m, (ColumnParallel, RowParallel, VocabParallelEmbedding, VocabParallelHead)):
            for local, (src, index) in m.shards().items():
                split[f"{mname}.{local}"] = (f"{mname}.{src}", index)
    return {n: split.get(n, (n, ())) for n, _ in model.named_parameters(remove_duplicate=False)}


def _tied(model: nn.Module) -> set[str]:
    """Names of parameters the model ties to its input embeddings' (the output head's, when tied)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    if w is None:
        return set()
    own = {f"{n}.weight" for n, m in model.named_modules() if m is emb}
    return {n for n, t in model.named_parameters(remove_duplicate=False) if t is w and n not in own}


def _retie(model: nn.Module) -> None:
    """Tie the output head to the loaded input embeddings again (a split head by its rows)."""
    head = model.get_output_embeddings()
    if isinstance(head, VocabParallelHead):
        head.inner.weight = model.get_input_embeddings().weight
    else:
        model.tie_weights()


@torch.no_grad()
def load_split(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
               group: dist.ProcessGroup | None = None, tpa: int = 1) -> tuple:  # fmt: skip
    """``(model in eval mode, tokenizer or None)`` of the local directory ``model_dir``
    (safetensors only, no remote code), its weights split over ``group`` as
    :func:`~treeattn.hf.tensor_parallel` splits them (``tpa`` > 1: the attention heads too,
    each rank reading its slice's Q/K/V rows), each rank reading only its own shards.
    Collective over ``group``: call on every rank.

    Raises:
        ValueError: (every rank) the model cannot be split, or the ranks' models differ;
            (this rank) the checkpoint lacks a tensor the model needs or holds it in another
            shape: the message names the tensor.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d = Path(model_dir)
    config = AutoConfig.from_pretrained(d, local_files_only=True, trust_remote_code=False)
    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.eval()
    tensor_parallel(model, group, tpa=tpa)
    where, tied = _checkpoint(d), _tied(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    todo: dict[Path, list[tuple[str, str, tuple]]] = {}
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    for name, (key, index) in _sources(model).items():
        if key not in where and key.startswith(prefix) and key[len(prefix) :] in where:
            key = key[len(prefix) :]  # a checkpoint of the base model's names (bigscience's BLOOM: "h.0....")
        if key not in where:
            if name in tied:
                continue
            raise ValueError(f"{d}: the checkpoint has no tensor {key!r} (the model's {name})")
        todo.setdefault(where[key], []).append((name, key, index))
    for f, items in todo.items():
        with safe_open(f, framework="pt") as h:  # memory-mapped: only the parts indexed are read
            for name, key, index in items:
                t = h.get_slice(key)[index] if index else h.get_tensor(key)
                want = params[name]
                if tuple(t.shape) != tuple(want.shape):
                    raise ValueError(f"{d}: tensor {key!r} gives {tuple(t.shape)} for the model's {name}, which "
                                     f"needs {tuple(want.shape)}")  # fmt: skip
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, nn.Parameter(t.to(dtype).contiguous(), requires_grad=False))
    if tied:
        _retie(model)
    left = [n for n, t in model.named_parameters() if t.device.type == "meta"]
    if left:
        raise ValueError(f"{d}: no weights in the checkpoint for {', '.join(left[:5])}")
    with contextlib.suppress(OSError, ValueError):
        model.generation_config = GenerationConfig.from_pretrained(d, local_files_only=True)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d, local_files_only=True, trust_remote_code=False)
    except Exception:
        tok = None
    return model, tok
