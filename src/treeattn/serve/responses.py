"""OpenAI's response shapes of ``treeattn serve``: a whole answer or a stream of server-sent
events, over the engine's events for a request's choices (one job per choice, its events
tagged with its index). A client that leaves cancels every choice."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.sse import format_sse_event

from . import logprobs as LP
from . import tools as TOOLS
from .request import Request as Job
from .schema import ApiError


class ErrorJSON(JSONResponse):
    """An error body as ASCII JSON: a message that quotes a request's odd characters (a lone
    surrogate) still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


async def _next(events: asyncio.Queue, jobs: list[Job], request: Request | None, seen: list[float]):
    """The next ``(index, kind, data)``; when ``request`` is given, a client that left cancels
    the jobs: checked every 0.5 s (``seen[0]``: the last check), whether or not events keep coming."""
    while True:
        if request is not None and time.monotonic() - seen[0] >= 0.5:
            seen[0] = time.monotonic()
            if await request.is_disconnected():
                for job in jobs:
                    job.cancelled.set()
                return (0, "error", (499, "client closed the request"))
        try:
            return await asyncio.wait_for(events.get(), 0.5)
        except TimeoutError:
            pass


def _usage(ends: list[dict]) -> dict:
    """One request's usage over its choices' ends: the prompt counted once (its cached tokens:
    the first choice's, which prefilled it), the completions summed."""
    n, c = ends[0]["prompt_tokens"], sum(e["completion_tokens"] for e in ends)
    out = {"prompt_tokens": n, "completion_tokens": c, "total_tokens": n + c,
           "prompt_tokens_details": {"cached_tokens": ends[0]["cached_tokens"]}}  # fmt: skip
    drafted = [e["drafted"] for e in ends if e.get("drafted") is not None]
    if drafted:  # speculation: drafted tokens the model accepted and rejected
        out["completion_tokens_details"] = {"accepted_prediction_tokens": sum(a for a, _ in drafted),
                                            "rejected_prediction_tokens": sum(r for _, r in drafted)}  # fmt: skip
    return out


def _fail(status: int, msg: str) -> dict:
    return ApiError(status, msg, type="server_error" if status >= 500 else "invalid_request_error").body


def _logprobs(lp, entries: list, chat: bool, offset: int) -> dict | None:
    """A choice's ``logprobs`` (None when not asked for)."""
    if lp is None:
        return None
    name, top = lp
    return LP.chat(entries, name) if chat else LP.completion(entries, name, offset, top)


async def whole_answer(jobs: list[Job], events: asyncio.Queue, request: Request, head: dict, chat: bool, lp=None,
                       tools: bool = False):  # fmt: skip
    """The whole answer (``tools``: each chat choice's text parsed for tool calls)."""
    n = len(jobs)
    parts, entries, ends, seen = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, [time.monotonic()]
    try:
        while any(e is None for e in ends):
            i, kind, data = await _next(events, jobs, request, seen)
            if kind == "logprobs":
                entries[i] += data
            elif kind == "text":
                parts[i].append(data)
            elif kind == "error":  # one choice failed: the request fails
                return ErrorJSON({"error": _fail(*data)}, status_code=data[0])
            elif kind == "end":
                ends[i] = data
    finally:
        for job in jobs:  # an answer given or failed: nothing more is computed for it
            job.cancelled.set()
    choices = []
    for i in range(n):
        text = "".join(parts[i])
        c = {"index": i, "finish_reason": ends[i]["finish_reason"], "logprobs": _logprobs(lp, entries[i], chat, 0)}
        c.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        if tools:
            content, calls = TOOLS.parse(text, f"{head['id']}_{i}")
            if calls:
                c["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                c["finish_reason"] = "tool_calls"
        choices.append(c)
    return {**head, "choices": choices, "usage": _usage(ends)}


async def stream_answer(jobs: list[Job], events: asyncio.Queue, head: dict, chat: bool, usage: bool, lp=None,
                        tools: bool = False):  # fmt: skip
    """The answer as server-sent events (``tools``: content up to a tool call's start, then
    the calls as ``tool_calls`` deltas when the choice ends)."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    n = len(jobs)
    pending, sent, ends = [[] for _ in range(n)], [0] * n, [None] * n  # per choice: logprob entries, characters
    whole, shown = [""] * n, [0] * n  # with tools: each choice's text so far, and how much went out

    def chunk(i: int, text: str | None, finish: str | None, first: bool = False) -> bytes:
        lps = _logprobs(lp, pending[i], chat, sent[i]) if pending[i] or (lp is not None and text) else None
        pending[i] = []
        sent[i] += len(text or "")
        if chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            c = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lps}
        else:
            c = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lps}
        return _sse({**head, "choices": [c], **({"usage": None} if usage else {})})

    try:
        while any(e is None for e in ends):
            i, kind, data = await _next(events, jobs, None, [0.0])
            if kind == "start":
                if chat:
                    yield chunk(i, None, None, first=True)
            elif kind == "logprobs":
                pending[i].extend(data)
            elif kind == "text" and tools:
                whole[i] += data
                out = TOOLS.visible(whole[i])[shown[i] :]
                if out:
                    shown[i] += len(out)
                    yield chunk(i, out, None)
            elif kind == "text":
                yield chunk(i, data, None)
            elif kind == "error":
                yield _sse({"error": _fail(*data)})
                break
            elif kind == "end":
                ends[i] = data
                finish = data["finish_reason"]
                if tools:
                    _, calls = TOOLS.parse(whole[i], f"{head['id']}_{i}")
                    if calls:
                        finish = "tool_calls"
                        deltas = [{"index": k, **c} for k, c in enumerate(calls)]
                        yield _sse({**head, "choices": [{"index": i, "delta": {"tool_calls": deltas},
                                                         "finish_reason": None, "logprobs": None}]})  # fmt: skip
                    elif whole[i][shown[i] :]:  # held back, and no call after all
                        yield chunk(i, whole[i][shown[i] :], None)
                yield chunk(i, None, finish)
        else:
            if usage:
                yield _sse({**head, "choices": [], "usage": _usage(ends)})
        yield format_sse_event(data_str="[DONE]")
    finally:  # the client left (the task was cancelled) or the answer is complete
        for job in jobs:
            job.cancelled.set()


def _sse(obj: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))
