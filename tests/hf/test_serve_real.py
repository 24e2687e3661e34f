"""`treeattn serve` with the trained SmolLM2 model at p = 2, in one server launch: the official
``openai`` client and plain HTTP; answers equal `treeattn generate` and cold single-process
runs; the prefix cache; concurrent clients; a client that hangs up; bad requests; a full
queue; SIGINT."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from smol import CHAT, GGUF, NEEDS_SMOL, NEW, QUESTIONS

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server import Server  # noqa: E402

pytestmark = NEEDS_SMOL
NAME = "SmolLM2-135M-Instruct.Q4_1"  # the served name: the GGUF file's stem


@pytest.fixture(scope="module")
def server(smol):
    s = Server("--model", str(GGUF), "--nproc", "2", "--max-queue", "2", "--max-batch", "4", "--prefill-chunk", "512",
               "--allowed-origins", "http://app.example")  # fmt: skip
    yield s
    s.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def _ask(client, text: str, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], temperature=0, **kw)


def _streamed(client, text: str, **kw) -> tuple[str, object, list]:
    chunks = list(_ask(client, text, stream=True, stream_options={"include_usage": True}, **kw))
    body = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return body, chunks[-1].usage, chunks


def test_chat_equals_treeattn_generate(server, client):
    r = subprocess.run([sys.executable, "-m", "treeattn", "generate", "--model", str(GGUF), "--chat", "--prompt", CHAT,
                        "--nproc", "2", "--no-stream"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    want = r.stdout[:-1]  # print() added the newline
    assert "Paris" in want
    assert client.models.list().data[0].id == NAME
    got = _ask(client, CHAT)
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == "stop"
    assert got.usage.prompt_tokens == 37 and got.usage.total_tokens == 37 + got.usage.completion_tokens
    text, usage, chunks = _streamed(client, CHAT)
    assert text == want and chunks[0].choices[0].delta.role == "assistant"
    assert usage.prompt_tokens == 37 and usage.completion_tokens == got.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt: its prefix was kept
    cut = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": CHAT}], temperature=0,
                                         stop=["Paris"])  # fmt: skip
    assert cut.choices[0].message.content == want[: want.index("Paris")] and cut.choices[0].finish_reason == "stop"
    short = _ask(client, CHAT, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    plain = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert plain.choices[0].text and plain.usage.prompt_tokens == 5


def test_chat_logprobs_match_transformers(server, client, smol):
    """``logprobs`` / ``top_logprobs`` through the official client, streamed and not: each
    token's logprob and its 2 likeliest alternatives within 1e-4 of transformers' log-softmax
    on the same prefix (the real model in one process, float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    got = _ask(client, CHAT, max_tokens=6, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 6
    tok = AutoTokenizer.from_pretrained(smol["dir"])
    model = AutoModelForCausalLM.from_pretrained(smol["dir"], dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    with torch.no_grad():
        for c in content:
            lsm = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            t = int(lsm.argmax())
            assert c.token == tok.decode([t]) and abs(c.logprob - float(lsm[t])) < 1e-4, (c, float(lsm[t]))
            v, i = lsm.topk(2)
            assert [a.token for a in c.top_logprobs] == [tok.decode([x]) for x in i.tolist()]
            assert all(abs(a.logprob - y) < 1e-4 for a, y in zip(c.top_logprobs, v.tolist(), strict=True))
            assert c.bytes == list(c.token.encode())
            ids.append(t)
    chunks = list(_ask(client, CHAT, max_tokens=6, logprobs=True, top_logprobs=2, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    assert _ask(client, CHAT, max_tokens=2).choices[0].logprobs is None


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "is_capital", "continent"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "is_capital": {"type": "boolean"},
                       "continent": {"enum": ["Europe", "Asia", "Africa", "America"]}}}  # fmt: skip
LIST = {"type": "object", "additionalProperties": False, "required": ["colours"],
        "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2,
                                   "maxItems": 3}}}  # fmt: skip


def test_structured_output_follows_the_schema(server, client):
    """``response_format`` (json_schema, json_object) through the openai client, greedy and
    seeded, two choices, streamed and not: every answer parses and validates against its
    schema (jsonschema); schemas that match nothing or are not schemas are a 400 naming
    response_format, tools with this template (it takes none) a 400 naming tools, and the
    server answers plainly afterwards."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    asks = [("Paris: which city, is it a capital, which continent? Answer in JSON.", CITY),
            ("Name some colours, as JSON.", LIST), ("Give a JSON object with the name and the age of a cat.", None)]  # fmt: skip
    for text, schema in asks:
        rf = {"type": "json_object"} if schema is None else {"type": "json_schema",
                                                             "json_schema": {"name": "answer", "schema": schema}}  # fmt: skip
        for kw in (dict(temperature=0), dict(temperature=0.9, seed=3, n=2)):
            r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], max_tokens=80,
                                               response_format=rf, **kw)  # fmt: skip
            for c in r.choices:
                assert c.finish_reason == "stop", (text, kw, c)
                got = json.loads(c.message.content)
                jsonschema.validate(got, schema or {"type": "object"})
        stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], max_tokens=80,
                                                response_format=rf, temperature=0, stream=True)  # fmt: skip
        whole = "".join(e.choices[0].delta.content or "" for e in stream if e.choices)
        jsonschema.validate(json.loads(whole), schema or {"type": "object"})
    loop = {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}
    for bad in ({"type": "json_schema", "json_schema": {"schema": {"enum": []}}},
                {"type": "json_schema", "json_schema": {"schema": loop}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": 7}}}}},
                {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": []}}, {"type": "yaml"}):  # fmt: skip
        st, body = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                   "max_tokens": 4, "response_format": bad})  # fmt: skip
        assert st == 400 and body["error"]["param"].startswith("response_format"), (bad, body)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    st, body = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                               "tools": [tool]})  # fmt: skip
    assert st == 400 and body["error"]["param"] == "tools" and "takes no tools" in body["error"]["message"], body
    assert _ask(client, "Hi", max_tokens=3).choices[0].message.content


def test_tokenize_detokenize_and_cors(server, smol):
    """vLLM's /tokenize and /detokenize on the model's tokenizer (a prompt, chat messages with
    and without the generation prompt, errors that name the field), and CORS for the origins of
    --allowed-origins only (a browser's preflight answered)."""
    import urllib.request

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol["dir"])
    st, body = server.request("POST", "/tokenize", {"model": NAME, "prompt": "The capital of France"})
    assert st == 200 and body["tokens"] == tok("The capital of France").input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    msgs = [{"role": "user", "content": CHAT}]
    st, body = server.request("POST", "/tokenize", {"messages": msgs})
    want = list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert st == 200 and body["tokens"] == want and body["count"] == 37  # the prompt the chat endpoint runs
    st, body = server.request("POST", "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert st == 200 and len(body["tokens"]) < 37
    st, body = server.request("POST", "/detokenize", {"tokens": tok("Paris is nice").input_ids})
    assert st == 200 and body["prompt"] == "Paris is nice"
    for path, bad, param in (("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"), ("/tokenize", {}, "prompt"),
                             ("/detokenize", {"tokens": [49152]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                             ("/tokenize", {"model": "gpt-4", "prompt": "a"}, "model")):  # fmt: skip
        st, body = server.request("POST", path, bad)
        assert 400 <= st < 500 and (body["error"]["param"] or "").startswith(param), (path, bad, body)

    def preflight(origin: str):
        req = urllib.request.Request(server.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("access-control-allow-origin")

    assert preflight("http://app.example") == (200, "http://app.example")
    assert preflight("http://evil.example")[1] is None


def test_second_question_reuses_the_document(server, client, smol_doc):
    d = smol_doc
    outs = []
    for q, ref, ids in zip(QUESTIONS, d["answers"], d["prompts"], strict=True):
        got = _ask(client, d["doc"] + q, max_tokens=NEW)
        outs.append(got)
        assert got.choices[0].message.content == ref, q  # a cold single-process run's tokens
        assert got.usage.prompt_tokens == ids.shape[1]
    assert outs[1].usage.prompt_tokens_details.cached_tokens >= d["prefix"] - 1  # the document ran once
    assert outs[0].usage.prompt_tokens_details.cached_tokens < 100  # at most the chat template's head


def test_four_questions_at_once_share_one_copy_of_the_document(server, client, smol_doc):
    """Four questions about the cached document at once run as one batch: each answer equals
    its answer alone (the first two: a cold single-process run's), every request reports the
    document as cached, and while they run the ranks hold one copy of it: the KV tokens per
    rank grow by the four questions' own tokens, not by another document."""
    d = smol_doc
    qs = [*QUESTIONS, "What is the name of the town? Answer in one word.", "Summarize the text in one sentence."]
    alone = [_ask(client, d["doc"] + q, max_tokens=NEW).choices[0].message.content for q in qs]
    assert alone[:2] == d["answers"]
    before = _health(server)
    got: dict[int, object] = {}
    patient = client.with_options(max_retries=8)  # --max-queue is 2: a burst of four may see a 429 first

    def one(i):
        try:
            got[i] = _ask(patient, d["doc"] + qs[i], max_tokens=NEW)
        except Exception as e:  # shown in the assertion below, not lost in a thread
            got[i] = e

    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    seen = []
    while any(t.is_alive() for t in ts):
        seen.append(_health(server))
        time.sleep(0.05)
    assert all(not isinstance(got[i], Exception) for i in range(4)), got
    assert [got[i].choices[0].message.content for i in range(4)] == alone
    assert all(got[i].usage.prompt_tokens_details.cached_tokens >= d["prefix"] - 1 for i in range(4))
    assert max(h["running"] for h in seen) >= 2, "the four never ran together"
    docs = [p for p in _health(server)["prefixes"] if p["tokens"] >= d["prefix"]]
    assert len(docs) == 1, docs  # one prefix holds the document
    grown = max(h["kv_tokens_per_rank"] for h in seen) - before["cache_tokens_per_rank"]
    assert grown < d["prefix"] // 4, (grown, d["prefix"])  # a second copy would add about prefix / 2


def test_concurrent_clients_get_their_own_answers(server, client):
    questions = ["Name a primary color.", "What is 2 plus 2?", "Say hello in French."]
    alone = [_ask(client, q, max_tokens=NEW).choices[0].message.content for q in questions]
    got: dict[int, str] = {}
    # --max-queue is 2: when the three arrive before the engine takes the first, one gets a 429
    # ("retry later"), which the openai client retries as it does by default
    patient = client.with_options(max_retries=8)

    def one(i):
        try:
            if i == 1:
                got[i] = _streamed(patient, questions[i], max_tokens=NEW)[0]
            else:
                got[i] = _ask(patient, questions[i], max_tokens=NEW).choices[0].message.content
        except Exception as e:  # shown in the assertion below, not lost in a thread
            got[i] = f"{type(e).__name__}: {e}"

    ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    assert [got.get(i) for i in range(3)] == alone


def _health(server):
    return server.request("GET", "/health")[1]


def test_client_hangs_up_mid_stream(server, client):
    before = _health(server)
    stream = server.events("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content":
                           "Write a long story about a dragon."}], "max_tokens": 400, "temperature": 0,
                           "stream_options": {"include_usage": True}})  # fmt: skip
    for _ in range(4):
        next(stream)
    stream.close()  # hang up
    deadline = time.monotonic() + 60
    while _health(server)["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _health(server)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completion_tokens"] - before["completion_tokens"] < 400  # it stopped early
    assert "Paris" in _ask(client, CHAT).choices[0].message.content  # still serving, in lockstep


def test_client_hangs_up_on_a_whole_answer(server):
    """A request that is not streamed, whose client leaves while its tokens still come, is
    cancelled within a step or so and frees its row (the disconnect check does not wait for a
    pause in the tokens)."""
    import http.client
    import json
    from urllib.parse import urlsplit

    before = _health(server)
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": NAME, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0}  # fmt: skip
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while _health(server)["decode_tokens"] - before["decode_tokens"] < 8 and time.monotonic() < deadline:
        time.sleep(0.1)  # its tokens come
    conn.close()  # hang up
    while _health(server)["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _health(server)
    assert after["cancelled"] == before["cancelled"] + 1 and after["running"] == 0, (before, after)
    assert after["decode_tokens"] - before["decode_tokens"] < 200  # it stopped early


@pytest.mark.parametrize(
    "body, status, where",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": NAME, "messages": []}, 400, "messages"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}, 400, "8192 positions"),
        ({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400,
         "top_logprobs"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "needs logprobs"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "best_of": 2}, 400, "best_of = 2"),
        ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": []}, 400, "tools"),
        ({"model": NAME, "prompt": [49152]}, 400, "[0, 49152)"),
        ({"model": NAME, "prompt": [[1, 2], [3, 4]]}, 400, "not a list of prompts"),
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ],
)
def test_bad_requests(server, body, status, where):
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    st, out = server.request("POST", path, None if isinstance(body, bytes) else body,
                             raw=body if isinstance(body, bytes) else None)  # fmt: skip
    assert st == status and where in out["error"]["message"], out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert server.request("GET", "/health")[0] == 200


def test_full_queue_is_429(server, client):
    """Four long answers fill the batch (--max-batch 4), two more requests wait (--max-queue 2):
    the next one gets a 429, and the waiting ones run once the long ones are cancelled."""
    longs = [server.events("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content":
             f"Write a long story about dragon number {i}."}], "max_tokens": 300, "temperature": 0})
             for i in range(4)]  # fmt: skip
    for s in longs:
        next(s)  # it runs
    deadline = time.monotonic() + 30
    while _health(server)["running"] < 4 and time.monotonic() < deadline:  # /health follows within a step
        time.sleep(0.05)
    assert _health(server)["running"] == 4
    done: list = []
    waiting = [threading.Thread(target=lambda: done.append(_ask(client, CHAT, max_tokens=4))) for _ in range(2)]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 60
    while _health(server)["queued"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _health(server)["queued"] == 2
    st, out = server.request("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user",
                             "content": "hi"}]})  # fmt: skip
    assert st == 429 and out["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        _ask(client, CHAT)
    for s in longs:
        s.close()
    for t in waiting:
        t.join(600)
    assert len(done) == 2 and all(d.choices[0].finish_reason == "length" for d in done)


def test_sigint_stops_every_process(server):
    assert len(server.ranks()) == 2
    code, seconds, left = server.stop()
    assert not left and seconds < 30, (left, seconds)
    assert code == 0 and "treeattn serve: stopped" in server.output()
