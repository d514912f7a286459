"""ORCA load reports on generation responses, as vLLM sends them (sans-IO).

A load balancer that speaks ORCA (Envoy, gateway-api-inference-extension) asks for a report
with the request header ``endpoint-load-metrics-format: TEXT`` (or ``JSON``) and reads the
response header ``endpoint-load-metrics``::

    endpoint-load-metrics: TEXT named_metrics.num_requests_waiting=0.0, ...
    endpoint-load-metrics: JSON {"named_metrics": {"num_requests_waiting": 0.0, ...}}

Without the request header nothing is added (and nothing is computed). Any other format is
the client's fault: a 400 naming the header, instead of a report silently left out.

The figures are the engine's statistics at the time the response starts: requests waiting
and running in the workers (from their latest heartbeat answers), and, where the engine
reports it (the vllm engine), the KV cache's usage as a fraction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..errors import ClientError

__all__ = ["REQUEST_HEADER", "RESPONSE_HEADER", "load_report", "named_metrics"]

REQUEST_HEADER = b"endpoint-load-metrics-format"
RESPONSE_HEADER = b"endpoint-load-metrics"


def named_metrics(stats: list, kv_cache_usage: Sequence[float] = ()) -> dict[str, float]:
    """The report's metrics from the :class:`~server.manager.engine.EngineStatistics` of
    each engine (each model's pool): their sums; and the fullest of the workers' KV caches
    (``kv_cache_usage``: each worker's latest report, where its engine reports one)."""
    live = [w for s in stats for w in s.workers if w.alive]
    metrics = {
        "num_requests_waiting": float(sum(w.waiting for w in live)),
        "num_requests_running": float(sum(w.running for w in live)),
    }
    if kv_cache_usage:
        metrics["kv_cache_usage_perc"] = float(max(kv_cache_usage))
    return metrics


def load_report(fmt: bytes, metrics: dict[str, float]) -> tuple[bytes, bytes]:
    """The response header for a request that sent ``endpoint-load-metrics-format: fmt``;
    raises :class:`ClientError` (400) for a format other than TEXT or JSON."""
    kind = fmt.strip().lower()
    if kind == b"text":
        value = "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics.items())
    elif kind == b"json":
        value = "JSON " + json.dumps({"named_metrics": metrics}, separators=(",", ":"))
    else:
        raise ClientError(
            "The 'endpoint-load-metrics-format' header must be TEXT or JSON (an ORCA load "
            "report), not " + repr(fmt.decode("latin-1")[:32]) + ".",
            param="endpoint-load-metrics-format",
        )
    return RESPONSE_HEADER, value.encode("ascii")
