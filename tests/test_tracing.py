"""OpenTelemetry traces (optional): a span per generation request, child of the client's
traceparent, with the request's events and attributes; nothing when tracing is off."""

from __future__ import annotations

import functools

import httpx
import pytest
import trio

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from server.config import EngineConfig, ServerConfig  # noqa: E402
from server.http.app import create_app  # noqa: E402
from server.http.serve import serve  # noqa: E402
from tests.conftest import FAST_SIM, wait_http_ok  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


async def test_a_span_per_request_with_the_clients_parent():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = ServerConfig(engine=EngineConfig(engine_options=dict(FAST_SIM)), port=0,
                          shutdown_timeout=0, close_timeout=0.2)
    app = create_app(config, tracer_provider=provider)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            shutdown = trio.Event()
            binds = await nursery.start(
                functools.partial(serve, config, app=app, shutdown_trigger=shutdown)
            )
            url = binds[0]
            await wait_http_ok(url + "/health")
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                r = await http.post(
                    "/v1/completions",
                    json={"prompt": "a b c", "max_tokens": 4, "stream": True},
                    headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                )
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
                r = await http.post("/v1/chat/completions", json={"messages": []})
                assert r.status_code == 400
                await http.get("/health")  # (no span: not a generation request)
            shutdown.set()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["llm_request", "llm_request"]
    ok, bad = spans
    assert ok.kind == SpanKind.SERVER
    assert format(ok.context.trace_id, "032x") == TRACE_ID
    assert format(ok.parent.span_id, "016x") == PARENT_ID
    attrs = dict(ok.attributes)
    assert attrs["gen_ai.request.model"] == "sim" and attrs["http.route"] == "/v1/completions"
    assert attrs["gen_ai.usage.input_tokens"] == 3 and attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["trio_llm.stream"] is True and attrs["http.response.status_code"] == 200
    events = [e.name for e in ok.events]
    assert events == ["queued", "accepted", "first_token", "finished"]
    times = [e.timestamp for e in ok.events]
    assert ok.start_time <= times[0] <= times[1] <= times[2] <= times[3] == ok.end_time
    assert bad.parent is None and bad.status.status_code == StatusCode.ERROR
    assert dict(bad.attributes)["http.response.status_code"] == 400


def test_tracing_is_off_unless_asked():
    app = create_app(ServerConfig())
    assert app.tracing is None


def test_tracing_off_imports_nothing_of_opentelemetry():
    """Off, tracing costs one ``is None`` test per request (docs/deployment.md, "Traces")
    and not a module: nothing of opentelemetry is imported by the server."""
    import subprocess
    import sys

    code = (
        "import sys; from server.config import ServerConfig; from server.http.app import "
        "create_app; create_app(ServerConfig()); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
