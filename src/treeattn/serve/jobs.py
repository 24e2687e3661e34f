"""A request body (chat or completions, validated by :mod:`treeattn.serve.schema`) as the
engine's requests, one per choice: the prompt's token ids (the chat template with its tools),
every value range-checked (see :mod:`treeattn.serve.api`), the model's generation config for
what is left out, the history's processors, the grammar of a ``response_format`` or a forced
``tool_choice``, the echo, the incremental decoder."""

from __future__ import annotations

from . import tools as TOOLS
from .grammar import GrammarError, Grammars
from .request import Request as Job
from .schema import CHARS_PER_POSITION, ApiError, ChatRequest
from .state import ServerState


def prompt_ids(state: ServerState, body) -> list[int]:
    """The prompt's token ids, each checked to lie in the vocabulary."""
    tok, chat = state.tokenizer, isinstance(body, ChatRequest)
    param = "messages" if chat else "prompt"
    limit = CHARS_PER_POSITION * state.max_positions
    if chat:
        if tok is None or not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
        msgs = TOOLS.messages(body.messages)
        n = sum(len(m["content"] or "") + len(str(m.get("tool_calls", ""))) for m in msgs)
        if n > limit:
            raise ApiError(400, f"the messages have {n} characters; this server takes at most {limit} "
                           f"({CHARS_PER_POSITION} per model position)", param="messages")  # fmt: skip
        try:
            kw = {"tools": TOOLS.for_template([t.model_dump() for t in body.tools])} if tools_on(body) else {}
            enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, **kw)
        except Exception as e:  # a template that raises (roles that do not alternate, ...)
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from None
        ids = list(enc["input_ids"])
    elif isinstance(body.prompt, list):
        ids = list(body.prompt)
    elif tok is None:
        raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
    elif not body.prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    elif len(body.prompt) > limit:
        raise ApiError(400, f"the prompt has {len(body.prompt)} characters; this server takes at most {limit} "
                       f"({CHARS_PER_POSITION} per model position)", param="prompt")  # fmt: skip
    else:
        ids = list(tok(body.prompt).input_ids)
    vocab = min((v for v in (state.vocab, len(tok) if tok is not None else None) if v), default=2**63)
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise ApiError(400, f"prompt token ids must lie in [0, {vocab}), got {bad}", param=param)
    return ids


def streamer(tok):
    """A maker of incremental decoders (tokenizers' ``DecodeStream``) for a fast tokenizer whose
    decode does no clean-up of spaces (then the two agree, as the tests check); else None."""
    backend = getattr(tok, "_tokenizer", None)
    if backend is None or getattr(tok, "clean_up_tokenization_spaces", True) is not False:
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers before 0.21
        return None

    def start():
        ds = DecodeStream(skip_special_tokens=True)
        return lambda t: ds.step(backend, t) or ""

    return start


def build_jobs(state: ServerState, body) -> list[Job]:
    """The engine's requests for ``body``: one per choice (``n``); with a ``seed``, choice i
    samples with ``seed + i`` (so each choice is the answer that seed alone gives)."""
    first = build_job(state, body)
    out = [first]
    for i in range(1, body.n):
        j = build_job(state, body)
        j.seed = None if first.seed is None else (first.seed + i) % 2**64
        out.append(j)
    return out


def build_job(state: ServerState, body) -> Job:
    """The engine's request for ``body``, every value in range (the module's docstring)."""
    logprobs = body.logprob_count()
    ids = prompt_ids(state, body)
    if not ids:
        raise ApiError(400, "the prompt is empty", param="messages" if isinstance(body, ChatRequest) else "prompt")
    L, room = len(ids), state.max_positions - len(ids)
    want = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if room < 1 or (want is not None and want > room):
        raise ApiError(400, f"the prompt has {L} tokens and max_tokens is {want}, but the model supports "
                       f"{state.max_positions} positions: {'shorten the prompt' if room < 1 else f'ask for at most {room}'}",
                       param="max_tokens")  # fmt: skip
    new = want or room  # left out: until EOS, the model's positions or --max-model-len
    if state.cache_tokens and state.per_rank(L + 1) > state.cache_tokens:  # K/V is taken as it is used
        raise ApiError(400, f"the prompt's {L} tokens need up to {state.per_rank(L + 1)} KV tokens per rank; the "
                       f"server holds at most {state.cache_tokens} (--cache-tokens)",
                       param="messages" if isinstance(body, ChatRequest) else "prompt")  # fmt: skip
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    tok = state.tokenizer

    def decode(t):
        return tok.decode(t, skip_special_tokens=True) if tok is not None else "".join(f"<{i}>" for i in t)

    stream = streamer(tok)

    for name, value in state.defaults.items():  # what the request left out: the model's generation config
        if name not in body.model_fields_set:
            body = body.model_copy(update={name: value})
    seed = None if body.seed is None else body.seed % 2**64  # negative: the same 64 bits, unsigned
    vocab = min((v for v in (state.vocab, len(tok) if tok is not None else None) if v), default=2**63)
    bad = next((i for i in body.stop_token_ids if i >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"stop_token_ids must lie in [0, {vocab}), got {bad}", param="stop_token_ids")
    eos = [] if body.ignore_eos else list(state.eos)
    bias = {}
    for k, b in body.logit_bias.items():
        if not (k.isascii() and k.isdigit() and int(k) < vocab):
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab}) (as strings), got {k[:40]!r}",
                           param="logit_bias")  # fmt: skip
        bias[int(k)] = b
    if body.min_tokens > new:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({new})", param="min_tokens")
    grammar = _grammar(state, body)
    echo = None
    if getattr(body, "echo", False):
        echo = body.prompt if isinstance(body.prompt, str) else decode(ids)
    return Job(ids, new, emit=None, decode=decode, stream=stream, temperature=body.temperature, top_p=body.top_p, seed=seed,
               top_k=body.top_k if body.top_k > 0 else None, min_p=body.min_p or None, typical_p=body.typical_p,
               eta_cutoff=body.eta_cutoff or None, logprobs=logprobs, stop=[s for s in stop if s],
               presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
               repetition_penalty=body.repetition_penalty, logit_bias=bias, min_tokens=body.min_tokens, grammar=grammar,
               echo=echo,
               eos=eos + [i for i in body.stop_token_ids if i not in eos])  # fmt: skip


def tools_on(body) -> bool:
    """Whether a chat body has tools the model may call (not ``tool_choice: none``)."""
    return bool(getattr(body, "tools", None)) and getattr(body, "tool_choice", None) != "none"


def _grammar(state: ServerState, body):
    """A maker of matchers for ``response_format`` or a forced ``tool_choice`` (None: free
    text); 400 naming the field when it cannot be honoured."""
    rf = body.response_format
    forced = None
    if tools_on(body):
        try:
            TOOLS.check_template(getattr(state.tokenizer, "chat_template", None))
            forced = TOOLS.forced_grammar([t.model_dump() for t in body.tools],
                                          getattr(body.tool_choice, "model_dump", lambda: body.tool_choice)())  # fmt: skip
        except TOOLS.ToolError as e:
            raise ApiError(400, str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
    elif getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if forced is None and (rf is None or rf.type == "text"):
        return None
    param = "tool_choice" if forced is not None else "response_format"
    if forced is not None and rf is not None and rf.type != "text":
        raise ApiError(400, "a forced tool_choice and a response_format cannot go together", param="response_format")
    if state.tokenizer is None:
        raise ApiError(400, f"{param} needs a model with a tokenizer", param=param)
    try:
        with state.lock:
            if state.grammars is None:
                state.grammars = Grammars(state.tokenizer, state.vocab or len(state.tokenizer), state.eos)
        if forced is not None:
            g = state.grammars.compile_lark(forced)
        else:
            fmt = {"type": rf.type}
            if rf.json_schema is not None:
                fmt["json_schema"] = {"schema": rf.json_schema.schema_}
            g = state.grammars.compile(fmt)
    except GrammarError as e:
        raise ApiError(400, str(e), param="tools" if forced is not None else param) from None
    engine = state.grammars
    return lambda: engine.matcher(g)
