"""The server's incremental detokenization (``serve.jobs.streamer``: tokenizers' DecodeStream) on
the real model's tokenizer: after every token of an answer, the text so far is a prefix of the
whole decode of the tokens so far (it holds back a token whose character is not complete yet),
and all of it once the characters are; through the scheduler's bookkeeping (stop strings that
span tokens, EOS, max_tokens) a request sends the same text and finish as when the whole answer
is decoded at every token."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from smol import GGUF, NEEDS_SMOL  # noqa: E402

pytestmark = NEEDS_SMOL


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from treeattn.hf.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(str(GGUF)), local_files_only=True)


def _answers(tok):
    text = "Héllo wörld, 你好! Ça va? 🙂🙂 x = {'a': [1, 2]}\n\n  spaced   out <|im_end|> tail"
    yield tok(text).input_ids
    g = torch.Generator().manual_seed(0)
    for n in (40, 200):  # random ids: split multi-byte characters, special tokens among them
        yield torch.randint(0, len(tok), (n,), generator=g).tolist()


def test_stream_is_the_whole_decode(tok):
    from treeattn.serve.jobs import streamer as _streamer

    start = _streamer(tok)
    assert start is not None  # SmolLM2's tokenizer: fast, no clean-up of spaces
    for ids in _answers(tok):
        step, text = start(), ""
        for i in range(len(ids)):
            text += step(ids[i])
            whole = tok.decode(ids[: i + 1], skip_special_tokens=True)
            assert whole.startswith(text), (i, text, whole)
        if not whole.endswith("\ufffd"):
            assert text == whole


def test_scheduler_sends_the_same_with_and_without_the_stream(tok):
    from treeattn.serve.job import Job
    from treeattn.serve.jobs import streamer as _streamer
    from treeattn.serve.request import Request

    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    for ids in _answers(tok):
        for stops in ([], ["wö", "va?"], ["🙂🙂", "\n\n "]):
            for n in (len(ids), len(ids) // 2 + 1):
                sent = []
                for stream in (None, _streamer(tok)):
                    events = []
                    req = Request([1], n, emit=lambda k, d, ev=events: ev.append((k, d)),
                                  decode=lambda t: tok.decode(t, skip_special_tokens=True), stream=stream,
                                  stop=stops, eos=eos)  # fmt: skip
                    job = Job(req, 0, None, 0, 0)
                    for t in ids:
                        job.take(t)
                        if job.finish:
                            break
                    assert all(k == "text" for k, _ in events)
                    sent.append(("".join(d for _, d in events), job.finish, len(job.out)))
                assert sent[0] == sent[1], (stops, n, sent)
