"""Tool calls through `treeattn serve` with the trained SmolLM2 model and a chat template that
takes tools and writes Hermes-format calls (given with --chat-template), through the official
openai client: a named tool_choice and "required" give calls whose arguments follow the
tool's JSON schema (whole and streamed as tool_calls deltas), "auto" answers, a conversation
with a call and its result goes on; an unknown tool name, tool_choice without tools and
tools with a template that takes none are 400s naming the field."""

from __future__ import annotations

import json

import pytest
from smol import GGUF, NEEDS_SMOL

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from server import Server  # noqa: E402

pytestmark = NEEDS_SMOL
NAME = "SmolLM2-135M-Instruct.Q4_1"

TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these tools:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
To call one, answer <tool_call>
{"name": <its name>, "arguments": <its arguments>}
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 20}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    t = tmp_path_factory.mktemp("tpl") / "hermes.jinja"
    t.write_text(TEMPLATE)
    s = Server("--model", str(GGUF), "--nproc", "2", "--max-batch", "4", "--chat-template", str(t))
    yield s
    s.kill()


def _check(call, tools):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.function.name in spec and call.id
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


def test_tool_calls(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=600)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, tools in ((named, [WEATHER, TIME]), ("required", [WEATHER, TIME])):
        r = client.chat.completions.create(model=NAME, messages=ask, tools=tools, tool_choice=choice, temperature=0,
                                           max_tokens=60)  # fmt: skip
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1, c
        _check(c.message.tool_calls[0], tools)
        if choice == named:
            assert c.message.tool_calls[0].function.name == "get_weather"
        events = list(client.chat.completions.create(model=NAME, messages=ask, tools=tools, tool_choice=choice,
                                                     temperature=0, max_tokens=60, stream=True))  # fmt: skip
        deltas = [d for e in events if e.choices for d in (e.choices[0].delta.tool_calls or [])]
        assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"
        assert len(deltas) == 1 and deltas[0].function.arguments == c.message.tool_calls[0].function.arguments
        assert not "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    r = client.chat.completions.create(model=NAME, messages=ask, tools=[WEATHER], tool_choice="auto", temperature=0,
                                       max_tokens=40)  # fmt: skip
    c = r.choices[0]
    assert c.message.content or c.message.tool_calls, c
    for call in c.message.tool_calls or []:
        _check(call, [WEATHER])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    more = ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]  # fmt: skip
    r = client.chat.completions.create(model=NAME, messages=more, tools=[WEATHER], temperature=0, max_tokens=20)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    for body, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"), ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools")):  # fmt: skip
        st, got = server.request("POST", "/v1/chat/completions", {"messages": ask, "max_tokens": 4, **body})
        assert st == 400 and got["error"]["param"].startswith(param), (body, got)
    assert server.request("GET", "/health")[1]["status"] == "ok"
