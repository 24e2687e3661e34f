"""One cross-rank agreement over every setting: a disagreement planted on one rank in any field
of generate's, Session's or the server engine's settings raises the same ValueError on every
rank, before the model runs (no forward, no payload collective). The mutation check: with one
field dropped from the digest, the same planted disagreement in it goes through (the bug the
agreement's field cap once hid for top_p), so the test above is what catches such a drop."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from treeattn.config import Layout, Sampling, Serving, Speculation  # noqa: E402
from treeattn.launch import launch  # noqa: E402

P = 2


def other_value(cls: type, f: dataclasses.Field):
    """A valid value of ``f`` other than its default (the planted disagreement)."""
    m = f.metadata["treeattn"]
    d = f.default
    if m["choices"]:
        return next(c for c in m["choices"] if c != d)
    if isinstance(d, bool):
        return not d
    if m["high"] is not None:  # a bounded number: the middle of its range
        return (m["low"] + m["high"]) / 2
    if f.name == "temperature":
        return 0.75
    return (d or m["low"] or 1) + 1


def planted(cls: type) -> list[tuple[str, object]]:
    return [(f.name, other_value(cls, f)) for f in dataclasses.fields(cls)]


GENERATE_OWN = [("max_new_tokens", 5), ("stop_at_eos", False), ("eos_token_id", 7), ("pad_token_id", 3)]


def _tiny():
    from treeattn.hf.presets import build_model

    model = build_model("tiny-llama", None, torch.float32, seed=0)[0]
    runs = []
    model.get_input_embeddings().register_forward_pre_hook(lambda *_: runs.append(1))
    return model, runs


def _refused(call, name: str, runs: list, tag: str) -> None:
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert msg.startswith(f"ranks disagree on {name} ("), f"{tag}: {msg!r}"
    assert all(f"rank {r}:" in msg for r in range(P)), f"{tag}: {msg!r}"
    assert len(set(_everyones(msg))) == 1, f"{tag}: the ranks raised different messages"
    assert not runs, f"{tag}: the model ran before the agreement refused"


def _everyones(text: str) -> list[int]:
    """Every rank's hash of ``text`` (nothing pickled)."""
    h = torch.tensor([int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)])
    out = [torch.zeros_like(h) for _ in range(P)]
    dist.all_gather(out, h)
    return [int(x) for x in out]


def agreement_worker(drop: str | None) -> None:
    from treeattn.decoding import generate
    from treeattn.runtime import Session
    from treeattn.serve.engine import Engine

    rank = dist.get_rank()
    model, runs = _tiny()
    ids = torch.tensor([[1, 2, 3, 4]])
    base = dict(max_new_tokens=4)
    if drop is not None:  # the mutant digest: one field left out
        import treeattn.comm.validate as V

        real = V.items
        V.items = lambda fields: [x for x in real(fields) if x[0] != drop]
        kw = {**base, drop: 0.5 if rank else None}  # top_p: a disagreement the greedy run never notices
        out = generate(model, ids, **kw)  # both ranks return tokens: nothing refused the disagreement
        assert out.shape == (1, 4) and len(set(_everyones(str(out.tolist())))) == 1
        return
    cases = [(n, v) for cls in (Layout, Sampling, Speculation) for n, v in planted(cls)] + GENERATE_OWN
    for name, value in cases:
        kw = {**base, name: value} if rank == 1 else dict(base)
        _refused(lambda kw=kw: generate(model, ids, **kw), name, runs, f"generate {name}")
    for name, value in planted(Layout) + [("max_length", 64)]:
        kw = {name: value} if rank == 1 else {}
        _refused(lambda kw=kw: Session(model, **kw), name, runs, f"Session {name}")
    engine_kw = dict(cache_tokens=64, max_batch=2, num_draft=0, fixed_draft=False, draft_tokens=None)
    alias = {"draft_cache_tokens": "draft_tokens"}
    for name, value in planted(Serving):
        kw = {**engine_kw, alias.get(name, name): value} if rank == 1 else engine_kw
        _refused(lambda kw=kw: Engine(model, None, {}, **kw), name, runs, f"Engine {name}")
    for name, value in planted(Layout):
        skw = {name: value} if rank == 1 else {}
        _refused(lambda skw=skw: Engine(model, None, skw, **engine_kw), name, runs, f"Engine {name}")
    # agreeing ranks still decode (the group is usable after every refusal)
    assert generate(model, ids, max_new_tokens=2, top_p=0.9, do_sample=True).shape == (1, 2)


def test_a_disagreement_in_any_field_fails_every_rank_before_the_model_runs():
    launch(agreement_worker, P, (None,), timeout=300, collective_timeout=30)


def test_mutation_a_field_dropped_from_the_digest_goes_unnoticed():
    """What the test above guards against: without top_p in the digest, rank 1's other top_p
    is accepted and both ranks return tokens (the test above would fail on that field)."""
    launch(agreement_worker, P, ("top_p",), timeout=300, collective_timeout=30)
