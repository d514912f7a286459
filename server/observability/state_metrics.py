"""The state store's ``trio_llm:state_*`` metrics (server.state): a prometheus-client
collector that reads ``statistics()`` at scrape time, registered beside the request metrics
in the app's registry.

The gauges (records, bytes) are the whole store's, every frontend's, as this frontend last
read them (after each of its writes and sweeps); with ``--api-servers`` each frontend's
sample is labelled with it (server.observability.merge). The counters are what this
process removed or refused, summed over the frontends: records deleted past their
retention (by the sweep, or to make room for a write), their bytes, the writes refused
because the store or the owner's quota was full, and the batch creates refused because the
owner's unfinished batches were at ``--max-batches-per-key``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["StateStoreCollector", "one_sample"]

PREFIX = "trio_llm:"


class StateStoreCollector:
    """``statistics`` returns a :class:`server.state.StoreStatistics`, or None while the
    store is not open (then no series). The store is the server's, not a model's: its
    ``model_name`` is the first model's (as the connection families')."""

    def __init__(self, statistics: Callable[[], Any], model_name: str) -> None:
        self._statistics = statistics
        self._labels = [model_name]

    def describe(self) -> list[Metric]:
        return []  # (registered before the store opens: nothing to check names against)

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        if stats is None:
            return
        for kind, name, doc, value in (
            (GaugeMetricFamily, "state_records",
             "Records in the state store (stored responses, files, ...).", stats.records),
            (GaugeMetricFamily, "state_bytes",
             "Bytes of the state store's records and their events.", stats.bytes),
            (CounterMetricFamily, "state_expired_records",
             "Records deleted past their retention (--state-retention).", stats.expired),
            (CounterMetricFamily, "state_expired_bytes",
             "Bytes of the records deleted past their retention.", stats.expired_bytes),
            (CounterMetricFamily, "state_refused_writes",
             "Writes refused: the state store (--state-max-bytes) or the API key's quota "
             "(--state-max-bytes-per-key) was full.", stats.refused),
            (CounterMetricFamily, "state_refused_batches",
             "Batch creates refused: the API key's unfinished batches were at its quota "
             "(--max-batches-per-key).", stats.too_many),
        ):
            yield one_sample(kind, name, doc, self._labels, value)


def one_sample(kind: type, name: str, doc: str, labels: list[str], value: float) -> Metric:
    """A family of ``kind`` (a gauge or counter family) named ``trio_llm:<name>``, with one
    sample: ``value`` for ``labels`` (the model's name). The server-wide collectors' shape."""
    family = kind(PREFIX + name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family
