"""``treeattn serve``: an OpenAI-compatible server over ranks whose KV cache stays sharded
between requests. ``engine`` (the rank loop, through :class:`treeattn.runtime.Session` only) knows
nothing of HTTP; ``api`` (FastAPI, rank 0) knows nothing of ranks. Needs the ``[serve]`` extra."""
