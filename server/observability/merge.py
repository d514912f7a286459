"""One ``/metrics`` over several frontend processes (``--api-servers``): the text
expositions of every frontend merged into one set of metric families. Sans-IO.

The rule, by the type each family declares:

* **counters, histograms and summaries are summed** over the frontends, sample by sample
  (same name, same labels): requests, tokens, aborts, rejections, connections, the latency
  histograms, ``process_cpu_seconds_total`` (all frontends' CPU), garbage collections.
  Except the engine's own counters and histograms that a shared worker reports alike to
  every frontend (``ENGINE_WIDE``: preemptions, tokens per step): their maximum.
* **gauges (and untyped or info families) stay per process**, with a ``frontend`` label
  naming the frontend they came from: requests in flight, open connections, each worker's
  running and waiting counts as that frontend last heard them, memory, descriptors, and
  the ``*_created`` times of the counters (the text format makes them gauges).

A frontend that did not answer (restarting) is missing from the sums until it is back,
with its counters started over: the sums drop, which Prometheus' ``rate()`` reads as a
counter reset.

Example::

    families = merge_expositions({"0": text_of_frontend_0, "1": text_of_frontend_1})
    body = generate_latest(Families(families))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .engine_metrics import ENGINE_WIDE

__all__ = ["Families", "SUMMED_TYPES", "merge_expositions"]

#: The family types whose samples are summed over the frontends.
SUMMED_TYPES = frozenset({"counter", "histogram", "summary"})

#: The label that names the frontend of a per-process sample.
FRONTEND_LABEL = "frontend"


def merge_expositions(texts: Mapping[str, str]) -> list[Metric]:
    """The families of every text exposition in ``texts`` (frontend name -> text format),
    merged: summed or labelled per frontend (module docstring). The order is the order in
    which families and samples first appear."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, float]] = {}
    for frontend, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            if family.type in SUMMED_TYPES and merged.type in SUMMED_TYPES:
                acc = sums.setdefault(family.name, {})
                combine = max if family.name in ENGINE_WIDE else float.__add__
                for s in family.samples:
                    key = (s.name, tuple(s.labels.items()))
                    acc[key] = combine(acc.get(key, 0.0), float(s.value))
            else:
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, FRONTEND_LABEL: frontend}, s.value)
    for name, acc in sums.items():
        merged = families[name]
        for (sample, labels), value in acc.items():
            merged.add_sample(sample, dict(labels), value)
    return list(families.values())


class Families:
    """Families as a collector (what prometheus-client's encoders read)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
