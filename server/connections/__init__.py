"""The HTTP transport: the listener and its connection pool, hypercorn's connection and
HTTP/1.1 protocol scoped to this server, request-head checks, and direct writes of plain
text events. Serves the ASGI app (:mod:`server.http`)."""
