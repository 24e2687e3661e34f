"""OpenAI's two shapes of token log-probabilities, from the engine's entries ``(token,
logprob, [(alternative, logprob), ...])`` (:class:`treeattn.serve.request.Request`): chat's
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` and the legacy completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""

from __future__ import annotations

from collections.abc import Callable

Name = Callable[[int], str]  # a token id -> its text


def _one(name: Name, tok: int, lp: float) -> dict:
    s = name(tok)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", errors="replace"))}


def chat(entries: list, name: Name) -> dict:
    """Chat completions' ``logprobs`` of ``entries``."""
    return {"content": [{**_one(name, t, lp), "top_logprobs": [_one(name, a, alp) for a, alp in alt]}
                        for t, lp, alt in entries]}  # fmt: skip


def completion(entries: list, name: Name, offset: int, top: int) -> dict:
    """Completions' ``logprobs`` of ``entries``, their text starting at character ``offset`` of
    the completion; ``top``: the alternatives asked for (0: ``top_logprobs`` is None)."""
    toks, offsets = [], []
    for t, _, _ in entries:
        toks.append(name(t))
        offsets.append(offset)
        offset += len(toks[-1])
    tops = [None if alt is None else {name(a): alp for a, alp in alt} for _, _, alt in entries] if top else None
    return {"tokens": toks, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip
