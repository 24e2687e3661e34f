"""vLLM's ``/tokenize`` and ``/detokenize`` on ``treeattn serve``'s tokenizer (rank 0 only:
nothing reaches the ranks)."""

from __future__ import annotations

from .schema import CHARS_PER_POSITION, ApiError, ChatRequest, DetokenizeRequest, TokenizeRequest, check_unknown


def add_token_routes(app, state, check_model) -> None:
    """The two routes on ``app`` (``check_model(name)``: the 404 for another model's name)."""
    from . import tools as TOOLS
    from .jobs import prompt_ids

    _model = check_model

    def _tokenizer():
        if state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return state.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's shapes: ``{"count", "max_model_len", "tokens"}``."""
        check_unknown(body)
        _model(body.model)
        tok = _tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise ApiError(400, "this model has no chat template", param="messages")
            chat = ChatRequest(model=state.model_name, messages=body.messages)
            ids = prompt_ids(state, chat)
            if not body.add_generation_prompt:  # the template's head of the assistant turn left out
                msgs = TOOLS.messages(body.messages)
                ids = list(tok.apply_chat_template(msgs, add_generation_prompt=False, return_dict=True)["input_ids"])
        else:
            limit = CHARS_PER_POSITION * state.max_positions
            if len(body.prompt) > limit:
                raise ApiError(400, f"the prompt has {len(body.prompt)} characters; this server takes at most {limit}",
                               param="prompt")  # fmt: skip
            ids = list(tok(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        return {"count": len(ids), "max_model_len": state.max_positions, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's shapes: ``{"prompt"}``."""
        check_unknown(body)
        _model(body.model)
        tok = _tokenizer()
        vocab = min((v for v in (state.vocab, len(tok)) if v), default=2**63)
        bad = next((i for i in body.tokens if i >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens must lie in [0, {vocab}), got {bad}", param="tokens")
        return {"prompt": tok.decode(body.tokens)}
