"""The OpenAI request shapes ``treeattn serve`` takes (pydantic), read as vLLM reads them: every
value range-checked before anything is queued (see :mod:`treeattn.serve.api`), ``null`` the
field left out, unknown fields logged once and ignored, known fields this server cannot honour
a 400 that names them."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.body = status, {"message": message, "type": type, "param": param, "code": code}


SEED_RANGE = (-(2**63), 2**63)  # a signed 64-bit integer; negative: the same 64 bits unsigned
MAX_NEW_TOKENS = 2**31  # max_tokens / max_completion_tokens at most (then the model's positions)
MAX_STOP_CHARS = 1024  # characters per stop string
CHARS_PER_POSITION = 64  # a string prompt's characters per model position, at most (checked before tokenizing)


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {e.start}") from None
    return s


def _seed(v: int) -> int:
    lo, hi = SEED_RANGE
    if not lo <= v < hi:
        raise ValueError("seed must be an integer in [-2**63, 2**63) (a signed 64-bit integer)")
    return v


def _either(one: str, many: str, what: str, nested: bool = True) -> Discriminator:
    """A string or a list: the errors of the member the value's JSON type picks, no other's
    (``nested`` False: a list of lists or strings is neither)."""

    def pick(v):
        if isinstance(v, list) and not nested and v and isinstance(v[0], list | str):
            return None
        return one if isinstance(v, str) else many if isinstance(v, list) else None

    return Discriminator(pick, custom_error_type="union_type", custom_error_message=f"Input should be {what}")


Text = Annotated[str, Field(strict=True), AfterValidator(_unicode)]
Int = Annotated[int, Field(strict=True)]  # a JSON integer: not true, "3" or 1.5
Bool = Annotated[bool, Field(strict=True)]  # a JSON true or false: not "yes" or 1
Count = Annotated[int, Field(strict=True, ge=1, le=MAX_NEW_TOKENS)]
Stop = Annotated[str, Field(strict=True, max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]
MAX_N = 16  # choices a request may ask for (n)
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**63)]  # then below the vocabulary (_ids)


log = logging.getLogger("treeattn.serve")
_logged: set[str] = set()  # unknown field names already logged

# known fields this server cannot honour -> their no-op values (what they may hold); any other
# value is a 400 naming the field. Types count: true is not 1.
NOT_HONOURED: dict[str, tuple] = {
    "best_of": (1,), "echo": (False,), "suffix": ("",),  # (echo: on completions only)
    "tools": (), "tool_choice": ("none", "auto"),  # (on completions: chat declares them)
    "functions": (), "function_call": ("none",),
    "audio": (), "modalities": (["text"],), "prediction": (),
    "web_search_options": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (),
}  # fmt: skip


def _no_op(value, allowed: tuple) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed)


class _Lenient(BaseModel):
    """A request object as vLLM reads one: ``null`` is the field left out, unknown fields are
    kept aside (:func:`check_unknown` logs and ignores them)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        if isinstance(data, dict):
            for k in data:
                _unicode(k) if isinstance(k, str) else None  # a field name must be valid Unicode too
            return {k: v for k, v in data.items() if v is not None}
        return data


class TextPart(_Lenient):
    type: Literal["text"]
    text: Text


class CallFunction(_Lenient):
    name: Text
    arguments: Text  # JSON text


class ToolCall(_Lenient):
    id: Text
    type: Literal["function"] = "function"
    function: CallFunction


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[Annotated[Text, Tag("text")] | Annotated[list[TextPart], Tag("parts")],
                       _either("text", "parts", "a string or a list of text parts")] | None = None  # fmt: skip
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        return self


class FunctionDef(_Lenient):
    name: Annotated[str, Field(strict=True, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema
    strict: Bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: Text


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Lenient):
    name: Text | None = None
    description: Text | None = None
    schema_: Annotated[dict, Field(alias="schema")]  # the JSON schema (serve.grammar compiles it)
    strict: Bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's ``response_format``: text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: Bool = False


Fraction = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1)]


class _Sampling(_Lenient):
    model: str | None = None  # left out: the served model (as vLLM)
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=2)] = 1.0
    top_p: Fraction = 1.0
    top_k: Annotated[Int, Field(ge=-1, le=2**31)] = -1  # vLLM's: -1 or 0 off
    min_p: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=1)] = 0.0
    typical_p: Fraction = 1.0
    eta_cutoff: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, lt=1)] = 0.0
    seed: Annotated[Int, AfterValidator(_seed)] | None = None
    stop: Annotated[Annotated[Stop, Tag("one")] | Annotated[list[Stop], Field(max_length=4), Tag("list")],
                    _either("one", "list", "a string or a list of up to 4 strings")] | None = None  # fmt: skip
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] = []
    presence_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=100)] = 1.0  # vLLM's
    logit_bias: Annotated[dict[str, Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-100, le=100)]],
                          Field(max_length=1024)] = {}  # fmt: skip  # token id (a JSON key) -> bias
    min_tokens: Annotated[Int, Field(ge=0, le=MAX_NEW_TOKENS)] = 0  # vLLM's
    response_format: ResponseFormat | None = None
    ignore_eos: Bool = False
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None


TopLogprobs = Annotated[Int, Field(ge=0, le=20)]  # OpenAI's limit (engine.MAX_LOGPROBS)


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    max_completion_tokens: Count | None = None
    logprobs: Bool = False
    top_logprobs: TopLogprobs | None = None

    def logprob_count(self) -> int | None:
        """The alternatives per token to report (None: no logprobs)."""
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: Annotated[Annotated[Text, Tag("text")] | Annotated[list[TokenId], Field(min_length=1), Tag("ids")],
                      _either("text", "ids", "a string or a list of token ids (one prompt a request: not a list "
                              "of prompts)", nested=False)]  # fmt: skip
    logprobs: TopLogprobs | None = None
    echo: Bool = False  # the prompt before the answer (with logprobs: its tokens' too)

    def logprob_count(self) -> int | None:
        return self.logprobs


def check_unknown(body: BaseModel, where: str = "") -> None:
    """A 400 for a known field holding a value this server cannot honour; every other unknown
    field is logged once per name and ignored (nested objects too: ``messages.tool_calls``)."""
    for name, value in (body.model_extra or {}).items():
        path = f"{where}{name}"
        if not where and name in NOT_HONOURED:
            if not _no_op(value, NOT_HONOURED[name]):
                raise ApiError(400, f"{name} = {json.dumps(value)[:80]} is not supported by this server"
                               + (f" (it takes {', '.join(json.dumps(a) for a in NOT_HONOURED[name])})"
                                  if NOT_HONOURED[name] else " (leave it out)"), param=name)  # fmt: skip
        elif path not in _logged and len(_logged) < 1024:
            _logged.add(path)
            log.warning("ignoring the unknown request field %r (logged once)", path)
    for name in type(body).model_fields:
        v = getattr(body, name)
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, BaseModel):
                check_unknown(item, f"{where}{name}.")


class TokenizeRequest(_Lenient):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (one of them)."""

    model: str | None = None
    prompt: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(_Lenient):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]
