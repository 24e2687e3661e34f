"""`treeattn serve` on a tiny random model: the engine's prefix cache in one process (exact
answers, what is reused, what is evicted), then the server over 2 ranks through plain HTTP
(auth, shapes, streaming, sampling seeds) and a rank killed under it."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from server import Server, alive  # noqa: E402
from treeattn.hf.presets import build_model  # noqa: E402
from treeattn.serve.engine import Engine, Request, _first_stop, _safe_prefix  # noqa: E402

MODEL = "tiny-llama"


def _model():
    return build_model(MODEL, None, torch.float32, 0)[0]


def _reference(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of single-process ``model.generate`` (stopping at EOS, which is kept)."""
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)[
        0, len(ids) :
    ].tolist()


def _ids_of(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def test_stop_string_helpers():
    assert _first_stop("abcSTOPdef", ["STOP", "de"], 0) == 3
    assert _first_stop("abcSTOPdef", ["STOP"], 4) is None
    assert _first_stop("abc", [], 0) is None
    assert _safe_prefix("hello ST", ["STOP"]) == "hello "  # "ST" may begin "STOP": held back
    assert _safe_prefix("hello", ["STOP"]) == "hello"
    assert _safe_prefix("caf\ufffd", []) == "caf"  # half a character: held back


def _run(engine: Engine, jobs: list[tuple[list[int], int]]) -> list[dict]:
    """Serve ``jobs`` (prompt ids, max_tokens) in order on a single-process engine."""
    q, stopping, results = queue.Queue(), threading.Event(), []
    for ids, n in jobs:
        r = {"tokens": [], "text": ""}
        results.append(r)

        def emit(kind, data, r=r):
            r.setdefault("events", []).append(kind)
            if kind == "text":
                r["text"] += data
            elif kind in ("start", "end"):
                r.update(data)
            else:
                r["error"] = data

        q.put(Request(ids, n, emit, decode=lambda t: "".join(f"<{i}>" for i in t), temperature=0.0, eos=[2]))
    t = threading.Thread(target=engine.serve, args=(q, stopping))
    t.start()
    while not q.empty() or any("finish_reason" not in r and "error" not in r for r in results):
        time.sleep(0.01)
    stopping.set()
    t.join(10)
    return results


def test_engine_prefix_cache_exact_and_bounded():
    """Requests that extend, branch from and leave cached prefixes; every answer equals a cold
    single-process run, ``cached_tokens`` follows the documented rule and the entries stay
    within ``cache_tokens`` per rank."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(3, 500, (30,), generator=g).tolist()
    other = torch.randint(3, 500, (26,), generator=g).tolist()
    n = 6
    engine = Engine(model, None, dict(prefill_chunk=8), cache_tokens=80)
    first = _run(engine, [(doc + [11, 12], n)])[0]
    ans = _ids_of(first["text"])
    follow = doc + [11, 12] + ans + [13]  # a multi-turn continuation: the whole entry is reused
    jobs = [
        (follow, n),
        (doc + [21, 22, 23], n),  # a second question: the document is reused, the last turn is dropped
        (other, n),  # unrelated: a new entry (80 tokens hold both)
        (doc + [31], n),  # back to the document
        (list(reversed(doc)) + other, n),  # 56 + 6 tokens: the least recently used entry ("other") goes
        (other + [41], n),  # evicted: cold again
    ]
    out = _run(engine, jobs)
    for (ids, k), r in zip([(doc + [11, 12], n)] + jobs, [first] + out, strict=True):
        ref = _reference(model, ids, k)
        assert _ids_of(r["text"]) == [t for t in ref if t != 2], (ids, r)
        assert r["completion_tokens"] == len(ref) and r["finish_reason"] == ("stop" if ref[-1] == 2 else "length")
    # the first answer's last token was never run (its logits were not needed), so the entry ends before it
    cached = [r["cached_tokens"] for r in out]
    assert cached == [len(doc) + 2 + len(ans) - (1 if first["finish_reason"] == "length" else 0), len(doc), 0,
                      len(doc), 0, 0], cached  # fmt: skip
    assert 0 < engine.cached() <= 80
    assert engine.stats["requests"] == 7


def test_engine_without_prefix_cache():
    model = _model()
    engine = Engine(model, None, dict(prefill_chunk=None), cache_tokens=0)
    ids = list(range(3, 20))
    a, b = _run(engine, [(ids, 4), (ids, 4)])
    assert a["text"] == b["text"] and a["cached_tokens"] == b["cached_tokens"] == 0 and not engine.entries


@pytest.fixture(scope="module")
def tiny_server():
    s = Server("--preset", MODEL, "--nproc", "2", "--api-key", "sekrit", "--max-queue", "4", "--cache-tokens", "64",
               "--placement", "contiguous", "--prefill-chunk", "8", api_key="sekrit")  # fmt: skip
    yield s
    s.kill()


def test_tiny_server(tiny_server):
    s = tiny_server
    assert s.url.startswith("http://127.0.0.1:")  # loopback unless told otherwise
    st, body = s.request("GET", "/v1/models", key=None)
    assert st == 401 and body["error"]["code"] == "invalid_api_key"
    st, body = s.request("GET", "/v1/models", key="wrong")
    assert st == 401
    st, body = s.request("GET", "/v1/models")
    assert st == 200 and [m["id"] for m in body["data"]] == [MODEL]
    assert s.request("GET", "/health", key=None)[0] == 200
    model = _model()
    g = torch.Generator().manual_seed(2)
    for L, n in ((5, 8), (23, 12), (40, 3)):
        ids = torch.randint(3, 500, (L,), generator=g).tolist()
        st, body = s.request("POST", "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": n,
                                                         "temperature": 0})  # fmt: skip
        assert st == 200, body
        ref = _reference(model, ids, n)
        assert _ids_of(body["choices"][0]["text"]) == [t for t in ref if t != 2]
        assert body["usage"]["completion_tokens"] == len(ref) and body["usage"]["prompt_tokens"] == L
        ev = list(s.events("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0,
                                               "stream_options": {"include_usage": True}}))  # fmt: skip
        assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == len(ref)
        # the same prompt again: reused unless that would drop more of the entry (the answer) than it keeps
        held = L + len(ref) - 1
        assert ev[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == (L - 1 if held - (L - 1) <= L - 1 else 0)
        assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == body["choices"][0]["text"]
        assert ev[-3]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    # sampling: a seed reproduces the text; temperature and top_p are applied on rank 0
    req = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 1.5, "top_p": 0.9}
    a, b, c = (s.request("POST", "/v1/completions", {**req, "seed": sd})[1]["choices"][0]["text"] for sd in (1, 1, 2))
    assert a == b and a != c
    st, body = s.request("POST", "/v1/completions", {**req, "max_tokens": 200})  # 203 tokens: 103 per rank > 64
    assert st == 400 and "--cache-tokens" in body["error"]["message"], body
    st, body = s.request(
        "POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert st == 400 and "no chat template" in body["error"]["message"]
    st, body = s.request("GET", "/health")
    assert body["status"] == "ok" and body["cache_tokens_per_rank"] <= 64, body


def test_cli_errors_before_any_rank_starts():
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "treeattn", "serve", "--preset", MODEL, *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    r = serve("--max-queue", "0")
    assert r.returncode == 2 and "--max-queue must be >= 1" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = serve("--port", str(busy.getsockname()[1]))
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr, r.stderr
    r = serve("--cache-tokens", "-1")
    assert r.returncode == 2 and "--cache-tokens" in r.stderr.splitlines()[-1]


def test_rank_killed_under_the_server():
    """A rank dies mid-answer: the stream ends with an error (or closes), new requests get 503
    or find the server gone, and the server exits with the cause; no process is left."""
    s = Server("--preset", MODEL, "--nproc", "2", "--collective-timeout", "30", "--cache-tokens", "0")
    try:
        ranks = s.ranks()
        assert len(ranks) == 2, ranks
        tree = set(ranks) | {s.proc.pid}
        stream = s.events("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200000,
                                               "temperature": 0})  # fmt: skip
        got = [next(stream) for _ in range(3)]
        assert all("choices" in e for e in got)
        s_kill = ranks[1]
        import os

        os.kill(s_kill, signal.SIGKILL)
        tail = []
        try:
            for e in stream:
                tail.append(e)
        except OSError:  # the connection was closed: also an acceptable end
            tail.append("closed")
        assert tail[-1] in ("[DONE]", "closed"), tail[-3:]
        if tail[-1] == "[DONE]":
            err = tail[-2]["error"]
            assert err["type"] == "server_error" and "rank" in err["message"], err
        try:
            st, body = s.request("GET", "/health", timeout=5)
            assert st == 503 and body["status"] == "failed", body
        except OSError:
            pass  # already gone
        s.proc.wait(60)
        assert s.proc.returncode == 1
        assert re.search(r"rank 1 of 2 failed \(exit code -9 \(SIGKILL\)", s.output()), s.output()[-2000:]
        deadline = time.monotonic() + 10
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(tree)
    finally:
        s.kill()
