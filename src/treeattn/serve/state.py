"""What the HTTP layer shares with rank 0's engine thread (:class:`ServerState`)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ServerState"]


@dataclass
class ServerState:
    """What the HTTP layer shares with rank 0's engine thread."""

    model_name: str
    tokenizer: Any
    max_positions: int
    vocab: int | None  # the model's vocab_size: prompt token ids lie in [0, vocab)
    per_rank: Any  # tokens -> KV tokens per rank (Engine.per_rank)
    cache_tokens: int
    max_queue: int
    eos: list[int]
    stats: dict
    requests: queue.Queue = field(default_factory=queue.Queue)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # CORS: origins browsers may call from (none: no CORS headers)
    defaults: dict = field(default_factory=dict)  # sampling fields a request leaves out -> the model's value
    failed: str | None = None  # why the ranks are gone (503 from then on)
    grammars: Any = None  # the structured-output engine over the tokenizer (serve.grammar), made when first asked
    created: int = field(default_factory=lambda: int(time.time()))
    lock: threading.Lock = field(default_factory=threading.Lock)
