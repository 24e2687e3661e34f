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

import torch.distributed as dist

from .._argtypes import at_least, memory_size
from ..config import Serving, Speculation, add_arguments
from ..serve.plan import MAX_DRAFT
from .memory import serve_budget
from .model import (
    UsageError,
    add_model_args,
    check_draft_args,
    check_draft_model,
    check_model,
    rank_model,
    ranks_of,
    resolve_tp,
    run_ranks,
    say,
    session_kwargs,
)


def prepare(a: argparse.Namespace) -> str | None:
    """The model directory (None: a preset), checked before any rank starts (under torchrun:
    on every rank); on the local launcher, a port in use is reported before anything loads."""
    if a.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {a.max_queue}")
    check_draft_args(a)
    if not dist.is_initialized():  # the local launcher (torchrun ranks prepare in their group)
        _listen(a.host, a.port).close()
    model_dir, cfg = check_model(a)
    from ..hf.families import max_positions

    pos = max_positions(cfg)
    if a.max_model_len is not None and pos and a.max_model_len > pos:
        raise UsageError(f"--max-model-len {a.max_model_len} exceeds the model's {pos} positions")
    world = ranks_of(a)[0]
    # --tp auto for the K/V the server may hold (--cache-tokens on every rank), else one long request
    resolve_tp(a, cfg, a.cache_tokens * world if a.cache_tokens else min(a.max_model_len or pos or 32768, 32768))
    serve_budget(a, cfg)
    a.draft_dir = check_draft_model(a, cfg, model_dir) if a.speculate == "draft" else None
    a.chat_template = chat_template(a.chat_template)
    if a.chat_template is not None and not model_dir:
        raise UsageError("--chat-template needs a model with a tokenizer (--model); a preset has none")
    return model_dir


def chat_template(spec: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself (vLLM's two forms), parsed
    once here so that a broken one stops the server before any rank starts."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--chat-template {spec}: cannot read the file ({e})") from e
    elif "{{" in spec or "{%" in spec:
        text = spec
    else:
        raise UsageError(f"--chat-template {spec}: no such file, and not a Jinja template (no {{{{ or {{%)")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from e
    return text


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
    from ..decoding.generate import eos_ids
    from ..serve.engine import Engine, RankFailure

    rank, p = dist.get_rank(), dist.get_world_size()
    if local:  # the launcher owns Ctrl-C: it stops every rank
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    model, tok = rank_model(a, model_dir)
    draft = None
    if a.speculate == "draft" and rank == 0:  # it drafts on rank 0 only
        draft = rank_model(a, a.draft_dir, a.draft_model)[0]
    engine = Engine(model, None, session_kwargs(a), a.cache_tokens, max_batch=a.max_batch,
                    num_draft=a.num_draft_tokens if a.speculate else 0, fixed_draft=not a.adaptive_draft,
                    draft_model=draft, draft_tokens=a.draft_cache_tokens,
                    max_num_batched_tokens=a.max_num_batched_tokens)  # fmt: skip
    if rank:
        engine.follow()
        return
    import uvicorn

    from ..serve.api import build_app, generation_defaults
    from ..serve.state import ServerState

    if a.chat_template is not None and tok is not None:  # no tokenizer: chat requests get their 400 as before
        tok.chat_template = a.chat_template

    from ..hf.families import max_positions

    max_pos = max_positions(model.config) or (1 << 62)
    if a.max_model_len is not None:
        max_pos = min(max_pos, a.max_model_len)
    defaults = generation_defaults(model) if a.generation_config == "auto" else {}
    if defaults:
        say(f"treeattn serve: sampling defaults from the model's generation config: {defaults}")
    state = ServerState(model_name(a), tok, max_pos, engine.vocab, engine.per_rank, a.cache_tokens, a.max_queue,
                        eos_ids(model, None, True), engine.stats, api_key=a.api_key,
                        allowed_origins=tuple(a.allowed_origins), defaults=defaults)  # fmt: skip
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
        f"placement {a.placement}, batch {a.max_batch}{', speculate ' + a.speculate if a.speculate else ''}, prefix cache {a.cache_tokens or 'off'}"
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
    add_model_args(g)
    g.add_argument("--chat-template", help="the chat template for /v1/chat/completions (a file, or the Jinja "
                   "template itself), in place of the tokenizer's own (default: the tokenizer's)")
    g.add_argument("--served-model-name", help="the model name clients send (default: the model's file or dir name)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    g.add_argument("--port", type=at_least(0), default=8000, help="port (default 8000; 0: any free port)")
    g.add_argument("--api-key", default=os.environ.get("TREEATTN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default $TREEATTN_API_KEY)")  # fmt: skip
    add_arguments(g, Serving)
    g.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory for the K/V on each rank, in place of --cache-tokens: a size (8GiB, 512MiB, 2G, "
                   "bytes) or a fraction in (0, 1) of the memory available at start after the weights (checked at "
                   "start, as the weights, --cache-tokens and a step's activations are)")  # fmt: skip
    add_arguments(g, Speculation, skip=("tree_width",), helps={
        "speculate": "speculative decoding inside the batched step: each request drafts from its own prompt and answer "
        "(prompt-lookup: a document it quotes) or from a --draft-model run on rank 0, as deep as measured step costs "
        "and its acceptance make worth it; answers unchanged",
        "num_draft_tokens": f"with --speculate: the most tokens a request drafts per step (default 5, at most {MAX_DRAFT})",
        "adaptive_draft": "with --speculate: every draft found, as deep as it goes (default: as deep as measured step "
        "costs and acceptance make worth it)"}, highs={"num_draft_tokens": MAX_DRAFT})  # fmt: skip
    g.add_argument("--draft-model", help="the draft model of --speculate draft (same kinds of path as --model, or a "
                   "preset); it needs the model's tokenizer, and keeps a KV cache per drafting request on rank 0")  # fmt: skip
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429 (default 64)")
    g.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    g.add_argument("--max-model-len", type=at_least(1), default=None,
                   help="the most positions a request's prompt and answer may take (default: the model's)")
    g.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto (default, as vLLM): a request that leaves temperature, top_p, top_k, min_p, typical_p "
                   "or eta_cutoff out samples with the model's generation_config.json values; none: OpenAI's "
                   "defaults (temperature 1, no cut-off)")  # fmt: skip
    g.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="CORS: the origins browsers may call this server from (e.g. http://localhost:3000, or *; "
                   "default none: no CORS headers)")  # fmt: skip
    g.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("treeattn serve needs FastAPI and uvicorn: pip install 'treeattn[serve]'", file=sys.stderr)
        return 2
    return run_ranks("serve", a, worker, prepare, timeout=float("inf"), stopped_status=0)
