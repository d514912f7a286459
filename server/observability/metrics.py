"""The ``trio_llm:*`` Prometheus metrics: recorded without locks, exposed at scrape time.

Usage (the app does this; ``GET /metrics`` serves :meth:`Metrics.exposition`)::

    metrics = Metrics(lambda: [("sim", app.engine)])
    metrics.observe(record)              # once per request, at its end
    observe_itl = metrics.itl.observe    # per write of new tokens, from the request's writer
    body, content_type = metrics.exposition(accept_header)

Several models: ``Metrics(pools, more_models=["large"])``; ``metrics.of("large")`` is that
model's :class:`RequestMetrics` (``metrics`` itself is the first model's), and every family
has a sample per model (its ``model_name`` label).

Theory of operation
-------------------
Everything here runs on the Trio thread, so the values are plain ints, floats and lists: an
observation is a ``bisect`` and two additions, with no lock (prometheus-client's own metric
objects take a lock per ``inc``/``observe``, made for threaded servers). Nothing is recorded
per token: a request is recorded once at its end (:meth:`Metrics.observe`), and inter-token
latency once per write of the request's writer (one write carries every token that arrived
since the previous one).

:class:`Metrics` is a prometheus-client *collector* registered in its own
:class:`~prometheus_client.CollectorRegistry` (one per app, so several apps in one process
do not collide). At scrape time :meth:`Metrics.collect` turns the values into metric
families, and reads the gauges that describe the engine (requests running and waiting per
worker, workers alive, restarts) from ``engine.statistics()``: nothing is kept up to date
for them between scrapes. The families about connections are the server's, not a
model's: their ``model_name`` is the first model's.

Names follow vLLM's (``vllm:`` -> ``trio_llm:``); see docs/metrics.md for each metric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from typing import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder

from .engine_metrics import engine_families
from .gcstats import gc_stats
from .histogram import Histogram
from .record import ABORT_CAUSES, FINISHED_REASONS, RequestRecord

if TYPE_CHECKING:
    from ..manager.engine import Engine

__all__ = ["Metrics", "RequestMetrics", "Histogram", "PREFIX"]

PREFIX = "trio_llm:"

#: Bucket upper bounds, in seconds (vLLM's, with finer steps below 10 ms for fast engines).
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
QUEUE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
#: Tokens per request: 1, 2, 5, 10, 20, 50, ... 1,000,000.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
#: Samples per prompt (vLLM's bounds).
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


_HISTOGRAMS = (
    # attribute, name, help
    ("ttft", "time_to_first_token_seconds",
     "Time from the request's arrival to its first output token, in seconds."),
    ("itl", "inter_token_latency_seconds",
     "Time between consecutive writes of new tokens to a request's response, in seconds."),
    ("e2e", "e2e_request_latency_seconds",
     "Time from the request's arrival to the end of its response, in seconds."),
    ("queue", "request_queue_time_seconds",
     "Time from the request's arrival to the first engine step that reported it (accepted "
     "into the engine's scheduler), in seconds."),
    ("prompt_tokens", "request_prompt_tokens", "Prompt tokens per request."),
    ("generation_tokens", "request_generation_tokens", "Generated tokens per request."),
    ("params_n", "request_params_n", "The n (samples per prompt) of each request."),
    ("params_max_tokens", "request_params_max_tokens",
     "The max_tokens of each request that set one."),
)


class RequestMetrics:
    """One model's request metrics (recorded once per request, at its end)."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(QUEUE_BUCKETS)
        self.prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.generation_tokens = Histogram(TOKEN_BUCKETS)
        self.params_n = Histogram(N_BUCKETS)
        self.params_max_tokens = Histogram(TOKEN_BUCKETS)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)
        self.aborts = dict.fromkeys(ABORT_CAUSES, 0)
        self.rejections: dict[int, int] = {}
        self.client_disconnects = 0

    def observe(self, r: RequestRecord) -> None:
        """Record one generation request at its end (whatever the outcome)."""
        if r.client_disconnected:
            self.client_disconnects += 1
        reason = r.finish_reason
        if reason is None or r.rejected:
            # Never ran on the engine (or the engine refused it as the client's fault).
            status = r.status
            if status is not None and status >= 400:
                self.rejections[status] = self.rejections.get(status, 0) + 1
            return
        self.finished[reason] += 1
        if r.abort_cause is not None:
            self.aborts[r.abort_cause] += 1
        self.prompt_tokens_total += r.prompt_tokens
        self.generation_tokens_total += r.completion_tokens
        self.prompt_tokens.observe(r.prompt_tokens)
        self.generation_tokens.observe(r.completion_tokens)
        self.params_n.observe(r.n)
        if r.max_tokens is not None:
            self.params_max_tokens.observe(r.max_tokens)
        arrival = r.arrival
        if r.finish is not None:
            self.e2e.observe(r.finish - arrival)
        if r.accepted is not None:
            self.queue.observe(max(r.accepted - arrival, 0.0))
        if r.first_token is not None:
            self.ttft.observe(r.first_token - arrival)


class Metrics(RequestMetrics):
    """The server's metrics; see the module docstring. Touch it only from the Trio thread.

    ``pools`` returns each served model's name (the ``model_name`` label, as in vLLM) and
    its running engine or None (starting, stopped), the first model first: this object's
    own request metrics are that model's; ``more_models`` names the others, whose request
    metrics are ``of(name)``.
    """

    def __init__(
        self,
        pools: Callable[[], Sequence[tuple[str, Engine | None]]],
        *,
        more_models: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
        process_metrics: bool = True,
    ) -> None:
        super().__init__()
        self._pools = pools
        self._more = {name: RequestMetrics() for name in more_models}
        #: The HTTP server's connection pool (``statistics()``), once it is serving.
        self._connections = None
        #: Whether the server serves through hypercorn's public serve() (set by serve();
        #: None: not serving, no series).
        self.http_fallback: bool | None = None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.registry.register(self)
        self._gc_watched = False
        if process_metrics:
            ProcessCollector(registry=self.registry)

    def watch_gc(self) -> None:
        """Also expose the collector's pauses (``python_gc_*``). Asked for, never by default:
        it installs a ``gc.callbacks`` entry for the rest of the process
        (:mod:`server.observability.gcstats`). ``serve(gc_metrics=True)`` calls this; the
        CLI does."""
        if not self._gc_watched:
            self._gc_watched = True
            self.registry.register(gc_stats())

    def watch_connections(self, pool) -> None:
        """Report ``pool.statistics()`` (a :class:`server.connections.accept.ConnectionPool`)."""
        self._connections = pool

    def of(self, model: str | None) -> RequestMetrics:
        """The request metrics of ``model`` (the first model's, this object, for None or a
        name no other model has: a request refused before its model was known)."""
        return self._more.get(model, self) if model is not None else self

    # -- exposition --------------------------------------------------------------------------

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The body and content type of a scrape (text format, or OpenMetrics if asked)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def local_exposition(self) -> bytes:
        """This process's metrics in the text format (what a peer frontend merges)."""
        return self.exposition()[0]

    def collect(self) -> Iterator[Metric]:
        """Called by the registry at scrape time."""
        pools = list(self._pools())
        models = [(name, self.of(name) if i else self) for i, (name, _) in enumerate(pools)]
        labels = ["model_name"]
        for attr, name, doc in _HISTOGRAMS:
            family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            for model, values in models:
                hist: Histogram = getattr(values, attr)
                family.add_metric([model], hist.buckets(), hist.sum)
            yield family
        yield _counter("prompt_tokens", "Prompt tokens of requests that ran on the engine.",
                       labels, [([m], v.prompt_tokens_total) for m, v in models])
        yield _counter("generation_tokens", "Tokens generated for requests (sent or not).",
                       labels, [([m], v.generation_tokens_total) for m, v in models])
        yield _counter(
            "request_success",
            "Requests that ran on the engine, by how they ended (the worst of their choices).",
            ["model_name", "finished_reason"],
            [([m, k], n) for m, v in models for k, n in v.finished.items()],
        )
        yield _counter(
            "request_aborts",
            "Requests whose work was given up, by cause.",
            ["model_name", "cause"],
            [([m, k], n) for m, v in models for k, n in v.aborts.items()],
        )
        yield _counter(
            "request_rejections",
            "Generation requests answered with an error status without running on the "
            "engine (invalid, unauthorized, overloaded, ...), by status.",
            ["model_name", "status"],
            [([m, str(k)], n) for m, v in models for k, n in sorted(v.rejections.items())],
        )
        yield _counter(
            "client_disconnects",
            "Generation requests whose client went away before the response ended.",
            labels, [([m], v.client_disconnects) for m, v in models],
        )
        yield from self._engine_families(pools)
        yield from self._connection_families(pools[0][0])
        if self.http_fallback is not None:  # (labelled as the connections' families are)
            gauge = GaugeMetricFamily(
                PREFIX + "http_fallback",
                "1 while HTTP is served through hypercorn's public serve() "
                "(--allow-http-fallback, or TRIO_LLM_HTTP_FALLBACK): no connection limit, "
                "bounded writes or request-head checks; 0 on the server's own HTTP path.",
                labels=["model_name"])
            gauge.add_metric([pools[0][0]], float(self.http_fallback))
            yield gauge

    def _connection_families(self, model: str) -> Iterator[Metric]:
        pool = self._connections
        if pool is None:
            return
        stats = pool.statistics()
        labels, values = ["model_name"], [model]
        for name, doc, value in (
            ("connections_open", "Open client connections.", stats.open),
            ("connections_idle", "Open client connections between requests (keep-alive).",
             stats.idle),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, value in (
            ("connections_accepted", "Client connections accepted.", stats.accepted),
            ("connections_refused",
             "Connections answered 503 and closed at once: the connection limit was reached "
             "and no idle connection could make room.", stats.refused),
            ("connections_reaped",
             "Idle keep-alive connections closed early to make room for a new connection.",
             stats.reaped_idle),
            ("connection_errors",
             "Connections ended by an unexpected error in the HTTP layer (each also logged); "
             "the server goes on.", stats.errors),
            ("descriptor_exhaustions",
             "Episodes in which connections could not be accepted for want of file "
             "descriptors.", stats.descriptor_exhaustions),
        ):
            yield _counter(name, doc, labels, [(values, value)])

    def _engine_families(self, pools: list[tuple[str, Engine | None]]) -> Iterator[Metric]:
        stats = [(model, engine.statistics()) for model, engine in pools if engine is not None]
        labels = ["model_name"]
        per_worker = ["model_name", "worker"]
        running = GaugeMetricFamily(
            PREFIX + "num_requests_running",
            "Requests running in each engine worker (its latest heartbeat answer).",
            labels=per_worker,
        )
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting",
            "Requests waiting in each engine worker's queue (its latest heartbeat answer).",
            labels=per_worker,
        )
        for model, s in stats:
            for w in s.workers:
                running.add_metric([model, str(w.index)], w.running if w.alive else 0)
                waiting.add_metric([model, str(w.index)], w.waiting if w.alive else 0)
        yield running
        yield waiting
        yield _counter(
            "worker_restarts",
            "Engine worker processes restarted after a failure, per worker.",
            per_worker,
            [([model, str(w.index)], w.restarts) for model, s in stats for w in s.workers],
        )
        running_now = dict(stats)
        alive = GaugeMetricFamily(
            PREFIX + "workers_alive", "Engine worker processes up and serving.", labels=labels
        )
        configured = GaugeMetricFamily(
            PREFIX + "workers",
            "Engine workers of the pool (spawned or remote), up or not: workers_alive below "
            "it is a degraded pool.", labels=labels,
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "num_requests_in_flight",
            "Generation requests dispatched to the engine whose streams are still open.",
            labels=labels,
        )
        for model, _ in pools:
            now = running_now.get(model)
            alive.add_metric([model], now.workers_alive if now is not None else 0)
            configured.add_metric([model], sum(not w.retired for w in now.workers)
                                  if now is not None else 0)
            in_flight.add_metric([model], now.open_streams if now is not None else 0)
        yield alive
        yield configured
        yield in_flight
        yield from _kv_families(pools)
        routed = [(model, s.routing) for model, s in stats if s.routing is not None]
        if routed:
            yield from _routing_families(routed)
        migrated = [(model, s.migration) for model, s in stats if s.migration is not None]
        if migrated:
            yield from _migration_families(migrated)
        discovered = [(model, name, w) for model, s in stats for name, w in s.discovery]
        if discovered:
            yield from _discovery_families(discovered)
        yield from engine_families(
            (model, w.index, w.report) for model, engine in pools if engine is not None
            for w in engine.workers if w.report is not None)


def _kv_families(pools: list) -> Iterator[Metric]:
    """What the frontend knows of each worker's KV cache from its KV events
    (server.manager.kv_index): only workers that send them."""
    workers = [(model, w) for model, engine in pools if engine is not None
               for w in engine.workers if any(w.kv_events) or w.kv_index is not None]
    if not workers:
        return
    blocks = GaugeMetricFamily(
        PREFIX + "kv_cache_blocks_known",
        "Blocks the worker's KV cache holds, as its KV events told this frontend (0 while "
        "it is down).", labels=["model_name", "worker"])
    for model, w in workers:
        blocks.add_metric([model, str(w.index)], len(w.kv_index) if w.kv_index else 0)
    yield blocks
    yield _counter(
        "kv_events",
        "KV events received from each worker, by event: stored, removed (lists of blocks), "
        "cleared (its cache was reset, or events were lost).",
        ["model_name", "worker", "event"],
        [([model, str(w.index), event], n) for model, w in workers
         for event, n in zip(("stored", "removed", "cleared"), w.kv_events)])


def _discovery_families(discovered: list) -> Iterator[Metric]:
    """Each DNS name's resolutions (server.discovery.watch): ``discovered`` holds (model
    name, the name as given, WatchStatistics)."""
    labels = ["model_name", "name"]
    for metric, doc in (
            ("dns_resolutions", "Resolutions of a DNS-named worker address that answered."),
            ("dns_resolution_failures", "Resolutions that failed (no answer, SERVFAIL, "
             "NXDOMAIN): the last known workers were kept."),
            ("dns_changes", "Answers that changed the name's set of workers.")):
        field = metric.removeprefix("dns_").replace("resolution_", "")
        yield _counter(metric, doc, labels, [([model, name], getattr(w, field))
                                             for model, name, w in discovered])
    addresses = GaugeMetricFamily(PREFIX + "dns_addresses", "Workers the name's last answer "
                                  "gave.", labels=labels)
    for model, name, w in discovered:
        addresses.add_metric([model, name], w.addresses)
    yield addresses


def _migration_families(migrated: list) -> Iterator[Metric]:
    """Sequences moved off a dead worker, and those that could not be
    (server.manager.migration), per model: ``migrated`` holds (model name,
    MigrationStatistics) pairs."""
    yield _counter(
        "migrations",
        "Sequences moved to another worker when theirs ended, by cause: exited (the process "
        "died), disconnected (a listening worker's connection ended), hung, protocol_error, "
        "removed (its address left DNS discovery), left (the worker said it was stopping).",
        ["model_name", "cause"],
        [([model, cause], n) for model, m in migrated for cause, n in m.migrations.items()],
    )
    yield _counter(
        "migrations_failed",
        "Sequences of a dead worker that could not be moved (their stream ends with an error "
        "event), by reason: limit (--max-migrations), not_resumable (the engine did not say "
        "its tokens, or none can resume), no_worker.",
        ["model_name", "reason"],
        [([model, reason], n) for model, m in migrated for reason, n in m.failed.items()],
    )


def _routing_families(routed: list) -> Iterator[Metric]:
    """Routing decisions and per-worker prefix-cache hits (server.manager.routing), per
    model: ``routed`` holds (model name, RouterStatistics) pairs."""
    yield _counter(
        "routing_decisions",
        "Requests routed, by reason: prefix (to the worker predicted to hold most of the "
        "prompt), load (no worker held any of it, or routing by load), balance (the best "
        "match was too loaded).",
        ["model_name", "reason"],
        [([model, reason], n) for model, routing in routed
         for reason, n in routing.decisions.items()],
    )
    per_worker = ["model_name", "worker"]
    for name, doc, field in (
        ("routed_requests", "Requests routed to each worker.", "routed"),
        ("prefix_cache_queries",
         "Prompt tokens of the results that reported their cached prompt tokens, per worker.",
         "prompt_tokens"),
        ("prefix_cache_hits",
         "Prompt tokens the worker found in its prefix cache (usage's cached_tokens).",
         "cached_tokens"),
        ("routing_mispredictions",
         "Results whose cached prefix fell short of the router's prediction (the router "
         "then forgets that many of the worker's oldest blocks).",
         "mispredicted"),
        ("routing_notices",
         "Routed notices received from each shared worker: prompts another frontend sent "
         "it, added to this frontend's prediction.",
         "notices"),
    ):
        yield _counter(name, doc, per_worker,
                       [([model, str(i)], v) for model, routing in routed
                        for i, v in enumerate(getattr(routing, field))])


def _counter(name: str, doc: str, labels: list[str], samples) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family
