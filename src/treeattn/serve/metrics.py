"""``GET /metrics``: the server's Prometheus metrics (``prometheus_client``'s text format), named
as vLLM names its own with the ``treeattn:`` prefix, so a dashboard built for vLLM needs only
the prefix changed.

Histograms (seconds), observed on rank 0 as each request's events go out:

- ``time_to_first_token_seconds``: from the request's arrival to its first text;
- ``inter_token_latency_seconds``: a request's mean time between tokens after the first,
  observed once per such token (tokens arrive in bursts under speculation);
- ``request_queue_time_seconds``: from arrival to admission (the prompt's prefill starts);
- ``e2e_request_latency_seconds``: from arrival to the last token.

Read from the engine's counters at each scrape: ``num_requests_running``,
``num_requests_waiting``, ``kv_cache_usage_tokens`` (rank 0's K/V tokens held: cached prefixes
and the running rows), ``kv_cache_capacity_tokens`` (``--cache-tokens``; 0: unbounded),
``prompt_tokens_total``, ``generation_tokens_total``, and the prefix cache's
``prefix_cache_queries_total`` and ``prefix_cache_hits_total`` (prompt tokens looked up, and
those found cached: their ratio is the hit rate); ``request_success_total`` by
``finished_reason``. Each server has its own registry (nothing process-global).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "treeattn:"
_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0)  # fmt: skip


class _Engine:
    """A collector of what the engine counts, read at each scrape."""

    def __init__(self, state) -> None:
        self.state, self.running = state, 0  # admitted and not ended (as their events went out)

    def collect(self):
        st, s = self.state.stats, self.state
        for name, doc, value in (
            ("num_requests_running", "Requests running (admitted, not ended).", self.running),
            ("num_requests_waiting", "Requests waiting to be admitted (queued, taken off the queue, preempted).",
             s.requests.qsize() + s.stats.get("waiting", 0)),
            ("kv_cache_usage_tokens", "K/V tokens held on rank 0: cached prefixes and running rows.",
             st.get("kv_tokens_per_rank", 0)),
            ("kv_cache_capacity_tokens", "K/V tokens a rank may hold (--cache-tokens; 0: unbounded).",
             s.cache_tokens or 0),
        ):  # fmt: skip
            yield GaugeMetricFamily(P + name, doc, value=value)
        for name, doc, key in (
            ("prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens"),
            ("generation_tokens", "Tokens generated.", "completion_tokens"),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prompt_tokens"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "cached_tokens"),
        ):
            yield CounterMetricFamily(P + name, doc, value=st.get(key, 0))


class Metrics:
    """One server's metrics; :meth:`watch` a request before it is queued."""

    def __init__(self, state) -> None:
        self.registry = r = CollectorRegistry()
        r.register(engine := _Engine(state))
        self.engine = engine
        h = dict(buckets=_SECONDS, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to the first text.", **h)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Mean time between tokens after the first.", **h)
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to admission.", **h)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to the last token.", **h)
        self.done = Counter(P + "request_success", "Requests ended, by finish reason.", ["finished_reason"],
                            registry=r)  # fmt: skip

    def watch(self, job) -> None:
        """Wrap ``job.emit`` (set already) so that its events are observed as they go out."""
        emit, t0 = job.emit, time.monotonic()
        started, first = False, None  # admitted; when its first text went out

        def observe(kind: str, data) -> None:
            nonlocal started, first
            now = time.monotonic()
            if kind == "start":
                self.queue.observe(now - t0)
                self.engine.running += 1
                started = True
            elif kind == "text" and first is None:
                first = now
                self.ttft.observe(now - t0)
            elif kind in ("end", "error") and started:
                self.engine.running -= 1
                started = False
            if kind == "end":
                n = int(data.get("completion_tokens", 0))
                if first is not None and n > 1:
                    for _ in range(n - 1):
                        self.itl.observe((now - first) / (n - 1))
                self.e2e.observe(now - t0)
                self.done.labels(str(data.get("finish_reason"))).inc()
            emit(kind, data)

        job.emit = observe

    def render(self) -> bytes:
        return generate_latest(self.registry)
