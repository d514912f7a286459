"""What an operator sees of the server: request records, Prometheus metrics, logs.

* :mod:`.record` -- :class:`RequestRecord`, the lifecycle of one generation request (times,
  token counts, how it ended), filled in by the HTTP layer and read once at its end.
* :mod:`.metrics` -- :class:`Metrics`, the ``trio_llm:*`` families of ``GET /metrics``.
* :mod:`.logs` -- request ids (a contextvar stamped on every log line), the text and JSON
  log formats, and the one line logged per finished request.

See docs/metrics.md and docs/observability.md.
"""

from .logs import (
    JSONFormatter,
    RequestIdFilter,
    TextFormatter,
    configure_logging,
    current_request_id,
    log_handler,
    log_request,
    new_request_id,
    request_id_from_header,
)
from .metrics import Metrics
from .record import RequestRecord

__all__ = [
    "JSONFormatter",
    "Metrics",
    "RequestIdFilter",
    "RequestRecord",
    "TextFormatter",
    "configure_logging",
    "current_request_id",
    "log_handler",
    "log_request",
    "new_request_id",
    "request_id_from_header",
]
