"""OpenTelemetry traces: a span per generation request, made from its record when it ends.

Example::

    tracing = Tracing.from_endpoint("http://otel-collector:4318/v1/traces")   # OTLP/HTTP
    tracing.export(record, "my-model", traceparent=b"00-4bf9...-01")   # after the request

Off unless asked (``--otlp-traces-endpoint``, or a ``tracer_provider`` given to
``create_app``); then nothing of this module runs: the app tests one attribute per request.
When on, the span is built once the request has ended, from its
:class:`~server.observability.record.RequestRecord` with the recorded times (arrival,
dispatch, acceptance by the engine, first token, end): nothing is added to the stream's
path, and a request that never reaches the engine still gets its span. Its parent is the
W3C ``traceparent`` the client sent, if any.

Span ``llm_request`` (kind SERVER), attributes in OpenTelemetry's GenAI conventions where
they exist: ``gen_ai.request.id``, ``gen_ai.request.model`` (the served model),
``gen_ai.usage.input_tokens`` / ``output_tokens``, ``gen_ai.response.finish_reasons``,
``http.route``, ``http.response.status_code``, ``trio_llm.stream``, ``trio_llm.choices``,
``trio_llm.abort_cause``; events ``queued`` (dispatched to a worker), ``accepted`` (the
engine took it), ``first_token``, and ``finished`` or ``aborted``. A failed request has
status ERROR with its error's message.

Needs the ``otel`` extra (opentelemetry-sdk and the OTLP HTTP exporter).
"""

from __future__ import annotations

from .record import RequestRecord

__all__ = ["Tracing"]


class Tracing:
    """Exports a span per request through an OpenTelemetry tracer provider."""

    def __init__(self, tracer_provider) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer_provider.get_tracer("trio-llm-server")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)
        self._status = Status
        self._code = StatusCode

    @classmethod
    def from_endpoint(cls, endpoint: str) -> Tracing:
        """Spans sent in batches to an OTLP/HTTP collector at ``endpoint``."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise RuntimeError(
                f"--otlp-traces-endpoint needs OpenTelemetry ({exc}); install it with "
                "pip install -e '.[otel]'"
            ) from None
        provider = TracerProvider(resource=Resource.create({"service.name": "trio-llm-server"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    def export(
        self, record: RequestRecord, model: str, traceparent: bytes | None = None
    ) -> None:
        """Make and end the span of a request that has ended (plain ``def``: the SDK's batch
        processor queues it; its exporter sends from its own thread)."""
        parent = None
        if traceparent:
            carrier = {"traceparent": traceparent.decode("latin-1")}
            parent = self._propagator.extract(carrier)

        def ns(t: float | None) -> int | None:
            if t is None:
                return None
            return int((record.arrival_wall + (t - record.arrival)) * 1e9)

        start = ns(record.arrival)
        span = self._tracer.start_span(
            "llm_request", context=parent, kind=self._kind, start_time=start
        )
        attributes = {
            "gen_ai.request.id": record.request_id,
            "gen_ai.request.model": model,
            "http.route": record.route,
            "trio_llm.choices": record.choices,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
        }
        if record.status is not None:
            attributes["http.response.status_code"] = record.status
        if record.stream is not None:
            attributes["trio_llm.stream"] = record.stream
        reasons = [r for r in record.finish_reasons if r is not None]
        if reasons:
            attributes["gen_ai.response.finish_reasons"] = reasons
        if record.abort_cause is not None:
            attributes["trio_llm.abort_cause"] = record.abort_cause
        span.set_attributes(attributes)
        for name, t in (("queued", record.dispatch), ("accepted", record.accepted),
                        ("first_token", record.first_token)):
            if t is not None:
                span.add_event(name, timestamp=ns(t))
        end = ns(record.finish)
        span.add_event("aborted" if record.abort_cause else "finished", timestamp=end)
        if record.error is not None:
            span.set_status(self._status(self._code.ERROR, record.error[3][:200]))
        span.end(end_time=end)
