"""The Batch API's ``trio_llm:batch*`` metrics (server.batches): a prometheus-client
collector that reads the batch runner's ``statistics()`` at scrape time, registered beside
the request metrics in the app's registry. No series while no runner runs (before the
state store opens, after the runner stopped, or without a store).

``trio_llm:batches`` is the store's batches in each active status, every frontend's, as
this frontend's runner last looked (every 2 s): a batch waiting to be claimed is
``validating``. With ``--api-servers`` each frontend's sample is labelled with it
(server.observability.merge), all telling the same store: read one, not their sum. The
other gauges and the counters are this frontend's own, summed over the frontends: the
batches it runs, those it ended by final status, and its lines by outcome.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .state_metrics import PREFIX, one_sample

__all__ = ["BatchCollector"]


class BatchCollector:
    """``statistics`` returns a :class:`server.batches.BatchStatistics`, or None while no
    runner runs. Labelled as the state store's (the first model's ``model_name``)."""

    def __init__(self, statistics: Callable[[], Any], model_name: str) -> None:
        self._statistics = statistics
        self._labels = [model_name]

    def describe(self) -> list[Metric]:
        return []  # (registered before the runner starts)

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        if stats is None:
            return
        active = GaugeMetricFamily(
            PREFIX + "batches", "Batches in each active status in the state store (every "
            "frontend's), as of this frontend's last look.", labels=["model_name", "status"])
        for status, count in stats.active.items():
            active.add_metric([*self._labels, status], count)
        yield active
        ended = CounterMetricFamily(
            PREFIX + "batches_ended", "Batches this frontend brought to a final status.",
            labels=["model_name", "status"])
        for status, count in stats.ended.items():
            ended.add_metric([*self._labels, status], count)
        yield ended
        for kind, name, doc, value in (
            (GaugeMetricFamily, "batches_running", "Batches this frontend runs now.",
             stats.batches),
            (GaugeMetricFamily, "batch_lines_in_flight",
             "Batch lines this frontend runs now (at most --batch-concurrency).",
             stats.lines_in_flight),
            (CounterMetricFamily, "batch_lines_completed",
             "Batch lines answered 2xx (the output file's) on this frontend.",
             stats.lines_completed),
            (CounterMetricFamily, "batch_lines_failed",
             "Batch lines answered otherwise (the error file's) on this frontend.",
             stats.lines_failed),
            (CounterMetricFamily, "batch_lines_retried",
             "Batch line calls answered 503 (an admission limit, a drain, no worker): "
             "run again later, not failed.", stats.lines_retried),
        ):
            yield one_sample(kind, name, doc, self._labels, value)
