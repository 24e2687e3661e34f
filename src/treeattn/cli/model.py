"""What ``treeattn generate`` and ``treeattn serve`` share: the model and parallelism
arguments, checking the model before any rank starts, building it on a rank, and running a
worker on local ranks or under torchrun. One path, so the two commands cannot drift."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._argtypes import at_least, positive_float
from ..config import Layout, add_arguments, from_args
from ..dtypes import CHOICES


class UsageError(ValueError):
    """A bad command line or input, reported as one line (no traceback)."""


def say(msg: str) -> None:
    """Status lines go to stderr: stdout carries only generated text."""
    print(msg, file=sys.stderr, flush=True)


def add_model_args(g: argparse.ArgumentParser, *, cuda_graph: bool = False) -> None:
    """The model, its dtype and the ranks, and the :class:`~treeattn.config.Layout` (its
    ``--cuda-graph`` with ``cuda_graph``): the arguments both commands take."""
    from ..hf.presets import PRESETS

    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local model directory (safetensors), a .gguf file (converted once into "
                     "~/.cache/treeattn or $TREEATTN_CACHE_DIR), or a hub id (from the local hub cache, else "
                     "downloaded: config, tokenizer, safetensors)")  # fmt: skip
    src.add_argument("--preset", default="tiny-llama", choices=list(PRESETS),
                     help="random-weight config (default tiny-llama)")  # fmt: skip
    g.add_argument("--nproc", type=at_least(1), default=2, help="local ranks to launch (ignored under torchrun)")
    add_arguments(g, Layout, skip=() if cuda_graph else ("cuda_graph",))
    g.add_argument("--tp", type=_tp, default=1,
                   help="ranks each layer's MLP and attention output weights are split over: 1 (default: every rank "
                   "holds and reads them whole) or every rank (--nproc, or torchrun's world): each reads 1/p of them "
                   "per step, with two small all-reduces per layer; auto: whichever the cost model "
                   "(treeattn.cost.layouts.pick_tp, $TREEATTN_PROFILE or the built-in preset) says decodes faster")  # fmt: skip
    g.add_argument("--tpa", type=_tp, default=1,
                   help="with --tp split: the attention heads split over this many slices of ranks, each slice's "
                   "K/V sharded along the sequence over the other ranks (Helix's TPA x KVP; it divides the ranks and "
                   "the KV heads; default 1: every rank computes every head); auto: by the cost model")  # fmt: skip
    g.add_argument("--dtype", choices=CHOICES, default="float32")
    g.add_argument("--seed", type=int, default=0,
                   help="the random weights of a --preset (generate: also sampling, --prompt-len prompts)")  # fmt: skip
    g.add_argument("--threads", type=at_least(1), default=1, help="compute threads per rank (default 1)")
    g.add_argument("--linear", choices=["packed", "torch"], default="packed",
                   help="CPU float32 linear layers: packed (default: weights reordered once for treeattn's AVX-512 "
                   "kernel, else oneDNN's; faster, and a row's result does not depend on its batch) or torch (the "
                   "model's own nn.Linear)")  # fmt: skip
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL (torchrun)")
    g.add_argument("--collective-timeout", type=positive_float, default=120.0,
                   help="seconds a collective may wait for a peer before every rank fails (default 120)")  # fmt: skip


def ranks_of(a: argparse.Namespace) -> tuple[int, int]:
    """(ranks, ranks on this host): the launcher's ``--nproc``, or torchrun's."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return a.nproc, a.nproc


def model_config(spec: str) -> tuple:
    """(directory, config) of a ``--model`` argument; UsageError when it cannot be found."""
    from transformers import AutoConfig

    from ..hf.models import ModelNotFound, resolve_model

    try:
        d = str(resolve_model(spec, log=say))
    except ModelNotFound as e:
        raise UsageError(str(e)) from e
    return d, AutoConfig.from_pretrained(d, local_files_only=True, trust_remote_code=False)


def _tp(s: str) -> int | str:
    return "auto" if s == "auto" else at_least(1)(s)


def resolve_tp(a: argparse.Namespace, cfg, tokens: int) -> None:
    """``--tp auto`` -> 1 or the number of ranks, ``--tpa auto`` -> the head split, by the cost
    model for ``tokens`` tokens in the cache (every rank decides alike: the same config, preset
    and profile)."""
    if a.tp != "auto" and getattr(a, "tpa", 1) != "auto":
        return
    from ..cost.layouts import pick_tp, shape_of
    from ..cost.profile import resolve

    world = ranks_of(a)[0]
    cluster, where = resolve(None, "nccl" if a.device == "cuda" else "gloo")
    es = torch.finfo(getattr(torch, a.dtype)).bits // 8
    asked = ["--tp auto" if a.tp == "auto" else None, "--tpa auto" if getattr(a, "tpa", 1) == "auto" else None]
    tpa = None if asked[1] else getattr(a, "tpa", 1)
    try:
        tp, whole, split = pick_tp(cluster, shape_of(cfg), world, max(tokens, 1), dtype_bytes=es, tpa=tpa)
    except ValueError as e:  # a cluster of fewer ranks
        raise UsageError(f"--tp auto: {e}") from e
    if a.tp == "auto":
        a.tp = world if tpa not in (None, 1) else tp  # a head split asked for needs the weights split
    a.tpa = (split.tpa if a.tp > 1 else 1) if tpa is None else tpa
    if int(os.environ.get("RANK", "0")) == 0:
        said = ", ".join(f"{x}: {v}" for x, v in zip(asked, (a.tp, a.tpa), strict=True) if x)
        say(f"{said} ({where}, {tokens:,} tokens over {world} ranks: weights whole "
            f"{1e3 * whole.seconds:.2f} ms/token, split at TPA {split.tpa} {1e3 * split.seconds:.2f})")  # fmt: skip


def check_model(a: argparse.Namespace) -> tuple:
    """(directory or None for a preset, config) of ``--model``/``--preset``; UsageError for a
    model that cannot be found or that treeattn cannot run, or a ``--tp`` that is neither 1
    nor the number of ranks."""
    from ..hf.families import unsupported_reason
    from ..hf.presets import preset_config

    world = ranks_of(a)[0]
    if a.tp not in (1, world, "auto"):
        raise UsageError(f"--tp {a.tp}: the weights split over 1 rank (whole) or every rank ({world}), not {a.tp}")
    tpa = getattr(a, "tpa", 1)
    if tpa not in (1, "auto") and a.tp == 1:
        raise UsageError(f"--tpa {tpa} splits the attention heads of split weights: it needs --tp {world} (or auto)")

    model_dir, cfg = model_config(a.model) if a.model else (None, preset_config(a.preset))
    why = unsupported_reason(cfg)
    if why is not None:
        raise UsageError(why)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hkv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if tpa not in (1, "auto") and (world % tpa or hkv % tpa):
        raise UsageError(f"--tpa {tpa} must divide the ranks ({world}) and the model's KV heads ({hkv})")
    return model_dir, cfg


def check_draft_args(a: argparse.Namespace) -> None:
    """``--speculate draft`` and ``--draft-model`` come together or not at all."""
    if a.speculate == "draft" and not a.draft_model:
        raise UsageError("--speculate draft needs --draft-model")
    if a.draft_model and a.speculate != "draft":
        raise UsageError("--draft-model is used by --speculate draft only")
    if getattr(a, "draft_cache_tokens", None) is not None and not a.draft_model:
        raise UsageError("--draft-cache-tokens is used with --draft-model only")


def check_draft_model(a: argparse.Namespace, cfg, model_dir: str | None) -> str | None:
    """The directory of ``--draft-model`` (None: a preset), checked against the target's
    config ``cfg`` (its vocabulary) and tokenizer before any rank starts."""
    from transformers import AutoTokenizer

    from ..hf.presets import PRESETS, preset_config

    if a.draft_model in PRESETS:
        d, dcfg = None, preset_config(a.draft_model)
    else:
        try:
            d, dcfg = model_config(a.draft_model)
        except UsageError as e:
            raise UsageError(str(e).replace("--model", "--draft-model", 1)) from e
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    dcfg = dcfg.get_text_config() if hasattr(dcfg, "get_text_config") else dcfg
    if dcfg.vocab_size != cfg.vocab_size:
        raise UsageError(
            f"--draft-model {a.draft_model}: its vocabulary ({dcfg.vocab_size:,} tokens) differs from the model's "
            f"({cfg.vocab_size:,}); a draft model needs the same tokenizer"
        )
    if d and model_dir:
        kw = dict(local_files_only=True, trust_remote_code=False)
        try:
            same = AutoTokenizer.from_pretrained(d, **kw).get_vocab() == AutoTokenizer.from_pretrained(
                model_dir, **kw).get_vocab()  # fmt: skip
        except Exception:
            same = True  # a model without a tokenizer: the vocabulary size was checked
        if not same:
            raise UsageError(f"--draft-model {a.draft_model}: its tokenizer differs from the model's")
    return d


def session_kwargs(a: argparse.Namespace) -> dict:
    """The Session keywords the :class:`~treeattn.config.Layout` options give (``cuda_graph``
    only on a CUDA device)."""
    lay = from_args(Layout, a)
    kw = {f: getattr(lay, f) for f in Layout.__dataclass_fields__}
    kw["cuda_graph"] = lay.cuda_graph and a.device == "cuda"
    return kw


def rank_model(a: argparse.Namespace, model_dir: str | None, spec: str | None = None, split: bool = True) -> tuple:
    """On a rank: (model, tokenizer or None) of ``model_dir`` (None: the preset or hub id
    ``spec``, default ``--preset``), in ``--dtype``, on this rank's device, its weights split
    over the ranks with ``--tp`` (and ``split``: :func:`treeattn.hf.tensor_parallel`; from a
    directory each rank reads only its shards, :func:`treeattn.hf.load_split`); on CPU
    the decode kernel is built (or loaded) here, before any timing starts, and with ``--linear
    packed`` the float32 linears are packed (:func:`treeattn.hf.linear.pack_linears`)."""
    from ..hf.presets import build_model

    dtype = getattr(torch, a.dtype)
    if split and spec is None and getattr(a, "tp", 1) > 1:  # a draft model (spec) runs whole on rank 0
        from ..hf.split_load import load_split
        from ..hf.tensor_parallel import tensor_parallel

        if model_dir:  # each rank reads its shards of the checkpoint only
            model, tok = load_split(model_dir, dtype, tpa=a.tpa)
        else:
            model, tok = build_model(a.preset, None, dtype, a.seed)
            tensor_parallel(model, tpa=a.tpa)
    else:
        model, tok = build_model(a.preset if spec is None else spec, model_dir, dtype, a.seed)
    if a.device == "cuda":  # one GPU per rank
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        model = model.to(dev)
    else:
        from ..ops import kernel_available

        kernel_available()
        if getattr(a, "linear", "torch") == "packed":
            from ..hf.linear import pack_linears

            pack_linears(model)
    return model, tok


def run_ranks(cmd: str, a: argparse.Namespace, worker: Callable, prepare: Callable, *, timeout: float,
              stopped_status: int = 130) -> int:  # fmt: skip
    """Run ``worker(a, prepare(a), local)`` on every rank; the exit status.

    Under torchrun every rank prepares its own job (``local`` False) in the process group
    torchrun describes, with ``--threads`` and ``--collective-timeout``, destroyed on the way
    out. Otherwise the job is prepared once here and ``--nproc`` local ranks are launched
    (``local`` True); Ctrl-C or SIGTERM stop every rank and give ``stopped_status``. A
    :class:`UsageError` gives 2 (one line on stderr), a failed rank 1.
    """
    from ..launch import LaunchError, launch, torchrun_group, under_torchrun

    backend = "nccl" if a.device == "cuda" else "gloo"
    if under_torchrun():
        with torchrun_group(backend, a.threads, a.collective_timeout):
            try:
                worker(a, prepare(a), False)
            except UsageError as e:
                if dist.get_rank() == 0:
                    print(f"treeattn {cmd}: {e}", file=sys.stderr)
                return 2
        return 0

    def stop(signum, frame):
        raise KeyboardInterrupt

    before = {}
    if threading.current_thread() is threading.main_thread():  # SIGINT too: a shell's background job
        before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}  # inherits it ignored
    try:
        job = prepare(a)
        if a.device == "cpu":  # build (or load) the decode kernel once, before the ranks start
            from ..ops import kernel_available

            kernel_available()
        launch(worker, a.nproc, (a, job, True), threads=a.threads, timeout=timeout,
               collective_timeout=a.collective_timeout, backend=backend)  # fmt: skip
    except UsageError as e:
        print(f"treeattn {cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # launch() has killed every rank on the way out
        print(f"treeattn {cmd}: stopped", file=sys.stderr)
        return stopped_status
    except LaunchError as e:
        print(f"treeattn {cmd} failed: {e}", file=sys.stderr)
        return 1
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    return 0
