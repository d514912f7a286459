"""The sans-IO OpenAI layer: request schemas and validation, field tables, tool calls and
their parsers, reasoning splits, logprobs, and the bytes of every answer and event. No I/O,
no Trio: the ASGI app (:mod:`server.http`) and the benchmarks call it."""
