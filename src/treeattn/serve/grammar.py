"""Structured output: a request's ``response_format`` (a JSON schema, or any JSON object) as a
token mask per step, from llguidance (a well-kept Rust engine: a mask costs a fraction of a
millisecond on this machine's 49k-token vocabulary and needs no precompiled per-vocabulary
tables; ``benchmarks/grammar_mask.py`` measures it). The mask is computed and applied on rank
0, where every row's next token is chosen, so the ranks stay in lockstep as without it.

One :class:`Grammar` per choice: its matcher follows the tokens taken; the allowed tokens
after them mask the logits (after the history's processors, before the sampler); the answer
ends when the grammar does (``stop``), EOS allowed only where the JSON is complete."""

from __future__ import annotations

import json

import torch
from torch import Tensor

MAX_SCHEMA_CHARS = 1 << 16  # a schema's JSON text at most
_BITS = torch.tensor([[(b >> i) & 1 for i in range(8)] for b in range(256)], dtype=torch.bool)  # byte -> its 8 bits


class GrammarError(ValueError):
    """A response_format this server cannot build a grammar from (its message says why)."""


class Grammars:
    """The grammar engine over one tokenizer (built once, at the first structured request)."""

    def __init__(self, tokenizer, vocab: int, eos: list[int]) -> None:
        try:
            import llguidance.hf
        except ImportError as e:
            raise GrammarError("response_format needs the llguidance package (pip install 'treeattn[serve]')") from e
        self.V = vocab
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos) or None)

    def compile(self, response_format: dict) -> str:
        """The grammar of an OpenAI ``response_format`` (``json_object`` or ``json_schema``);
        GrammarError for a schema that is not one, too long, or that llguidance refuses."""
        from llguidance import LLMatcher

        kind = response_format.get("type")
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise GrammarError("response_format.json_schema.schema must be a JSON schema (an object)")
        else:
            raise GrammarError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
        text = json.dumps(schema)
        if len(text) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"the schema has {len(text)} characters; at most {MAX_SCHEMA_CHARS}")
        try:
            grammar = LLMatcher.grammar_from_json_schema(text)
        except ValueError as e:
            raise GrammarError(f"the schema: {e}") from None
        return self._checked(grammar)

    def compile_lark(self, lark: str) -> str:
        """A Lark grammar (llguidance's dialect, ``%json {schema}`` inside), checked as above."""
        from llguidance import LLMatcher

        if len(lark) > 2 * MAX_SCHEMA_CHARS:
            raise GrammarError(f"the grammar has {len(lark)} characters; at most {2 * MAX_SCHEMA_CHARS}")
        return self._checked(LLMatcher.grammar_from_lark(lark))

    def _checked(self, grammar: str) -> str:
        from llguidance import LLMatcher

        err = LLMatcher.validate_grammar(grammar, self.tok)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"the schema: {err.splitlines()[0][:300]}")
        g = Grammar(self, grammar)
        first = g.allowed()  # (some errors show only when the first mask is computed)
        if g.m.is_error():
            raise GrammarError(f"the schema matches no output ({g.m.get_error().splitlines()[0][:200]})")
        if not bool(first.any()):
            raise GrammarError("the schema matches no output")
        return grammar

    def matcher(self, grammar: str) -> Grammar:
        """A fresh matcher of a compiled grammar (one per choice)."""
        return Grammar(self, grammar)


class Grammar:
    """One choice's matcher."""

    def __init__(self, engine: Grammars, grammar: str) -> None:
        from llguidance import LLMatcher

        self.V = engine.V
        self.m = LLMatcher(engine.tok, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"the schema: {self.m.get_error().splitlines()[0][:200]}")

    def allowed(self) -> Tensor:
        """``[V]`` bool: the tokens the grammar allows next."""
        bits = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.uint8)
        return _BITS[bits.long()].flatten()[: self.V]

    def mask(self, logits: Tensor) -> Tensor:
        """``logits [V]`` with every token the grammar does not allow at -inf (a new tensor)."""
        ok = self.allowed()
        if not bool(ok.any()):  # (a grammar that cannot go on: the answer ends at the next check)
            return logits
        return logits.masked_fill(~ok.to(logits.device), float("-inf"))

    def take(self, tok: int) -> bool:
        """The token was chosen; True when the grammar is complete (the answer ends)."""
        self.m.consume_token(tok)
        return self.m.is_stopped() or self.m.is_error()
