"""A long synthetic document with one fact buried in it (needle in a haystack), for tests and docs."""

from __future__ import annotations

import random

_PLACES = ["Valmont", "Kestrel Bay", "Ardenne", "Lowmarsh", "Corvin", "Elder Ridge", "Saltmere", "Brackwater"]
_GOODS = ["wool", "copper", "salt", "barley", "timber", "flax", "tin", "amber"]
_FORMS = [
    "In {year} the harbor of {place} shipped {n} tons of {good} to the northern markets.",
    "The council of {place} met {n} times in {year} to discuss the price of {good}.",
    "Travelers to {place} in {year} reported {n} carts of {good} waiting at the gate.",
    "A survey of {place} counted {n} workshops that handled {good} in {year}.",
    "By {year}, the road from {place} carried about {n} loads of {good} each month.",
]

NEEDLE = "The secret code for the vault in Saltmere is {code}."
QUESTION = "What is the secret code for the vault in Saltmere? Answer with the number."


def haystack(tokenizer, n_tokens: int, *, depth: float = 0.5, code: int = 7319, seed: int = 0) -> str:
    """Filler text of about ``n_tokens`` tokens (by ``tokenizer``) with the sentence
    :data:`NEEDLE` placed at fraction ``depth`` of it, followed by :data:`QUESTION`."""
    rng = random.Random(seed)
    sentences, total = [], 0
    while total < n_tokens:
        s = rng.choice(_FORMS).format(
            year=rng.randint(1700, 1899), place=rng.choice(_PLACES), n=rng.randint(2, 900), good=rng.choice(_GOODS)
        )
        sentences.append(s)
        total += len(tokenizer(" " + s, add_special_tokens=False).input_ids)
    sentences.insert(int(depth * len(sentences)), NEEDLE.format(code=code))
    paragraphs = [" ".join(sentences[i : i + 8]) for i in range(0, len(sentences), 8)]
    return "\n\n".join(paragraphs) + "\n\n" + QUESTION


def chat_ids(tokenizer, text: str):
    """``[1, L]`` ids of ``text`` as one user turn in the tokenizer's chat template."""
    msgs = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def doc_questions(tokenizer, doc: str, questions) -> tuple[list, int]:
    """The chat prompts of ``doc + q`` for each question and the length of the prefix they all
    share (the document's tokens a session can prefill once)."""
    prompts = [chat_ids(tokenizer, doc + q) for q in questions]
    n = min(p.shape[1] for p in prompts)
    same = prompts[0][0, :n] == prompts[0][0, :n]
    for p in prompts[1:]:
        same &= p[0, :n] == prompts[0][0, :n]
    return prompts, int(same.long().cumprod(0).sum())
