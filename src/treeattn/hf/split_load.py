"""A safetensors checkpoint loaded straight into its split over the ranks: each rank reads only
the rows or columns of the weights it keeps, so no rank ever holds the whole model.

The model is built with its parameters on the ``meta`` device (no memory; buffers such as the
rotary frequencies are computed for real), split by :func:`~treeattn.hf.tensor_parallel` (on
``meta`` still), then every parameter is read from the checkpoint's safetensors files
(:func:`open_checkpoint`): a split layer's shard as its rows (one read) or, for a row-parallel
layer, its part of each row, the rest whole, each straight into memory of its own. Reads, not
a memory map: a mapped file's pages count in the rank's resident memory once touched, and a
row-parallel shard touches every page of its tensor (SmolLM2 at p = 2: 231 MiB of the file
resident beside the 290 MiB of shards). A tied output embedding is tied again afterwards. The result is the
model :func:`~treeattn.hf.models.load_model` followed by ``tensor_parallel`` gives, bit for
bit, at the cost of its shards instead of the whole model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip


class _Slice:
    def __init__(self, ck: _File, key: str) -> None:
        self.ck, self.key = ck, key

    def __getitem__(self, index: tuple) -> torch.Tensor:
        return self.ck.read(self.key, index if isinstance(index, tuple) else (index,))


class _File:
    """One safetensors file, read with ``pread`` (its format: an 8-byte little-endian header
    size, a JSON header of each tensor's dtype, shape and byte range, then the data)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            n = int.from_bytes(os.pread(self.fd, 8, 0), "little")
            head = json.loads(os.pread(self.fd, n, 8))
        except (ValueError, OSError) as err:
            os.close(self.fd)
            raise ValueError(f"{path}: not a safetensors file ({err})") from None
        head.pop("__metadata__", None)
        self.head, self.base = head, 8 + n

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def keys(self) -> list[str]:
        return list(self.head)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.read(key, ())

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key)

    def read(self, key: str, index: tuple) -> torch.Tensor:
        """Tensor ``key``'s part ``index`` (slices of its first one or two dims, step 1), read
        straight into a new tensor: its bytes alone (a part of each row for a column slice)."""
        info = self.head[key]
        dt, shape = _DTYPES.get(info["dtype"]), list(info["shape"])
        if dt is None:
            raise ValueError(f"{self.path}: tensor {key!r} has dtype {info['dtype']}, which treeattn does not read")
        if len(index) > 2 or (len(index) == 2 and len(shape) != 2):
            raise ValueError(f"{self.path}: tensor {key!r}: cannot read part {index} of shape {tuple(shape)}")
        span = []
        for d, ix in enumerate(index):
            a, b, step = ix.indices(shape[d])
            if step != 1:
                raise ValueError(f"{self.path}: tensor {key!r}: strided part {index}")
            span.append((a, max(a, b)))
        es = torch.empty((), dtype=dt).element_size()
        row = es * math.prod(shape[1:])
        start = self.base + info["data_offsets"][0]
        r0, r1 = span[0] if span else (0, shape[0] if shape else 1)
        if len(span) < 2:  # whole rows: one read
            out = torch.empty([r1 - r0, *shape[1:]] if shape else [], dtype=dt)
            self._into(out, start + r0 * row)
            return out
        c0, c1 = span[1]
        out = torch.empty(r1 - r0, c1 - c0, dtype=dt)
        for r in range(r0, r1):  # a row-parallel shard: its columns of each row
            self._into(out[r - r0], start + r * row + c0 * es)
        return out

    def _into(self, t: torch.Tensor, offset: int) -> None:
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        got = 0
        while got < len(buf):
            n = os.preadv(self.fd, [buf[got:]], offset + got)
            if n <= 0:
                raise ValueError(f"{self.path}: truncated (wanted {len(buf)} bytes at {offset})")
            got += n


def open_checkpoint(path: str | os.PathLike) -> _File:
    """One safetensors file, for reading tensors and their parts (``keys()``, ``get_tensor(key)``,
    ``get_slice(key)[index]``, as ``safetensors.safe_open``) by plain reads; a context manager."""
    return _File(Path(path))


def _checkpoint(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    where: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open_checkpoint(f) as h:
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
        with open_checkpoint(f) as h:  # only the parts indexed are read
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
