"""The HTTP layer of ``treeattn serve`` (rank 0): OpenAI's request and response shapes,
server-sent events and errors, on FastAPI. Requests go to the engine's queue as token ids and
numbers; tokens come back as events. Nothing below this module knows about HTTP.

Every field that reaches the ranks is checked here, before anything is queued, so a bad request
gets its 400 without touching the running one (and no value can overflow the int64 broadcasts):

- ``seed``: an integer in ``[-2**63, 2**63)`` (a signed 64-bit integer, as OpenAI's); a negative
  seed means the same 64 bits unsigned (``seed + 2**64``, as ``torch.Generator.manual_seed``
  reads it), so every seed in the range gives its own reproducible stream.
- ``max_tokens`` / ``max_completion_tokens``: an integer in ``[1, 2**31]``, then within the
  model's positions and the prefix cache's ``--cache-tokens``.
- ``temperature`` in ``[0, 2]``, ``top_p`` in ``(0, 1]``: finite numbers (not NaN).
- token ids in a ``prompt``: integers in ``[0, vocabulary)``: the model's ``vocab_size``, and
  the tokenizer's length when there is one (what a tokenizer or chat template makes is checked too).
- text (a prompt, message contents, stop strings) must be valid Unicode: a lone surrogate
  (``"\\ud800"`` in the JSON) is a 400. A string prompt (or the messages together) may have at
  most ``CHARS_PER_POSITION`` (64) characters per model position; longer ones are refused
  before tokenizing. A stop string has at most ``MAX_STOP_CHARS`` (1024) characters, 4 at most.
- integers must be JSON integers (not ``true``, ``"3"`` or ``1.5``); floats may be integers;
  booleans (``stream``, ``include_usage``) JSON booleans (not ``"yes"`` or ``1``). A
  completion takes one prompt (a list of prompts is a 400).
- as vLLM's server: ``null`` is the field left out, and a field this server does not know is
  ignored (logged once per name). A known field it cannot honour (``best_of`` > 1, ``echo``
  on chat, the legacy ``functions``, ...: :data:`NOT_HONOURED`) is a 400 that names it,
  unless it holds its no-op value; so are ``tools`` with a chat template that takes none and
  a ``response_format`` schema that matches nothing.
- vLLM's sampling extras ``top_k`` (-1 or 0: off), ``min_p``, ``typical_p``, ``eta_cutoff``,
  ``repetition_penalty``, ``min_tokens``, ``stop_token_ids`` and ``ignore_eos`` are honoured,
  per request, and so are OpenAI's ``presence_penalty``, ``frequency_penalty`` and
  ``logit_bias`` (:mod:`treeattn.decoding.penalties`).

A body that is not JSON, or nests too deeply to parse, is a 400 too; error bodies are ASCII
JSON, so an odd character in a request never makes its error unprintable.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from .jobs import build_jobs, tools_on
from .metrics import Metrics
from .responses import ErrorJSON as _ErrorJSON
from .responses import stream_answer, whole_answer
from .schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    check_unknown,
)
from .state import ServerState
from .tokenize import add_token_routes


def _error(status: int, message: str, type: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return _ErrorJSON({"error": ApiError(status, message, type, param, code).body}, status_code=status)


SAMPLING_DEFAULTS = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (-1, 2**31), "min_p": (0.0, 1.0),
                     "typical_p": (1e-9, 1.0), "eta_cutoff": (0.0, 0.999999)}  # fmt: skip


def generation_defaults(model) -> dict:
    """The sampling values the model's generation config sets (its non-default fields only, as
    vLLM's ``--generation-config auto``): what a request that leaves them out samples with.
    Values outside the server's own ranges are left out."""
    gc = getattr(model, "generation_config", None)
    diff = gc.to_diff_dict() if gc is not None else {}
    out = {}
    for name, (lo, hi) in SAMPLING_DEFAULTS.items():
        v = diff.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi:
            out[name] = int(v) if name == "top_k" else float(v)
    return out


def _token_name(state: ServerState):
    """A token id -> its text (special tokens too; ``<id>`` without a tokenizer)."""
    tok = state.tokenizer
    if tok is None:
        return lambda i: f"<{i}>"
    return lambda i: tok.decode([i], skip_special_tokens=False)


class _Auth:
    """ASGI middleware: ``/v1/`` wants ``Authorization: Bearer <key>``. Plain ASGI, not
    ``@app.middleware`` (Starlette's BaseHTTPMiddleware): through that, an endpoint never sees
    its client hang up (``request.is_disconnected()`` stays False)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/tokenize", "/detokenize")):
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(got, self.want):
                r = _error(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
                return await r(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="treeattn serve", docs_url=None, redoc_url=None)
    metrics = Metrics(state)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return _ErrorJSON({"error": e.body}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", code="invalid_json")
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ())[1:]) or 'body'}: {er.get('msg')}" for er in errs)
        return _error(400, msg, param=where or None)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        return _error(
            e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500 else "server_error"
        )

    if state.api_key:
        app.add_middleware(_Auth, key=state.api_key)
    if state.allowed_origins:  # added last: runs first, so a browser's preflight is answered before the key check
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip

    def _model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server has {state.model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    add_token_routes(app, state, _model)

    @app.get("/health")
    async def health():
        body = {"status": "ok" if state.failed is None else "failed", "queued": state.requests.qsize(), **state.stats}
        if state.failed is not None:
            body["error"] = state.failed
        return JSONResponse(body, status_code=200 if state.failed is None else 503)

    @app.get("/metrics")
    async def _metrics():  # Prometheus' text format (no API key, as /health)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "treeattn"}]}  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _serve(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, request, chat=False)

    async def _serve(body, request: Request, chat: bool):
        _model(body.model)
        if state.failed is not None:
            raise ApiError(503, f"a rank is gone: {state.failed}", type="server_error", code="rank_failed")
        check_unknown(body)
        jobs = build_jobs(state, body)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for i, job in enumerate(jobs):  # one queue for the choices' events, each tagged with its index
            job.emit = lambda kind, data, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, kind, data))
            metrics.watch(job)
        with state.lock:
            if state.requests.qsize() + len(jobs) > state.max_queue:
                raise ApiError(429, f"the queue is full ({state.max_queue} requests waiting); retry later",
                               type="rate_limit_error", code="queue_full")  # fmt: skip
            for job in jobs:  # together: the first prefills the prompt, the others read its K/V
                state.requests.put(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": state.model_name}  # fmt: skip
        lp = None if jobs[0].logprobs is None else (_token_name(state), jobs[0].logprobs)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(stream_answer(jobs, events, head, chat, usage, lp, tools=tools_on(body)))
        return await whole_answer(jobs, events, request, head, chat, lp, tools=tools_on(body))

    return app
