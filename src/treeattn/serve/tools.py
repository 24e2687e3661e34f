"""Tool calls (OpenAI's ``tools`` and ``tool_choice``) for chat models whose template takes
tools and writes calls in Hermes' format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Qwen2.5, Hermes, SmolLM3 and others): the tools reach the model through its chat template;
the answer is parsed for such calls; ``tool_choice: "required"`` or a named function
constrains the answer to a call of those tools, its arguments following their JSON schema
(a grammar through :mod:`treeattn.serve.grammar`). A template without tools, or one that
writes calls another way, is a 400 naming ``tools``."""

from __future__ import annotations

import json
import re

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


class ToolError(ValueError):
    """Tools this server cannot honour for this model (the message says why)."""


def check_template(template: str | None) -> None:
    """ToolError unless the chat template takes ``tools`` and writes Hermes-format calls."""
    if not template or "tools" not in template:
        raise ToolError("tools: the model's chat template takes no tools (give one with --chat-template)")
    if OPEN not in template:
        raise ToolError(f"tools: the model's chat template writes tool calls in a format this server does not "
                        f"parse (it parses Hermes' {OPEN}...{CLOSE})")  # fmt: skip


def for_template(tools: list[dict]) -> list[dict]:
    """The request's tools as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}}
            for t in tools]  # fmt: skip


def messages(body_messages) -> list[dict]:
    """The chat messages for the template: assistant tool calls (arguments as objects, as
    templates expect) and tool results included."""
    out = []
    for m in body_messages:
        d = {"role": "system" if m.role == "developer" else m.role,
             "content": m.content if isinstance(m.content, str) or m.content is None
             else "".join(p.text for p in m.content)}  # fmt: skip
        calls = getattr(m, "tool_calls", None)
        if calls:
            d["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.function.name,
                                "arguments": _loads(c.function.arguments)}} for c in calls]  # fmt: skip
        if getattr(m, "tool_call_id", None):
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _loads(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


def forced_grammar(tools: list[dict], choice) -> str | None:
    """The Lark grammar (llguidance's, with ``%json``) of the calls ``tool_choice`` demands:
    one call of any tool (``"required"``) or of the named one; None: the model chooses."""
    if choice in (None, "auto", "none"):
        return None
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools")
    alts = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}}}
            for f in fns]  # fmt: skip
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    return f"start: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}"


def parse(text: str, request_id: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of an answer: the text before the first call (None when
    empty and there are calls), and each well-formed call in OpenAI's shape."""
    calls = []
    for i, m in enumerate(_CALL.finditer(text)):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{request_id}_{i}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args)}})  # fmt: skip
    if not calls:
        return text, []
    content = text[: text.index(OPEN)].strip()
    return content or None, calls


def visible(text: str) -> str:
    """What of a streamed answer's text may go out as content now: up to a tool call's start,
    holding back a tail that may begin one."""
    at = text.find(OPEN)
    if at >= 0:
        return text[:at]
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return text[: len(text) - k]
    return text
