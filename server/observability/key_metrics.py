"""``trio_llm:api_key_file_reloads_total``: the re-reads of ``--api-key-file`` after a
change (server.http.key_files), by outcome. Read at scrape time, registered only where key
files are given.

``ok``: the keys in force are the files' new ones. ``refused``: a file was missing,
unreadable or no key file, and the keys in force stayed (its warning names the file and
the line). A refusal that lasts is a rotation that did not happen: alert on its increase.
With ``--api-servers`` the counts are summed over the frontends (each reloads on its own).
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from .state_metrics import PREFIX

__all__ = ["KeyFileCollector", "OUTCOMES"]

#: The ``outcome`` label's values.
OUTCOMES = ("ok", "refused")


class KeyFileCollector:
    """``reloads``: outcome -> count, updated in place by its owner. ``model_name`` is the
    first model's (the keys are the server's, as the connection families)."""

    def __init__(self, reloads: dict[str, int], model_name: str) -> None:
        self._reloads = reloads
        self._model = model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            PREFIX + "api_key_file_reloads",
            "Re-reads of --api-key-file after a change: ok (its keys in force) or refused "
            "(the keys in force stayed).", labels=["model_name", "outcome"])
        for outcome in OUTCOMES:
            family.add_metric([self._model, outcome], self._reloads[outcome])
        yield family
