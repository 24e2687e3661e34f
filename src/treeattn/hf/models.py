"""Where a model comes from (a local directory, a ``.gguf`` file, a hub id) and whether it fits."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .._host import available_memory, cache_root  # noqa: F401  (re-exported: the CLI reads them here)
from ..cost.layouts import shape_of

_WEIGHTS = ("*.safetensors", "*.safetensors.index.json")
_HUB_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "tokenizer*", *_WEIGHTS]


class ModelNotFound(ValueError):
    """``--model`` names nothing usable; the message says what was tried and what to do."""


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1 or "\\" in spec


def resolve_model(spec: str, *, cache_dir: str | os.PathLike | None = None, log=None) -> Path:
    """A local directory holding ``config.json``, safetensors weights and (if any) the
    tokenizer for ``spec``:

    - a directory: itself (it must hold ``config.json`` and safetensors weights);
    - a ``.gguf`` file: its weights dequantised to float32 and its tokenizer, converted once
      by transformers into ``cache_dir`` (default :func:`cache_root`) ``/gguf/<name>-<key>``,
      keyed by the file's path, size and modification time (needs the ``gguf`` package);
    - otherwise a hub id (``org/name``): the local hub cache, else a download of the
      configuration, tokenizer and safetensors files through ``huggingface_hub`` (no
      pickled weights, no remote code).

    Raises:
        ModelNotFound: a missing path, a directory without a model, an unreadable GGUF file,
            or a hub id that is neither cached nor downloadable (offline): the message names
            ``spec`` and says how to point at a local copy.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        _check_dir(path)
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not _is_gguf(path):
            raise ModelNotFound(f"--model {spec}: a file, but not a GGUF file; pass a model directory or a .gguf file")
        return convert_gguf(path, cache_dir=cache_dir, log=log)
    if path.exists():
        raise ModelNotFound(f"--model {spec}: neither a directory nor a file")
    if _looks_like_path(spec):
        raise ModelNotFound(f"--model {spec}: no such file or directory")
    return _from_hub(spec)


def _check_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"--model {path}: the directory has no config.json (not a transformers model directory)")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFound(
            f"--model {path}: no *.safetensors weights in the directory (treeattn loads safetensors only, never "
            "pickled .bin files; convert them with save_pretrained(..., safe_serialization=True))"
        )


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def convert_gguf(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, log=None) -> Path:
    """Convert a GGUF file once into a float32 safetensors model directory (with its
    tokenizer and chat template) and return that directory; later calls return the cached
    one. The conversion is written to a temporary directory and renamed into place, so
    concurrent callers never see half a model. ``log``: optional ``callable(str)`` told when
    a conversion starts and ends (transformers' progress bars show only on a terminal)."""
    path = Path(path).expanduser().resolve()
    try:
        st = path.stat()
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFound(f"--model {path}: cannot read the file ({e.strerror})") from e
    if magic != b"GGUF":
        raise ModelNotFound(f"--model {path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    out = root / "gguf" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelNotFound(f"--model {path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from e
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if log is not None:
        log(f"converting {path.name} to a float32 safetensors model once (cache: {out}) ...")
    if not sys.stderr.isatty():  # no progress bars in logs; the GGUF reader uses a bare tqdm
        hf_logging.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gg
    except ImportError:
        gg = None
    bar = getattr(gg, "tqdm", None)
    try:
        if bar is not None:
            gg.tqdm = functools.partial(bar, disable=None)  # disable=None: off when not a terminal
        kw = dict(gguf_file=path.name, local_files_only=True, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(path.parent, **kw)
    except Exception as e:  # transformers raises many kinds for a corrupt or unsupported file
        raise ModelNotFound(
            f"--model {path}: transformers could not read this GGUF file: {type(e).__name__}: {e}"
        ) from e
    finally:
        if bar is not None:
            gg.tqdm = bar
    model.hf_quantizer = None  # the weights are dequantised float32 now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "treeattn-source.json").write_text(json.dumps({"gguf": str(path), "size": st.st_size}))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if log is not None:
        log("conversion done")
    return out


def _from_hub(repo_id: str) -> Path:
    how = (
        f"download it on a machine with access (e.g. `hf download {repo_id} --local-dir DIR`) and pass "
        "--model DIR, or pass a .gguf file"
    )
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(repo_id)
    except ImportError as e:
        raise ModelNotFound(f"--model {repo_id}: not a local path, and huggingface_hub is not installed") from e
    except Exception as e:
        raise ModelNotFound(f"--model {repo_id}: no such file or directory, and not a valid hub id ({e})") from e
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFound(
            f"--model {repo_id}: not a local path and not in the hub cache, and HF_HUB_OFFLINE is set: {how}"
        )
    try:
        d = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, etag_timeout=10))
    except Exception as e:
        raise ModelNotFound(
            f"--model {repo_id}: not a local path, not in the hub cache, and the hub could not be reached or has no "
            f"such model ({type(e).__name__}): {how}"
        ) from e
    _check_dir(d)
    return d


def load_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple:
    """``(model in eval mode, tokenizer or None)`` from a local directory: safetensors only,
    nothing downloaded, no remote code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank would interleave on the terminal
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, use_safetensors=True, trust_remote_code=False, dtype=dtype
    )
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except Exception:
        tok = None
    return model.eval(), tok


def kv_token_bytes(config, dtype: torch.dtype = torch.float32, tpa: int = 1) -> int:
    """Bytes one token's K/V takes on the rank holding it (every layer; its head slice's KV heads)."""
    m = shape_of(config)
    return m.layers * (m.kv_heads // tpa) * 2 * m.head_dim * (torch.finfo(dtype).bits // 8)


def memory_plan(config, *, prompt_len: int, max_new_tokens: int, nproc: int, batch: int = 1,
                dtype: torch.dtype = torch.float32, prefill_chunk: int | None = 1024,
                n_params: int | None = None, tp: int = 1, tpa: int = 1) -> dict[str, int]:  # fmt: skip
    """Estimated bytes per rank of a generation: ``weights`` (the whole model on every rank,
    or with ``tp`` > 1 its MLP, attention output projections, embeddings and head split over ``tp`` ranks, as
    :func:`treeattn.hf.tensor_parallel` splits them; ``tpa`` > 1: Q/K/V and the K/V heads
    split over ``tpa`` slices too), ``kv_cache`` (this rank's share of
    ``prompt_len + max_new_tokens`` tokens) and ``activations`` (one prefill chunk through the
    widest layer, plus the gathered queries and states of Tree prefill), and their ``total``.
    ``n_params`` (the whole model's, counted elsewhere) is taken as is, split or not."""
    m = shape_of(config)
    es = torch.finfo(dtype).bits // 8
    hd, H = m.head_dim, m.hidden
    if n_params is None:  # embeddings (+ head unless tied) and per layer attention + MLP
        emb = m.vocab * H
        qkv = H * hd * (m.heads + 2 * m.kv_heads) // tpa
        split = H * hd * m.heads + m.mlp_mats * H * m.intermediate
        layer = qkv + -(-split // tp)
        n_params = -(-emb * (1 if m.tied else 2) // tp) + m.layers * layer  # the vocabulary split too
    tokens = -(-(prompt_len + max_new_tokens) // (nproc // tpa)) + 16  # a slice's sequence shards
    kv = batch * tokens * kv_token_bytes(config, dtype, tpa)
    share = -(-prompt_len // nproc)
    chunk = min(share, prefill_chunk or share)
    act = batch * chunk * (4 * H + 3 * m.intermediate) * 4
    act += batch * nproc * chunk * m.heads * (2 * hd + 1) * 4 * 3
    act += batch * m.vocab * 4 * 2
    return {"weights": n_params * es, "kv_cache": kv, "activations": act, "total": n_params * es + kv + act}
