"""``treeattn serve``: an OpenAI-compatible server whose ranks keep a sharded prefix cache."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .._argtypes import at_least
from ..comm.strategies import STRATEGIES
from ..hf.cli import UsageError, model_config, say
from ..hf.presets import PRESETS, build_model, preset_config


def prepare(a: argparse.Namespace) -> str | None:
    """The model directory (None: a preset), checked before any rank starts."""
    from ..hf.families import unsupported_reason

    if a.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {a.max_queue}")
    model_dir, cfg = model_config(a.model) if a.model else (None, preset_config(a.preset))
    why = unsupported_reason(cfg)
    if why is not None:
        raise UsageError(why)
    return model_dir


def model_name(a: argparse.Namespace) -> str:
    if a.served_model_name:
        return a.served_model_name
    if not a.model:
        return a.preset
    p = Path(a.model)
    return p.stem if p.suffix == ".gguf" else p.name if p.exists() else a.model


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def worker(a: argparse.Namespace, model_dir: str | None, local: bool) -> None:
    from ..hf.generate import _eos_ids
    from .engine import Engine, RankFailure

    rank, p = dist.get_rank(), dist.get_world_size()
    if local:  # the launcher owns Ctrl-C: it stops every rank
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if model_dir is None and a.model:  # torchrun: every rank resolves the model itself
        model_dir = prepare(a)
    model, tok = build_model(a.preset, model_dir, getattr(torch, a.dtype), a.seed)
    if a.device == "cuda":  # one GPU per rank (untested here: no GPU)
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        model = model.to(dev)
    else:
        from ..ops._decode_cpu import kernel_available

        kernel_available()
    kw = dict(placement=a.placement, attention=a.attention, strategy=a.strategy,
              prefill_chunk=a.prefill_chunk or None, block=a.block, prefill=a.prefill)  # fmt: skip
    engine = Engine(model, None, kw, a.cache_tokens, max_batch=a.max_batch)
    if rank:
        engine.follow()
        return
    import uvicorn

    from .api import ServerState, build_app

    max_pos = getattr(model.config, "max_position_embeddings", None) or (1 << 62)
    state = ServerState(model_name(a), tok, max_pos, engine.vocab, engine.per_rank, a.cache_tokens, a.max_queue,
                        _eos_ids(model, None, True), engine.stats, api_key=a.api_key)  # fmt: skip
    sock = _listen(a.host, a.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(build_app(state), log_level="info" if a.access_log else "warning",
                            access_log=a.access_log, timeout_graceful_shutdown=2)  # fmt: skip
    server = uvicorn.Server(config)
    web = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    web.start()
    while not server.started and web.is_alive():
        time.sleep(0.05)
    if not web.is_alive():
        raise RuntimeError("the HTTP server did not start")
    stopping = threading.Event()
    if not local:  # torchrun: SIGINT/SIGTERM on rank 0 stop every rank
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda *_: stopping.set())
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    say(f"treeattn serve: listening on {url} (model {state.model_name}, p={p}, {a.dtype}, attention {a.attention}, "
        f"placement {a.placement}, batch {a.max_batch}, prefix cache {a.cache_tokens or 'off'}"
        f"{' KV tokens per rank' if a.cache_tokens else ''}, queue {a.max_queue})")  # fmt: skip
    try:
        engine.serve(state.requests, stopping, on_failure=lambda why: setattr(state, "failed", why))
    except RankFailure:
        while not state.requests.empty():  # nobody will run them
            state.requests.get_nowait().emit("error", (503, f"a rank is gone: {state.failed}"))
        time.sleep(1.0)  # let the error responses go out
        raise
    finally:
        server.should_exit = True
        web.join(5)


def add_parser(sub) -> None:
    g = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server whose ranks keep the KV cache sharded between requests",
        description="An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health) "
        "over ranks that keep the KV of earlier requests sharded as it was built: a request sharing a prefix with "
        "a cached one prefills only the rest. Rank 0 serves HTTP; up to --max-batch requests run together, one "
        "forward per step, their queries reading a shared prefix once (FIFO admission).",
    )
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local model directory, a .gguf file or a hub id (as treeattn generate)")
    src.add_argument("--preset", default="tiny-llama", choices=list(PRESETS), help="random-weight config (tests)")
    g.add_argument("--served-model-name", help="the model name clients send (default: the model's file or dir name)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    g.add_argument("--port", type=at_least(0), default=8000, help="port (default 8000; 0: any free port)")
    g.add_argument("--api-key", default=os.environ.get("TREEATTN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default $TREEATTN_API_KEY)")  # fmt: skip
    g.add_argument("--nproc", type=at_least(1), default=2, help="local ranks to launch (ignored under torchrun)")
    g.add_argument(
        "--cache-tokens",
        type=at_least(0),
        default=32768,
        help="KV tokens per rank the prefix cache may hold, the running requests included (a shared prefix counts "
        "once); least recently used prefixes no running request reads go first (default 32768; 0: no prefix cache)",
    )
    g.add_argument("--max-batch", type=at_least(1), default=8,
                   help="requests that run at once, batched into one forward per step (default 8; 1: one at a time)")  # fmt: skip
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429 (default 64)")
    g.add_argument("--attention", choices=["tree", "ring"], default="tree", help="decoding: Tree or Ring Attention")
    g.add_argument("--prefill", choices=["auto", "tree", "ring"], default="auto",
                   help="how prompts are prefilled across ranks (default auto: per chunk, fewer bytes)")  # fmt: skip
    g.add_argument("--strategy", choices=STRATEGIES, default="auto")
    g.add_argument("--placement", choices=["interleaved", "contiguous"], default="interleaved")
    g.add_argument("--block", type=at_least(1), default=None,
                   help="tokens per placement block (default: by each new prompt's length, up to 256)")  # fmt: skip
    g.add_argument("--prefill-chunk", type=at_least(0), default=1024, help="prompt tokens per rank per step (0: all)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    g.add_argument("--seed", type=int, default=0, help="weights of a --preset")
    g.add_argument("--threads", type=at_least(1), default=1, help="compute threads per rank (default 1)")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL (torchrun)")
    g.add_argument("--collective-timeout", type=float, default=120.0, help="seconds a collective may wait")
    g.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    g.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("treeattn serve needs FastAPI and uvicorn: pip install 'treeattn[serve]'", file=sys.stderr)
        return 2
    from ..launch import LaunchError, launch, torchrun_group, under_torchrun

    if under_torchrun():  # the collective timeout as under the launcher; the group destroyed on the way out
        with torchrun_group("nccl" if a.device == "cuda" else "gloo", a.threads, a.collective_timeout):
            try:
                worker(a, None, local=False)
            except UsageError as e:
                if dist.get_rank() == 0:
                    print(f"treeattn serve: {e}", file=sys.stderr)
                return 2
        return 0

    try:
        model_dir = prepare(a)
        _listen(a.host, a.port).close()  # a port in use: say so before loading anything
    except UsageError as e:
        print(f"treeattn serve: {e}", file=sys.stderr)
        return 2
    if a.device == "cpu":  # build (or load) the decode kernel once, before the ranks start
        from ..ops._decode_cpu import kernel_available

        kernel_available()

    def stop(signum, frame):
        raise KeyboardInterrupt

    for s in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell's background job inherits it ignored
        signal.signal(s, stop)
    try:
        launch(worker, a.nproc, (a, model_dir, True), threads=a.threads, timeout=float("inf"),
               collective_timeout=a.collective_timeout, backend="nccl" if a.device == "cuda" else "gloo")  # fmt: skip
    except KeyboardInterrupt:  # launch() has killed every rank on the way out
        print("treeattn serve: stopped", file=sys.stderr)
        return 0
    except LaunchError as e:
        print(f"treeattn serve failed: {e}", file=sys.stderr)
        return 1
    return 0
