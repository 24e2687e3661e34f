"""`treeattn serve` on a tiny random model: the engine's prefix cache in one process (exact
answers, what is reused, what is evicted), then the server over 2 ranks through plain HTTP
(auth, shapes, streaming, sampling seeds) and a rank killed under it."""

from __future__ import annotations

import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from server import Server, alive  # noqa: E402
from treeattn.hf.presets import build_model  # noqa: E402
from treeattn.serve.engine import Engine, Request  # noqa: E402
from treeattn.serve.request import first_stop as _first_stop  # noqa: E402
from treeattn.serve.request import safe_prefix as _safe_prefix  # noqa: E402

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


def _ids_text(t: list[int]) -> str:
    return "".join(f"<{i}>" for i in t)


def _run(engine: Engine, jobs: list[tuple], **kw) -> list[dict]:
    """Serve ``jobs`` (prompt ids, max_tokens[, decode[, Request keywords]]) in order on a
    single-process engine; ``kw``: keywords of every Request."""
    q, stopping, results = queue.Queue(), threading.Event(), []
    for ids, n, *more in jobs:
        decode = more[:1]
        rkw = {"temperature": 0.0, **kw, **(more[1] if len(more) > 1 else {})}
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

        q.put(Request(ids, n, emit, decode=decode[0] if decode and decode[0] else _ids_text, **{"eos": [2], **rkw}))
    t = threading.Thread(target=engine.serve, args=(q, stopping))
    t.start()
    while not q.empty() or any("finish_reason" not in r and "error" not in r for r in results):
        time.sleep(0.01)
    stopping.set()
    t.join(10)
    return results


def _serve_until(eng: Engine, q: queue.Queue, stopping: threading.Event, done, seen, timeout: float):
    """``eng`` serves ``q`` in a thread until ``done()``, then stops; the thread (joined)."""
    t = threading.Thread(target=eng.serve, args=(q, stopping))
    t.start()
    deadline = time.monotonic() + timeout
    while not done():
        assert t.is_alive() and time.monotonic() < deadline, seen
        time.sleep(0.01)
    stopping.set()
    t.join(10)
    return t


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


def test_engine_preempts_and_recomputes():
    """K/V taken as it is used: four requests whose answers do not fit together under
    ``cache_tokens`` all run, the newest preempted when the cache fills (its row freed) and
    recomputed later from its prompt and answer so far; every answer (greedy, seeded sampling,
    with a repetition penalty) equals the same request alone, nothing is emitted twice, and a
    request alone that fills the cache ends with ``length``."""
    model = _model()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (9,), generator=g).tolist() for _ in range(4)]
    kws = [{}, {"temperature": 1.1, "seed": 4}, {"repetition_penalty": 1.4}, {"temperature": 0.8, "seed": 8}]
    jobs = [(ids, 24, None, {**kw, "eos": []}) for ids, kw in zip(prompts, kws, strict=True)]  # no EOS: 24 tokens
    alone = [_run(Engine(model, None, dict(prefill_chunk=8), cache_tokens=200, max_batch=1), [j])[0] for j in jobs]
    eng = Engine(model, None, dict(prefill_chunk=8), cache_tokens=48, max_batch=4)  # 4 x 33 tokens do not fit
    together = _run(eng, jobs)
    assert eng.stats["preempted"] > 0, eng.stats
    for a, b, (_, _, _, kw) in zip(alone, together, jobs, strict=True):
        assert b["events"].count("start") == 1 and b["events"][-1] == "end", b["events"]
        assert (b["text"], b["finish_reason"]) == (a["text"], a["finish_reason"]), (kw, a["text"], b["text"])
    (r,) = _run(Engine(model, None, dict(prefill_chunk=8), cache_tokens=20, max_batch=2), [(prompts[0], 24)], eos=[])
    assert r["finish_reason"] == "length" and 0 < r["completion_tokens"] < 24, r


def test_engine_no_head_of_line_blocking():
    """While a new document is prefilled chunk by chunk, a question on a cached document is
    admitted and answered before the new document's first token; a second new document waits
    for the first to be built (one new prefix at a time) and then runs; every answer equals
    single-process transformers."""
    model = _model()
    g = torch.Generator().manual_seed(11)
    cached, big, other = (torch.randint(3, 500, (n,), generator=g).tolist() for n in (20, 160, 40))
    eng = Engine(model, None, dict(prefill_chunk=8), cache_tokens=400, max_batch=4)
    _run(eng, [(cached + [7], 2)])
    order, results = [], {}
    q, stopping = queue.Queue(), threading.Event()
    reqs = {"new": big + [5, 6], "cached": cached + [8, 9], "other": other + [4]}
    for name, ids in reqs.items():
        results[name] = []

        def emit(kind, data, name=name):
            order.append((name, kind))
            if kind == "text":
                results[name].append(data)

        q.put(Request(ids, 4, emit, decode=_ids_text, eos=[], temperature=0.0))
    _serve_until(eng, q, stopping, lambda: sum(k == "end" for _, k in order) >= 3, order, 120)
    first_text = {n: order.index((n, "text")) for n in reqs}
    assert order.index(("cached", "end")) < first_text["new"], order  # answered during the big prefill
    # one new prefix at a time: the second new document waits until the first is built (20 steps of 8
    # tokens), long after the cached question (6 steps) ended
    assert order.index(("cached", "end")) < order.index(("other", "start")), order
    for name, ids in reqs.items():
        assert _ids_of("".join(results[name])) == _reference(model, ids, 4), name


def test_engine_step_token_budget(monkeypatch):
    """--max-num-batched-tokens: a new document's chunks take what the decoding requests leave
    of each step's budget (here 12 tokens beside 1 to 3 decoding rows, its own chunk size 64);
    every answer is still transformers' alone. Refused below 1 on every rank."""
    model = _model()
    g = torch.Generator().manual_seed(12)
    cached, big = (torch.randint(3, 500, (n,), generator=g).tolist() for n in (20, 90))
    eng = Engine(model, None, dict(prefill_chunk=64), cache_tokens=400, max_batch=4, max_num_batched_tokens=12)
    chunks, real = [], eng.runner.prefill
    monkeypatch.setattr(eng.runner, "prefill", lambda pid, ids: chunks.append(len(ids)) or real(pid, ids))
    _run(eng, [(cached + [7], 2)])
    chunks.clear()
    jobs = [(cached + [8, 9], 12), (cached + [10], 12), (big + [5, 6], 4)]
    out = _run(eng, jobs)
    assert sum(chunks) == len(big) + 1 and max(chunks) <= 12 and len(chunks) >= 8, chunks
    for (ids, n), r in zip(jobs, out, strict=True):
        assert _ids_of(r["text"]) == [t for t in _reference(model, ids, n) if t != 2], ids
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(model, None, {}, max_num_batched_tokens=0)


def test_engine_without_prefix_cache():
    model = _model()
    engine = Engine(model, None, dict(prefill_chunk=None), cache_tokens=0)
    ids = list(range(3, 20))
    a, b = _run(engine, [(ids, 4), (ids, 4)])  # together: the second reads the first's prompt while it runs
    assert a["text"] == b["text"] and a["cached_tokens"] == 0 and b["cached_tokens"] == len(ids) - 1
    assert not engine.entries  # dropped once nobody reads it
    (c,) = _run(engine, [(ids, 4)])
    assert c["text"] == a["text"] and c["cached_tokens"] == 0 and not engine.entries


def test_engine_speculation_changes_no_answer(monkeypatch):
    """Speculation inside the batched step: concurrent requests (greedy, seeded sampling, a
    stop string, short max_tokens) give exactly the answers of the same engine without it,
    greedy ones those of ``model.generate``. A random model never quotes its prompt, so the
    drafts come from an oracle that knows the plain answers and plants mistakes: drafts are
    accepted whole, in part and not at all (their tokens trimmed from the rows), and usage
    and the counters report them. Then real prompt lookup (with the cost model) on the same
    requests: the same answers."""
    from treeattn.serve.drafts import RowDrafts

    model = _model()
    g = torch.Generator().manual_seed(5)
    jobs = []
    for i in range(6):
        base = torch.randint(3, 500, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        kw = {} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
        if i == 3:
            kw["stop"] = [_ids_text(base[1:3])]
        jobs.append((base * 3 + base[: i % 3], (24, 7, 16)[i % 3], None, kw))
    kw = dict(prefill_chunk=8)
    plain = _run(Engine(model, None, kw, cache_tokens=0, max_batch=4), jobs)
    answers = {tuple(ids): _ids_of(r["text"]) for (ids, *_), r in zip(jobs, plain, strict=True)}
    rng = random.Random(0)

    def oracle(self, history, cap):
        for ids, ans in answers.items():
            if tuple(history[: len(ids)]) == ids:
                d = ans[len(history) - len(ids) : len(history) - len(ids) + min(cap, self.k_max)]
                if d and rng.random() < 0.5:  # a planted mistake
                    d[rng.randrange(len(d))] = 1
                return d, 3
        return [], 0  # a later turn: no oracle

    def check(spec, eng):
        for (ids, n, _, kw), a, b in zip(jobs, plain, spec, strict=True):
            got, want = (b["text"], b["finish_reason"], b["completion_tokens"]), (a["text"], a["finish_reason"],
                                                                                   a["completion_tokens"])  # fmt: skip
            assert got == want, kw
            if not kw:
                assert _ids_of(b["text"]) == [t for t in _reference(model, ids, n) if t != 2]
        st = eng.stats
        assert sum(r["drafted"][0] for r in spec) == st["draft_tokens_accepted"]
        assert sum(r["drafted"][1] for r in spec) == st["draft_tokens_offered"] - st["draft_tokens_accepted"]
        return st

    with monkeypatch.context() as mp:
        mp.setattr(RowDrafts, "candidate", oracle)
        eng = Engine(model, None, kw, cache_tokens=400, max_batch=4, num_draft=4, fixed_draft=True)
        st = check(_run(eng, jobs), eng)
        # the next turn of each greedy request reads the answer its row left in its prefix: the
        # rejected draft tokens were trimmed before the prefix adopted the row's tokens
        turns = [(ids + answers[tuple(ids)] + [13], 6) for ids, _, _, kw in jobs if not kw]
        for (ids, n), r in zip(turns, _run(eng, turns), strict=True):
            assert _ids_of(r["text"]) == [t for t in _reference(model, ids, n) if t != 2]
            assert r["cached_tokens"] >= len(ids) - 2, (r["cached_tokens"], len(ids))
    assert 0 < st["draft_tokens_accepted"] < st["draft_tokens_offered"], st
    assert st["mean_accepted_length"] > 1.5 and st["decode_tokens"] > st["decode_rows"], st
    assert all(r["drafted"] is None for r in plain)
    eng = Engine(model, None, kw, cache_tokens=400, max_batch=4, num_draft=4)
    check(_run(eng, jobs), eng)


def test_engine_draft_model_changes_no_answer(monkeypatch):
    """A draft model inside the batched step: four concurrent questions about one document
    (greedy, seeded sampling, different lengths) give exactly the plain engine's answers, with
    the target itself drafting (greedy drafts accepted) and with another random model (mostly
    rejected), fixed and adaptive. The draft model runs the document once: the other requests
    fork the first one's cache, and a second round reuses the idle caches."""
    from treeattn.decoding.speculative import DraftModel

    model = _model()
    other = build_model(MODEL, None, torch.float32, 7)[0]
    g = torch.Generator().manual_seed(9)
    doc = torch.randint(3, 500, (200,), generator=g).tolist()
    jobs = []
    for i in range(4):
        q = torch.randint(3, 500, (3 + i,), generator=g).tolist()
        kw = {} if i % 2 == 0 else {"temperature": 0.8, "seed": 40 + i}
        jobs.append((doc + q, (12, 5, 9, 12)[i], None, kw))
    kw = dict(prefill_chunk=16)
    plain = _run(Engine(model, None, kw, cache_tokens=1000, max_batch=4), jobs)
    ran = [0]
    run = DraftModel._run

    def counting(self, ids):
        ran[0] += len(ids)
        return run(self, ids)

    monkeypatch.setattr(DraftModel, "_run", counting)
    bound = len(doc) + sum(len(ids) - len(doc) + 3 * n for ids, n, *_ in jobs)  # the document once, then a few per token
    for draft, fixed in ((model, True), (other, True), (model, False)):
        eng = Engine(model, None, kw, cache_tokens=1000, max_batch=4, num_draft=4, fixed_draft=fixed, draft_model=draft)
        for rnd in range(2 if fixed and draft is model else 1):
            ran[0] = 0
            spec = _run(eng, jobs)
            for (ids, n, _, rkw), a, b in zip(jobs, plain, spec, strict=True):
                assert (b["text"], b["finish_reason"]) == (a["text"], a["finish_reason"]), (fixed, rkw)
                if not rkw:
                    assert _ids_of(b["text"]) == [t for t in _reference(model, ids, n) if t != 2]
            st = eng.stats
            if fixed:
                assert 0 < ran[0] <= (bound if rnd == 0 else bound - len(doc)), (ran[0], bound, rnd)
                assert st["draft_tokens_offered"] > 0
            if draft is model and fixed:
                assert st["mean_accepted_length"] > 1.5, st
        if draft is other:
            assert st["draft_tokens_accepted"] < st["draft_tokens_offered"] / 2, st
        assert len(eng.sched.drafters.busy) == 0 and 0 < eng.sched.drafters.held() <= eng.draft_tokens
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(model, None, kw, num_draft=4, draft_model=build_model("small-llama", None, torch.float32, 0)[0])
    for bad in (-1, 16, 2.0):  # a token and its draft: one placed line (runtime.batch.PLACED_MAX)
        with pytest.raises(ValueError, match=r"num_draft must be an int in \[0, 15\]"):
            Engine(model, None, kw, num_draft=bad)


def test_engine_stop_ends_running_requests_and_frees_their_rows():
    """Stopping mid-answer: the running request gets a 503, its row closes on the engine, and
    a later serve() on the same engine starts clean and answers exactly."""
    model = _model()
    eng = Engine(model, None, dict(prefill_chunk=8), cache_tokens=200, max_batch=2)
    q, stopping, events = queue.Queue(), threading.Event(), []
    q.put(Request(list(range(3, 30)), 10_000, lambda k, d: events.append((k, d)), decode=_ids_text, eos=[],
                  temperature=0.0))  # fmt: skip
    t = _serve_until(eng, q, stopping, lambda: sum(k == "text" for k, _ in events) >= 3, events, 60)
    assert not t.is_alive() and events[-1] == ("error", (503, "the server is shutting down")), events[-3:]
    assert not eng.sched.jobs and eng.sched.free == [0, 1] and not eng.sched.closing
    assert all(p is None for p in eng.runner.rows.placement) and int(eng.runner.rows.n.sum()) == 0
    ids = list(range(3, 30)) + [40, 41]
    (r,) = _run(eng, [(ids, 6)])
    assert _ids_of(r["text"]) == [t for t in _reference(model, ids, 6) if t != 2]


def test_engine_joins_go_first():
    """A step with join chunks leaves the decode rows out, unless they sat out the step before:
    a joining question's first token does not wait for every running request's step, and no
    running request waits two steps in a row while a long question joins chunk by chunk. The
    answers stay those of ``model.generate``."""
    model = _model()
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, 500, (20,), generator=g).tolist()
    eng = Engine(model, None, dict(prefill_chunk=4), cache_tokens=400, max_batch=4)
    _run(eng, [(doc + [5], 2)])  # the document, cached
    seen = []
    plan = eng.sched.plan

    def recording():
        decoding = sorted(j.row for j in eng.sched.jobs if not j.todo)
        p = plan()
        if p is not None and p.lines:
            seen.append((decoding, sorted(j.row for j in p.jobs if not j.todo), bool(any(j.todo for j in p.jobs))))
        return p

    eng.sched.plan = recording
    jobs = [(doc + [7], 12), (doc + list(range(30, 40)), 10), (doc + [9, 9], 8), (doc + list(range(60, 73)), 6)]
    for (ids, n), r in zip(jobs, _run(eng, jobs), strict=True):
        assert _ids_of(r["text"]) == [t for t in _reference(model, ids, n) if t != 2]
    held = False
    for i, (decoding, ran, joins) in enumerate(seen):
        held = joins and bool(decoding) and not held
        assert ran == ([] if held else decoding), (i, seen)
        if i:
            assert not (set(decoding) & set(seen[i - 1][0])) - set(ran) - set(seen[i - 1][1]), (i, seen)
    assert any(j and d and not r for d, r, j in seen) and any(j and r for d, r, j in seen), seen


class _Tok:
    """A stand-in tokenizer: one id per character (``ord % 1000``), a chat template that
    refuses two user messages in a row."""

    chat_template = "stand-in"

    def __init__(self, n: int = 1000) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __call__(self, text: str):
        self.calls += 1
        return SimpleNamespace(input_ids=[ord(c) % 1000 for c in text])

    def apply_chat_template(self, msgs, **kw):
        self.calls += 1
        if any(a["role"] == b["role"] == "user" for a, b in zip(msgs, msgs[1:], strict=False)):
            raise ValueError("conversation roles must alternate user/assistant")
        return {"input_ids": [ord(c) % 1000 for m in msgs for c in m["content"]]}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(i) for i in ids)


def test_job_checks_every_value_before_the_queue():
    """``_job`` (rank 0, before anything is queued): seeds map into torch's 64 bits, prompt ids
    and the tokenizer's output lie within the model's vocabulary, a string prompt longer than
    64 characters per position is refused without tokenizing, a chat template that raises is a
    400; the engine's own guard refuses what slips past with a 400 before any broadcast."""
    from treeattn.serve.api import ApiError, ChatRequest, CompletionRequest, ServerState
    from treeattn.serve.jobs import build_job as _job

    tok = _Tok()
    state = ServerState(MODEL, tok, 16, 500, lambda n: n, 0, 4, [2], {})

    def job(**kw):
        return _job(state, CompletionRequest(model=MODEL, **kw))

    def refused(make, **kw) -> str:
        with pytest.raises(ApiError) as e:
            make(**kw)
        assert e.value.status == 400
        return e.value.body["message"]

    assert job(prompt=[1, 2], seed=-1).seed == 2**64 - 1 and job(prompt=[1], seed=2**63 - 1).seed == 2**63 - 1
    assert job(prompt=[1], seed=-(2**63)).seed == 2**63 and job(prompt=[1]).seed is None
    assert job(prompt="abc").ids == [97, 98, 99]
    assert "[0, 500), got 500" in refused(job, prompt=[1, 500])  # the model's vocabulary (the tokenizer has 1000)
    assert "[0, 500), got 999" in refused(job, prompt="a\u03e7")  # a tokenizer id beyond the model's vocabulary
    state.vocab = None
    assert job(prompt=[999]).ids == [999] and "[0, 1000)" in refused(job, prompt=[1000])  # then the tokenizer's
    calls = tok.calls
    assert "at most 1024 (64 per model position)" in refused(job, prompt="a" * 1025)
    assert tok.calls == calls  # refused before tokenizing
    assert "16 positions" in refused(job, prompt="a" * 16)

    def chat(**kw):
        return _job(state, ChatRequest(model=MODEL, **kw))

    msgs = [{"role": "user", "content": "hi"}]
    assert chat(messages=msgs).ids == [104, 105]
    assert "roles must alternate" in refused(chat, messages=msgs * 2)
    assert "at most 1024" in refused(chat, messages=[{"role": "user", "content": "a" * 1025}])

    # the engine's guard: a request that slipped past gets a 400 and no broadcast; the next one runs
    engine = Engine(_model(), None, dict(prefill_chunk=None), cache_tokens=0)
    bad = [([5, 512], 3), ([5, 2**63], 3), ([5], 0)]

    def broken(t):  # rank 0 alone raises between two steps: the request ends on every rank, then a 500
        if len(t) == 2:
            raise RuntimeError("decode broke")
        return _ids_text(t)

    out = _run(engine, [*bad, ([5, 6], 3, broken), ([5, 6], 3)])
    assert [r.get("error", (None,))[0] for r in out] == [400, 400, 400, 500, None], out
    assert "decode broke" in out[3]["error"][1] and out[-1]["completion_tokens"] == 3
    assert engine.stats["requests"] == 2 and not engine.entries


def _kv_bytes(tokens: int) -> str:
    """``--kv-cache-memory`` for ``tokens`` K/V tokens per rank of the tiny model (in KiB where whole)."""
    from treeattn.hf.models import kv_token_bytes
    from treeattn.hf.presets import preset_config

    n = tokens * kv_token_bytes(preset_config(MODEL), torch.float32)
    return f"{n // 1024}KiB" if n % 1024 == 0 else str(n)


@pytest.fixture(scope="module")
def tiny_server():  # its K/V bound (64 tokens per rank) given in bytes
    s = Server("--preset", MODEL, "--nproc", "2", "--api-key", "sekrit", "--max-queue", "4", "--kv-cache-memory", _kv_bytes(64),
               "--placement", "contiguous", "--prefill-chunk", "8", "--speculate", "prompt-lookup", "--fixed-draft",
               api_key="sekrit")  # fmt: skip  (speculation across ranks: greedy answers stay model.generate's)
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
        assert set(body["usage"]["completion_tokens_details"]) == {"accepted_prediction_tokens",
                                                                    "rejected_prediction_tokens"}  # fmt: skip
        ev = list(s.events("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0,
                                               "stream_options": {"include_usage": True}}))  # fmt: skip
        assert ev[-1] == "[DONE]" and ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == len(ref)
        # the same prompt again: all but its last token is cached (the entry kept the prompt and the answer)
        assert ev[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == L - 1
        assert "".join(e["choices"][0]["text"] for e in ev[:-2]) == body["choices"][0]["text"]
        assert ev[-3]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    # sampling: a seed reproduces the text; temperature and top_p are applied on rank 0
    req = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 1.5, "top_p": 0.9}
    a, b, c = (s.request("POST", "/v1/completions", {**req, "seed": sd})[1]["choices"][0]["text"] for sd in (1, 1, 2))
    assert a == b and a != c
    # K/V taken as used: a request alone runs until the cache (64 tokens per rank) is full, then ends (length)
    st, body = s.request("POST", "/v1/completions", {**req, "max_tokens": 200, "ignore_eos": True})
    n = body["usage"]["completion_tokens"]
    assert st == 200 and body["choices"][0]["finish_reason"] == "length" and 100 < n < 200, body
    st, body = s.request("POST", "/v1/completions", {**req, "prompt": [5] * 130})  # the prompt alone does not fit
    assert st == 400 and "--cache-tokens" in body["error"]["message"] and body["error"]["param"] == "prompt", body
    st, body = s.request(
        "POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert st == 400 and "no chat template" in body["error"]["message"]
    st, body = s.request("GET", "/health")
    assert body["status"] == "ok" and body["cache_tokens_per_rank"] <= 64, body
    assert body["draft_tokens_offered"] > 0 and body["mean_accepted_length"] >= 1.0, body


def _hostile() -> list[tuple[str, str, dict | bytes]]:
    """(what, path, body) of requests that must each get a 4xx before anything reaches the ranks."""
    base = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    huge = [2**31 + 1, 2**63 - 1, 2**63, 2**64, 2**80, -(2**63) - 1, -(2**80)]
    wrong = [1.5, "3", True, [1], {}]
    prompts = [[-1], [512], [513], [2**31], *([i] for i in huge), [1.5], ["5"], [True], [None], [], [[1]], "", "hi",
               "\x00", "\u202eabc", "\U0001f600", "\ud800", "a" * 100_000, {"a": 1}, None, [[1, 2], [3, 4]], ["a", "b"],
               [7] * ((1 << 20) + 1)]  # fmt: skip
    out = []
    for k, values in {
        "seed": [2**63, 2**64, 2**80, -(2**63) - 1, -(2**80), *wrong],
        "max_tokens": [0, -1, *huge, 1e300, *wrong],
        "temperature": [-1, -1e-9, 2.5, 1e308, 2**80, -(2**80), "hot", True, [1]],
        "top_p": [0, -0.5, 1.5, 2**80, -(2**80), "x", True],
        "n": [0, 17, -1, 2**80, True, 1.0],
        "top_k": [-2, 1.5, "x", True, 2**80],
        "min_p": [-0.1, 1.5, "x", True],
        "typical_p": [0, -1, 1.5],
        "eta_cutoff": [1, -0.1, 2],
        "stop_token_ids": [[-1], [512], "x", [1] * 65, [True], [2**63]],
        "ignore_eos": ["yes", 1],
        "tools": [[{"type": "function", "function": {"name": "f"}}]],
        "response_format": [{"type": "json_schema", "json_schema": {"$ref": "#"}}, "json"],
        "best_of": [3],
        "stop": [5, ["a"] * 5, "x" * 5000, ["\ud800"], [None]],
        "prompt": prompts,
        "model": ["nope", "\u202e", "\ud800", 5],  # null: left out, the served model
        "stream": ["maybe", [1], "yes", 1],
        "logprobs": [[5], 21, -1, 2**80, "3", True],
        "\ud800": [1],  # an unknown field whose name is not valid Unicode
    }.items():
        for v in values:
            out.append((f"completions {k}={str(v)[:40]!r}", "/v1/completions", {**base, k: v}))
    for k, values in {"max_completion_tokens": [0, *huge, *wrong], "max_tokens": [2**80], "echo": [True],
                      "tools": [[], [{"type": "function", "function": {"name": "a b"}}], "f"],
                      "tool_choice": ["always", {"type": "function"}],
                      "messages": [[], [{"role": "user", "content": "\ud800"}], [{"role": "x", "content": "a"}],
                                   [{"role": "user", "content": [{"type": "text", "text": 5}]}], "hi"]}.items():  # fmt: skip
        for v in values:
            out.append((f"chat {k}={str(v)[:40]!r}", "/v1/chat/completions", {**chat, k: v}))
    head = b'{"model": "tiny-llama", "max_tokens": 2, '
    for k in ("seed", "max_tokens", "temperature", "top_p"):
        for v in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
            body = head + b'"prompt": [5], "' + k.encode() + b'": ' + v + b"}"
            out.append((f"raw {k}={v.decode()}", "/v1/completions", body))
    for what, raw in {
        "nested lists": head + b'"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        "nested objects": head + b'"prompt": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_000 + b"}",
        "lone surrogate": head + b'"prompt": "\\ud800\\udfff\\udc00"}',
        "invalid UTF-8": head + b'"prompt": "\xff\xfe"}',
        "NUL byte": head + b'"prompt": "a\x00b"}',
        "truncated": head + b'"prompt": [5',
        "not an object": b"[1, 2, 3]",
        "empty": b"",
    }.items():
        out.append((f"raw {what}", "/v1/completions", raw))
    return out


def _by_hand(model, ids: list[int], n: int, sampler=None) -> list[int]:
    """``n`` tokens of single-process transformers, one full forward per token (no EOS stop),
    chosen by ``sampler`` (:class:`treeattn.decoding.sampler.Sampler`; None: greedy)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(sampler.next(logits) if sampler is not None else int(logits.argmax()))
    return out[len(ids) :]


def test_lenient_requests_and_sampling_extras(tiny_server):
    """As vLLM's server: null is absent and unknown fields are ignored (an OpenAI SDK's
    metadata, store, user, service_tier, ...), known fields at their no-op values pass, and
    vLLM's sampling extras reach the row's sampler: top_k = 1 and min_p = 1 are greedy
    decoding, typical_p and eta_cutoff draw exactly what transformers' warpers and the same
    seed draw, stop_token_ids end the answer at that token, ignore_eos runs to max_tokens."""
    from treeattn.decoding.sampler import Sampler

    s = tiny_server
    model = _model()
    ids = [11, 12, 13, 14, 15]
    greedy = _by_hand(model, ids, 10)
    base = {"model": MODEL, "prompt": ids, "max_tokens": 10}
    odd = {"temperature": None, "top_p": None, "seed": None, "stop": None, "logit_bias": None, "metadata": {"a": "b"},
           "store": False, "user": "u", "service_tier": "auto", "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
           "logprobs": None, "echo": False, "best_of": 1, "parallel_tool_calls": True, "x_unknown": [1, {"y": 2}]}  # fmt: skip
    for extra in ({"temperature": 0}, {"temperature": 1.5, "top_k": 1, "seed": 3}, {"temperature": 1.5, "min_p": 1.0},
                  {**odd, "temperature": 0}, {**odd, "top_k": 1}):  # fmt: skip
        st, body = s.request("POST", "/v1/completions", {**base, **extra})
        assert st == 200, (extra, body)
        want = greedy[: greedy.index(2)] if 2 in greedy else greedy  # EOS (2) ends it, unshown
        assert _ids_of(body["choices"][0]["text"]) == want, extra
    for kw in (dict(typical_p=0.5), dict(eta_cutoff=0.05), dict(top_k=20, min_p=0.05, top_p=0.9)):
        req = {**base, "max_tokens": 12, "temperature": 1.3, "seed": 17, "ignore_eos": True, **kw}
        st, body = s.request("POST", "/v1/completions", req)
        want = _by_hand(model, ids, 12, Sampler(True, temperature=1.3, seed=17, **kw))
        assert st == 200 and _ids_of(body["choices"][0]["text"]) == want, (kw, body)
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 12
    assert 2 not in greedy[:4], greedy  # (the fixture: no EOS early, so a stop token is what ends the answer)
    stop_at = greedy[3]
    st, body = s.request("POST", "/v1/completions", {**base, "temperature": 0, "stop_token_ids": [stop_at]})
    got = greedy[: greedy.index(stop_at)]
    assert st == 200 and _ids_of(body["choices"][0]["text"]) == got, body
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == len(got) + 1
    assert s.output().count("ignoring the unknown request field 'x_unknown'") == 1  # logged once, asked twice
    # refused, naming the field: what this server cannot honour
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for field, value in (("n", 17), ("n", True), ("best_of", 2), ("top_logprobs", 3), ("tools", []),
                         ("guided_json", {}), ("functions", [{"name": "f"}])):  # fmt: skip
        st, body = s.request("POST", "/v1/chat/completions", {**chat, field: value})
        assert st == 400 and body["error"]["param"] == field and field in body["error"]["message"], (field, body)
    for field, value in (("logit_bias", {"x5": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"99999": 1}),
                         ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("min_tokens", 17), ("min_tokens", -1),
                         ("response_format", {"type": "json_object"})):  # fmt: skip  (out of range; no tokenizer)
        st, body = s.request("POST", "/v1/completions", {**base, field: value})
        assert st == 400 and body["error"]["param"].startswith(field) and field in body["error"]["message"], body
    assert s.request("GET", "/health")[1]["status"] == "ok"


def _processed(ids: list[int], n_prompt: int, logits, bias: dict, rep: float, pres: float, freq: float,
               min_tokens: int, ends: list[int]):
    """transformers' processors on ``ids`` (prompt and output so far), then OpenAI's penalties."""
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    x, t = logits[None].float().clone(), torch.tensor([ids])
    if bias:
        x = SequenceBiasLogitsProcessor({(k,): float(v) for k, v in bias.items()})(t, x)
    x = RepetitionPenaltyLogitsProcessor(rep)(t, x) if rep != 1 else x
    x = MinNewTokensLengthLogitsProcessor(n_prompt, min_tokens, ends)(t, x) if min_tokens else x
    c = torch.bincount(torch.tensor(ids[n_prompt:], dtype=torch.int64), minlength=x.shape[1]).float()
    return (x[0] - freq * c - pres * (c > 0).float())


def test_penalties_and_logit_bias_match_transformers(tiny_server):
    """OpenAI's presence / frequency penalties and logit_bias, vLLM's repetition_penalty and
    min_tokens, per request, through the prompt-lookup drafts the tiny server verifies: greedy
    and seeded answers, streamed and not, equal single-process transformers with its own
    processors (RepetitionPenalty, SequenceBias, MinNewTokensLength, and the OpenAI formula)
    on the same history; min_tokens holds back EOS, stop tokens and stop strings."""
    from treeattn.decoding.sampler import Sampler

    s = tiny_server
    model = _model()
    ids = [71, 72, 73, 71, 72, 73, 71, 72]  # a repeat: prompt lookup drafts
    cases = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=0.5),
             dict(logit_bias={"40": 8.0, "7": -100}), dict(min_tokens=6, frequency_penalty=-0.5),
             dict(repetition_penalty=1.3, presence_penalty=-1.0, logit_bias={"33": 3.0}, min_tokens=3)]  # fmt: skip
    for kw in cases:
        for sample in (False, True):
            req = {"model": MODEL, "prompt": ids, "max_tokens": 10, **kw,
                   **({"temperature": 1.2, "seed": 5} if sample else {"temperature": 0})}  # fmt: skip
            bias = {int(k): v for k, v in kw.get("logit_bias", {}).items()}
            sampler = Sampler(True, temperature=1.2, seed=5) if sample else None
            out = list(ids)
            with torch.no_grad():
                for _ in range(10):
                    x = _processed(out, len(ids), model(torch.tensor([out])).logits[0, -1], bias,
                                   kw.get("repetition_penalty", 1.0), kw.get("presence_penalty", 0.0),
                                   kw.get("frequency_penalty", 0.0), kw.get("min_tokens", 0), [2])  # fmt: skip
                    out.append(sampler.next(x) if sample else int(x.argmax()))
                    if out[-1] == 2:
                        break
            want = [t for t in out[len(ids) :] if t != 2]
            st, body = s.request("POST", "/v1/completions", req)
            assert st == 200 and _ids_of(body["choices"][0]["text"]) == want, (kw, sample, body)
            ev = [e for e in s.events("/v1/completions", {**req, "stream": True}) if e != "[DONE]"]
            assert _ids_of("".join(e["choices"][0]["text"] for e in ev if e["choices"])) == want, (kw, sample)
    # min_tokens: the stop token and the stop string that would end the answer earlier wait for it
    greedy = _by_hand(model, ids, 8)
    base = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    st, body = s.request("POST", "/v1/completions", {**base, "stop": [f"<{greedy[0]}>"], "min_tokens": 2})
    assert st == 200 and _ids_of(body["choices"][0]["text"])[:1] == greedy[:1], body


def _log_softmax_steps(model, ids: list[int], toks: list[int]) -> list[torch.Tensor]:
    """transformers' log-softmax at each of ``toks`` (one full forward per token, float32)."""
    out = []
    with torch.no_grad():
        for i in range(len(toks)):
            out.append(torch.log_softmax(model(torch.tensor([ids + toks[:i]])).logits[0, -1].float(), -1))
    return out


def test_completion_logprobs_match_transformers(tiny_server):
    """``logprobs: k`` on /v1/completions (through the prompt-lookup drafts the tiny server
    verifies, so several positions of one step report): every token's logprob and its k
    likeliest alternatives within 1e-4 of transformers' log-softmax on the same prefix, text
    offsets adding up, the streamed entries the same as the whole answer's."""
    s = tiny_server
    model = _model()
    ids = [21, 22, 23, 21, 22, 23, 21, 22]  # a repeat, so prompt lookup drafts
    req = {"model": MODEL, "prompt": ids, "max_tokens": 9, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    st, body = s.request("POST", "/v1/completions", req)
    assert st == 200, body
    lp = body["choices"][0]["logprobs"]
    toks = _ids_of("".join(lp["tokens"]))
    assert toks == _ids_of(body["choices"][0]["text"]) and len(toks) == 9
    for t, got, top, lsm in zip(toks, lp["token_logprobs"], lp["top_logprobs"], _log_softmax_steps(model, ids, toks),
                                strict=True):  # fmt: skip
        assert abs(got - float(lsm[t])) < 1e-4
        v, i = lsm.topk(3)
        assert list(top) == [f"<{x}>" for x in i.tolist()] and all(abs(top[f"<{x}>"] - y) < 1e-4 for x, y in
                                                                   zip(i.tolist(), v.tolist(), strict=True))  # fmt: skip
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:k]) for k in range(9)]
    ev = [e for e in s.events("/v1/completions", {**req, "stream": True}) if e != "[DONE]"]
    streamed = [x for e in ev if e["choices"] and e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    st, body = s.request("POST", "/v1/completions", {**req, "logprobs": 0})
    assert st == 200 and body["choices"][0]["logprobs"]["top_logprobs"] is None
    assert s.request("POST", "/v1/completions", {**req, "logprobs": None})[1]["choices"][0]["logprobs"] is None
    st, body = s.request("POST", "/v1/completions", {**req, "logprobs": 21})
    assert st == 400 and "logprobs" in body["error"]["message"]


def test_completion_echo_with_prompt_logprobs(tiny_server):
    """``echo`` on /v1/completions (lm-eval's loglikelihood requests): the answer's text and
    logprobs begin with the prompt's, the first prompt token without a logprob, every other
    within 1e-4 of transformers' log-softmax on the prefix before it, also when the prompt's
    beginning is cached; streamed the same; echo without logprobs is the prompt's text then
    the answer; chat has no echo (400)."""
    s = tiny_server
    model = _model()
    ids = [81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91]  # longer than a prefill chunk (8): joins of two chunks
    req = {"model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True,
           "ignore_eos": True}  # fmt: skip
    s.request("POST", "/v1/completions", {**req, "prompt": ids[:9], "echo": False})  # the beginning cached
    st, body = s.request("POST", "/v1/completions", req)
    assert st == 200, body
    c = body["choices"][0]
    lp, answer = c["logprobs"], _ids_of(c["text"])
    assert answer[: len(ids)] == ids and len(answer) == len(ids) + 3, c["text"]
    toks = _ids_of("".join(lp["tokens"]))
    assert toks == answer and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    lsm = _log_softmax_steps(model, ids[:1], answer[1:])  # the log-softmax before each token after the first
    for k, (t, got, top) in enumerate(zip(answer[1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True)):
        assert abs(got - float(lsm[k][t])) < 1e-4, (k, got, float(lsm[k][t]))
        v, i = lsm[k].topk(2)
        assert list(top) == [f"<{x}>" for x in i.tolist()], (k, top)
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 3
    ev = [e for e in s.events("/v1/completions", {**req, "stream": True}) if e != "[DONE]"]
    assert _ids_of("".join(e["choices"][0]["text"] for e in ev if e["choices"])) == answer
    assert [x for e in ev if e["choices"] and e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
    st, body = s.request("POST", "/v1/completions", {**req, "logprobs": None})
    assert st == 200 and _ids_of(body["choices"][0]["text"]) == answer and body["choices"][0]["logprobs"] is None
    st, body = s.request("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                          "echo": True})  # fmt: skip
    assert st == 400 and body["error"]["param"] == "echo", body


@pytest.mark.parametrize("tpa", ["1", "2"])
def test_server_with_the_weights_split(tpa):
    """``--tp 2``: each rank holds half of every layer's MLP and output projection (``--tpa 2``:
    and of the attention heads, each rank the K/V of its heads, the whole sequence). Greedy
    answers equal single-process transformers', and requests run together (prompt-lookup
    drafts, a shared cached prefix, seeded sampling, joins long enough that a step's tokens
    are split over the ranks) answer exactly as each alone."""
    s = Server("--preset", MODEL, "--nproc", "2", "--tp", "2", "--tpa", tpa, "--prefill-chunk", "64",
               "--cache-tokens", "512", "--speculate", "prompt-lookup")  # fmt: skip  (joins of up to 64 tokens: steps split over the ranks)
    try:
        model = _model()
        g = torch.Generator().manual_seed(4)
        doc = torch.randint(3, 500, (30,), generator=g).tolist()
        reqs = [{"model": MODEL, "prompt": doc + torch.randint(3, 500, (7 * k,), generator=g).tolist(), "max_tokens": 10,
                 **({"temperature": 0} if k % 2 else {"temperature": 1.2, "seed": k})} for k in range(1, 9)]  # fmt: skip
        alone = []
        for r in reqs:
            st, body = s.request("POST", "/v1/completions", r)
            assert st == 200, body
            alone.append(body["choices"][0]["text"])
            if r["temperature"] == 0:
                assert _ids_of(alone[-1]) == [t for t in _reference(model, r["prompt"], 10) if t != 2], r
        together: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i, r=r: together.update({i: s.request("POST", "/v1/completions", r)[1]
                   ["choices"][0]["text"]})) for i, r in enumerate(reqs)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [together[i] for i in range(len(reqs))] == alone
        health = s.request("GET", "/health")[1]
        assert health["status"] == "ok" and health["cached_tokens"] > 0, health
    finally:
        s.kill()


def _metrics(s) -> dict:
    """``GET /metrics`` (no API key) parsed: sample name with its labels -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(s.url + "/metrics", timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text)
            for x in f.samples}  # fmt: skip


def test_metrics(tiny_server):
    """``/metrics`` over two requests (the second leaves out ``model``: the served one): each
    observed once in the latency histograms (the inter-token one once per token after the
    first), the token and prefix-cache counters moved by what their usage reports, nothing
    left running or waiting, the K/V bound shown."""
    s = tiny_server
    before = _metrics(s)
    ids = [61, 62, 63, 64, 65, 66, 67]
    st, body = s.request("POST", "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert st == 200, body
    P = "treeattn:"

    def grew(name, labels=()):
        return after[(P + name, labels)] - before.get((P + name, labels), 0.0)

    n, u = 6, body["usage"]
    st, alone = s.request("POST", "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True})  # no model: the served one (as vLLM)
    assert st == 200 and alone["model"] == MODEL and alone["choices"][0]["text"] == body["choices"][0]["text"]
    after = _metrics(s)
    assert u["completion_tokens"] == n
    for h in ("time_to_first_token_seconds", "request_queue_time_seconds", "e2e_request_latency_seconds"):
        assert grew(h + "_count") == 2, h
        assert 0 < grew(h + "_sum") < 120, h
    assert grew("inter_token_latency_seconds_count") == 2 * (n - 1)
    assert grew("request_success_total", (("finished_reason", "length"),)) == 2
    assert grew("generation_tokens_total") == 2 * n and grew("prompt_tokens_total") == 2 * len(ids)
    assert grew("prefix_cache_queries_total") == 2 * len(ids)
    cached = u["prompt_tokens_details"]["cached_tokens"] + alone["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert grew("prefix_cache_hits_total") == cached > 0  # the second found the first's prompt cached
    assert after[(P + "num_requests_running", ())] == 0 and after[(P + "num_requests_waiting", ())] == 0
    assert after[(P + "kv_cache_capacity_tokens", ())] == 64
    assert 0 < after[(P + "kv_cache_usage_tokens", ())] <= 64


def test_n_choices(tiny_server):
    """``n`` > 1: one request, n choices (one row each), the prompt prefilled once (the other
    choices read its cached K/V); greedy choices equal the answer alone, a seeded choice i the
    answer of seed + i alone; streamed, each choice's chunks carry its index and add up to it."""
    s = tiny_server
    ids = [31, 32, 33, 34, 35, 36]
    base = {"model": MODEL, "prompt": ids, "max_tokens": 7}
    before = s.request("GET", "/health")[1]
    st, body = s.request("POST", "/v1/completions", {**base, "temperature": 0, "n": 3})  # a prompt not seen before
    after = s.request("GET", "/health")[1]
    one = s.request("POST", "/v1/completions", {**base, "temperature": 0})[1]
    assert st == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2], body
    assert all(c["text"] == one["choices"][0]["text"] for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert after["requests"] - before["requests"] == 3
    assert after["cached_tokens"] - before["cached_tokens"] == 2 * (len(ids) - 1)  # the other two read the first's
    samp = {**base, "temperature": 1.3, "seed": 40}
    st, body = s.request("POST", "/v1/completions", {**samp, "n": 2})
    alone = [s.request("POST", "/v1/completions", {**samp, "seed": 40 + i})[1]["choices"][0]["text"] for i in (0, 1)]
    assert st == 200 and [c["text"] for c in body["choices"]] == alone and alone[0] != alone[1]
    ev = [e for e in s.events("/v1/completions", {**samp, "n": 2, "stream_options": {"include_usage": True}})
          if e != "[DONE]"]  # fmt: skip
    texts = ["".join(e["choices"][0]["text"] for e in ev if e["choices"] and e["choices"][0]["index"] == i)
             for i in (0, 1)]  # fmt: skip
    assert texts == alone and ev[-1]["choices"] == [] and ev[-1]["usage"]["completion_tokens"] == 14
    finished = [e["choices"][0]["index"] for e in ev if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_hostile_requests_leave_the_ranks_alone(tiny_server):
    """Every field that reaches the ranks is checked on rank 0 before anything is queued: each
    hostile request gets a 4xx (400, or 404 for an unknown model) while a stream runs, the
    ranks never see it (the request count does not move, /health stays ok), and afterwards
    odd but valid requests and a plain one answer exactly."""
    s = tiny_server
    model = _model()
    ids = [9, 8, 7, 6]
    ref = _reference(model, ids, 40)
    stream = s.events("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 40, "temperature": 0})
    first = next(stream)  # a request is running (or just ran) while the hostile ones arrive
    before = s.request("GET", "/health")[1]["requests"]
    for what, path, body in _hostile():
        st, got = s.request("POST", path, raw=body) if isinstance(body, bytes) else s.request("POST", path, body)
        assert st in (400, 404), (what, st, got)
        assert set(got) == {"error"} and got["error"]["message"], (what, got)
        st, health = s.request("GET", "/health")
        assert st == 200 and health["status"] == "ok" and health["requests"] == before, (what, health)
    text = first["choices"][0]["text"] + "".join(e["choices"][0]["text"] for e in stream if e != "[DONE]")
    assert _ids_of(text) == [t for t in ref if t != 2]
    base = {"model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 1.5}
    for odd in ({"seed": -1}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"prompt": [511, 0]},
                {"stop": ["\x00", "\U0001f600", "\u202e"]}, {"prompt": [5] * 60}, {"temperature": 1e-45},
                {"temperature": 1e-300}):  # fmt: skip
        st, got = s.request("POST", "/v1/completions", {**base, **odd})
        assert st == 200 and got["choices"][0]["finish_reason"] in ("stop", "length"), (odd, got)
    st, got = s.request("POST", "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 0})
    assert st == 200 and _ids_of(got["choices"][0]["text"]) == [t for t in ref[:12] if t != 2], got
    assert s.request("GET", "/health")[1]["status"] == "ok"


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
    r = serve("--speculate", "prompt-lookup", "--num-draft-tokens", "16")
    assert r.returncode == 2 and "must be <= 15, got 16" in r.stderr, r.stderr
    r = serve("--speculate", "draft")
    assert r.returncode == 2 and "--speculate draft needs --draft-model" in r.stderr, r.stderr
    r = serve("--draft-model", MODEL)
    assert r.returncode == 2 and "--draft-model is used by --speculate draft only" in r.stderr, r.stderr
    r = serve("--draft-cache-tokens", "64")
    assert r.returncode == 2 and "--draft-cache-tokens is used with --draft-model only" in r.stderr, r.stderr
    r = serve("--speculate", "draft", "--draft-model", "small-llama")  # another vocabulary
    assert r.returncode == 2 and "its vocabulary" in r.stderr, r.stderr
    r = serve("--kv-cache-memory", "lots")
    assert r.returncode == 2 and "argument --kv-cache-memory: expected a size such as 8GiB" in r.stderr, r.stderr
    r = serve("--kv-cache-memory", "1GiB", "--cache-tokens", "100")
    assert r.returncode == 2 and "give --kv-cache-memory or --cache-tokens, not both" in r.stderr, r.stderr
    r = serve("--kv-cache-memory", "10")
    assert r.returncode == 2 and "less than one token's K/V" in r.stderr, r.stderr
    for too_much in (("--kv-cache-memory", "100000TiB"), ("--cache-tokens", str(10**13))):
        r = serve(*too_much)
        assert r.returncode == 2 and "does not fit" in r.stderr and "GiB available" in r.stderr, (too_much, r.stderr)
    r = serve("--max-model-len", "2000000")  # the preset has 1,048,576 positions
    assert r.returncode == 2 and "--max-model-len 2000000 exceeds the model's 1048576 positions" in r.stderr, r.stderr
    r = serve("--tp", "3", "--nproc", "2")
    assert r.returncode == 2 and "--tp 3: the weights split over 1 rank (whole) or every rank (2)" in r.stderr, r.stderr
    r = serve("--chat-template", "/no/such/template.jinja")
    assert r.returncode == 2 and "no such file, and not a Jinja template" in r.stderr, r.stderr
    r = serve("--chat-template", "{% for m in messages %}{{ m.content }}")  # the for is never closed
    assert r.returncode == 2 and "not a valid Jinja template" in r.stderr, r.stderr
    r = serve("--chat-template", "{{ messages[0].content }}")
    assert r.returncode == 2 and "a preset has none" in r.stderr, r.stderr


def test_chat_template_from_a_file_or_inline(tmp_path):
    from treeattn.cli.serve import chat_template

    t = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(t)
    assert chat_template(str(f)) == t and chat_template(t) == t and chat_template(None) is None


def test_generation_config_defaults_and_max_model_len():
    """``--generation-config auto`` (vLLM's default): what a request leaves out (or sends as
    null) samples with the model's generation_config values, only those it sets; a request's
    own value wins. ``--max-model-len``: the positions a request may take."""
    from treeattn.serve.api import ApiError, CompletionRequest, ServerState, generation_defaults
    from treeattn.serve.jobs import build_jobs as _jobs

    model = _model()
    assert generation_defaults(model) == {}  # a config with no sampling values: OpenAI's defaults
    gc = model.generation_config
    gc.temperature, gc.top_p, gc.top_k, gc.repetition_penalty, gc.typical_p = 0.6, 0.9, 20, 1.1, 5.0
    d = generation_defaults(model)
    assert d == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}  # not repetition_penalty; typical_p out of range
    state = ServerState(MODEL, None, 40, 500, lambda n: n, 0, 4, [2], {}, defaults=d)

    def job(**kw):
        return _jobs(state, CompletionRequest.model_validate({"model": MODEL, "prompt": [1, 2], **kw}))[0]

    j = job()
    assert (j.temperature, j.top_p, j.top_k) == (0.6, 0.9, 20)
    j = job(temperature=0, top_p=None, top_k=-1)
    assert (j.temperature, j.top_p, j.top_k) == (0.0, 0.9, None)
    with pytest.raises(ApiError, match="supports 40 positions: ask for at most 38"):
        job(max_tokens=39)
    assert job().max_tokens == 38


def _drain(stream) -> list:
    """What is left of a stream: its events, then "closed" when the connection drops."""
    out = []
    try:
        for e in stream:
            out.append(e)
    except OSError:
        out.append("closed")
    return out


def test_batch_faults_hang_up_and_rank_killed():
    """Under a batch of three streams (``--max-batch 3``, a fourth request queued), with a draft
    model drafting for each (the model itself, fixed depth: the CLI's draft path across ranks):
    a client that hangs up frees its row at the next step while the others finish exactly;
    then a rank dies mid-batch: every running and queued client gets an error (or its
    connection closes), /health says failed, the server exits with the cause, and no process
    is left."""
    import os

    s = Server("--preset", MODEL, "--nproc", "2", "--collective-timeout", "30", "--max-batch", "3",
               "--prefill-chunk", "8", "--cache-tokens", "0", "--speculate", "draft", "--draft-model", MODEL,
               "--fixed-draft")  # fmt: skip
    try:
        model = _model()
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
        refs = [_reference(model, ids, 30) for ids in prompts]
        # the one that hangs up asks for many tokens: drafts make answers quick, and it must still run when it leaves
        streams = [s.events("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1000 if i == 1 else 30,
                                                "temperature": 0}) for i, ids in enumerate(prompts)]  # fmt: skip
        firsts = [next(st) for st in streams]  # all three run
        streams[1].close()  # hangs up
        rest = [_drain(streams[i]) for i in (0, 2)]
        for i, tail in zip((0, 2), rest, strict=True):
            text = firsts[i]["choices"][0]["text"] + "".join(e["choices"][0]["text"] for e in tail[:-1])
            assert tail[-1] == "[DONE]" and _ids_of(text) == [t for t in refs[i] if t != 2], (i, tail[-3:])
        deadline = time.monotonic() + 30
        while s.request("GET", "/health")[1]["cancelled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        h = s.request("GET", "/health")[1]
        assert h["cancelled"] == 1 and h["running"] == 0 and h["status"] == "ok", h
        assert h["draft_tokens_accepted"] > 0 and h["mean_accepted_length"] > 1.5, h

        ranks = s.ranks()
        tree = set(ranks) | {s.proc.pid}
        body = {"model": MODEL, "max_tokens": 200000, "temperature": 0}
        streams = [s.events("/v1/completions", {**body, "prompt": [1, 2, 3 + i]}) for i in range(3)]
        got = [next(st) for st in streams]
        assert all("choices" in e for e in got)
        queued: dict = {}
        waiter = threading.Thread(target=lambda: queued.update(r=s.request("POST", "/v1/completions",
                                  {**body, "prompt": [4, 4], "max_tokens": 3}, timeout=120)))  # fmt: skip
        waiter.start()
        deadline = time.monotonic() + 30
        while s.request("GET", "/health")[1]["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.request("GET", "/health")[1]["queued"] == 1
        os.kill(ranks[1], signal.SIGKILL)
        for st in streams:
            tail = _drain(st)
            assert tail[-1] in ("[DONE]", "closed"), tail[-3:]
            if tail[-1] == "[DONE]":
                err = tail[-2]["error"]
                assert err["type"] == "server_error" and "rank" in err["message"], err
        waiter.join(120)
        r = queued.get("r")
        assert r is None or r[0] == 503, r  # None: the connection closed
        try:
            st, h = s.request("GET", "/health", timeout=5)
            assert st == 503 and h["status"] == "failed", h
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
