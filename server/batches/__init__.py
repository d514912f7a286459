"""The Batch API's engine room (docs/batches.md): the shapes of ``/v1/batches``
(:mod:`.objects`), a line run through the app as its HTTP request (:mod:`.calls`), the
runner that claims and runs stored batches (:mod:`.runner`) and the app's service that
starts it (:mod:`.service`). The routes are :mod:`server.http.batches`."""

from .runner import BatchRunner, BatchStatistics
from .service import BatchService

__all__ = ["BatchRunner", "BatchService", "BatchStatistics"]
