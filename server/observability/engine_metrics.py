"""What an engine reports of itself (the vllm engine: vLLM's own statistics), per worker,
and its ``trio_llm:*`` families. Sans-IO.

Example (the worker client feeds a report; ``/metrics`` reads it)::

    report = EngineReport()
    report.hello(info)                      # HELLO's info: "cache_config"
    report.pong(waiting, stats)             # a PONG's waiting count and map (wire.ENGINE_STATS)
    report.finished(note["times"])          # a request's vLLM times, from its note
    families = engine_families([("qwen", 0, report)])

Theory of operation
-------------------
Three ways in, each on a frame the worker already sends (docs/protocol.md):

- HELLO's ``cache_config`` (label values) becomes ``cache_config_info``, as vLLM's;
- each PONG's engine map holds the engine's gauges (KV-cache usage, deferred requests) and
  its *cumulative* counters (preemptions, the tokens-per-step histogram, a vision model's
  image-cache lookups and hits): they are exported
  as the worker's latest report, like vLLM's per-engine series, and start over with a new
  worker process (Prometheus' ``rate()`` reads that as a counter reset). A worker shared
  by several frontends reports the same engine to each: with ``--api-servers`` these
  families are merged by maximum, not summed (:data:`ENGINE_WIDE`);
- a request's ``times`` note (queue, prefill, decode, inference: vLLM's own clocks) is
  observed here into histograms, once per request (each note reaches one frontend, so
  these are summed like the frontend's own).

A worker that is down reports no gauges (its last report is dropped when its session ends);
its histograms and counters keep what they had.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from ..worker_protocol.wire import ITERATION_TOKEN_BUCKETS
from .histogram import Histogram

__all__ = ["ENGINE_REPORTED", "ENGINE_WIDE", "EngineReport", "engine_families"]

PREFIX = "trio_llm:"

#: vLLM's request phases: the ``times`` note's keys -> (metric name, help).
_TIMES = {
    "queue": ("request_engine_queue_time_seconds",
              "Time the request waited in the engine's scheduler queue (vLLM's "
              "request_queue_time_seconds), in seconds."),
    "prefill": ("request_prefill_time_seconds",
                "Time from the engine scheduling the request to its first token (vLLM's "
                "prefill phase), in seconds."),
    "decode": ("request_decode_time_seconds",
               "Time from the request's first token to its last, in the engine, in seconds."),
    "inference": ("request_inference_time_seconds",
                  "Time from the engine scheduling the request to its last token (prefill "
                  "and decode), in seconds."),
}

#: A vision model's counters (vLLM's names): PONG map key -> help.
_IMAGE_COUNTERS = {
    "mm_cache_queries": "Images looked up in the engine's cache of processed images, since "
                        "the worker started.",
    "mm_cache_hits": "Images found in the engine's cache of processed images (not decoded "
                     "or processed again), since the worker started.",
}

#: vLLM's request-latency bounds, with finer steps below 0.3 s (a small model's prefill).
TIME_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5,
    5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)

#: Every family this module exports: only a worker whose engine reports them has them
#: (the vllm engine; not sim or transformers).
ENGINE_REPORTED = frozenset({
    PREFIX + "kv_cache_usage_perc", PREFIX + "num_requests_waiting_by_reason",
    PREFIX + "num_preemptions", PREFIX + "iteration_tokens_total",
    PREFIX + "cache_config_info", *(PREFIX + name for name, _ in _TIMES.values()),
    PREFIX + "mm_cache_queries", PREFIX + "mm_cache_hits",
})

#: Families whose samples are the same engine's counts as every frontend heard them:
#: merged over frontends by maximum (server.observability.merge), never summed.
ENGINE_WIDE = frozenset({PREFIX + "num_preemptions", PREFIX + "iteration_tokens_total",
                         PREFIX + "mm_cache_queries", PREFIX + "mm_cache_hits"})


class EngineReport:
    """One worker's engine statistics (see the module docstring). Touch it from the Trio
    thread only."""

    __slots__ = ("times", "latest", "waiting", "cache_config")

    def __init__(self) -> None:
        self.times = {key: Histogram(TIME_BUCKETS) for key in _TIMES}
        #: The latest PONG's engine map (None: no report, or the worker is down).
        self.latest: dict | None = None
        #: The requests waiting in that PONG (deferred ones included).
        self.waiting = 0
        #: HELLO's ``cache_config`` (label name -> value), if the engine sends one.
        self.cache_config: dict | None = None

    def hello(self, info: dict) -> None:
        config = info.get("cache_config")
        self.cache_config = config if isinstance(config, dict) else None
        self.latest = None

    def pong(self, waiting: int, stats: dict | None) -> None:
        self.waiting = waiting
        self.latest = stats

    def finished(self, times: dict) -> None:
        """A request's engine times (a checked ``times`` note: every key, seconds)."""
        for key, hist in self.times.items():
            hist.observe(times[key])

    def down(self) -> None:
        """The worker's session ended: its gauges are no longer true."""
        self.latest = None


def engine_families(
    reports: Iterable[tuple[str, int, EngineReport]],
) -> Iterator[Metric]:
    """The engine-reported families of every worker that has reported anything (an engine
    that reports nothing, such as sim, adds no family): ``reports`` holds (model name,
    worker index, report) triples, every model's workers in one family each."""
    reports = list(reports)
    labels = ["model_name", "worker"]
    usage = GaugeMetricFamily(
        PREFIX + "kv_cache_usage_perc",
        "Fraction of the engine's KV-cache blocks in use (1 = full), its latest report.",
        labels=labels)
    waiting = GaugeMetricFamily(
        PREFIX + "num_requests_waiting_by_reason",
        "Requests waiting in the engine, by reason: capacity (for a batch slot), deferred "
        "(for something else, such as a grammar to compile).",
        labels=[*labels, "reason"])
    preemptions = CounterMetricFamily(
        PREFIX + "num_preemptions",
        "Requests the engine preempted (its KV cache full) since the worker started.",
        labels=labels)
    steps = HistogramMetricFamily(
        PREFIX + "iteration_tokens_total",
        "Tokens processed per engine step (prompt tokens computed plus tokens generated), "
        "since the worker started.",
        labels=labels)
    images = {key: CounterMetricFamily(PREFIX + key, about, labels=labels)
              for key, about in _IMAGE_COUNTERS.items()}
    bounds = [floatToGoString(b) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
    infos = []
    for model, index, report in reports:
        worker = [model, str(index)]
        stats = report.latest
        if stats is not None:
            if "kv_cache_usage" in stats:
                usage.add_metric(worker, stats["kv_cache_usage"])
            if "deferred" in stats:
                deferred = stats["deferred"]
                waiting.add_metric([*worker, "capacity"], max(report.waiting - deferred, 0))
                waiting.add_metric([*worker, "deferred"], deferred)
            if "preemptions" in stats:
                preemptions.add_metric(worker, stats["preemptions"])
            counts = stats.get("iteration_tokens")
            if counts is not None:
                cumulative, total = [], 0
                for bound, n in zip(bounds, counts):
                    total += n
                    cumulative.append((bound, total))
                steps.add_metric(worker, cumulative, counts[-1])
            for key, counter in images.items():
                if key in stats:
                    counter.add_metric(worker, stats[key])
        if report.cache_config:
            infos.append((worker, report.cache_config))
    if any(r.latest is not None for _, _, r in reports):
        yield from (usage, waiting, preemptions, steps)
    yield from (counter for counter in images.values() if counter.samples)  # (vision models)
    if infos:
        names = sorted({name for _, config in infos for name in config})
        info = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "The engine's KV-cache configuration, as labels (the value is 1).",
            labels=[*labels, *names])
        for worker, config in infos:
            info.add_metric([*worker, *(str(config.get(n, "")) for n in names)], 1)
        yield info
    for key, (name, doc) in _TIMES.items():
        if any(r.times[key].count for _, _, r in reports):
            family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            for model, index, report in reports:
                hist = report.times[key]
                family.add_metric([model, str(index)], hist.buckets(), hist.sum)
            yield family
