"""Recording a streaming completion as it arrives: events, their times, and how it ended.

Shared by the reliability and shutdown tests, which watch several streams at once.
"""

from __future__ import annotations

import json

import httpx
import trio


class SSE:
    """What one streaming request received: events (the bytes between blank lines) and the
    trio time each arrived, and when the response ended."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.body = b""
        self.events: list[bytes] = []
        self.times: list[float] = []
        self.ended: float | None = None
        self.started = trio.Event()
        self.finished = trio.Event()

    def chunks(self) -> list[dict]:
        return [json.loads(e[6:]) for e in self.events if e.startswith(b"data: {")]

    def text(self) -> str:
        return "".join(
            ch.get("text", "") for c in self.chunks() if "choices" in c for ch in c["choices"]
        )

    def tokens(self) -> int:
        return len(self.text().split())  # the sim engine sends one word per token

    def finish_reasons(self) -> list[str]:
        return [
            ch["finish_reason"]
            for c in self.chunks()
            if "choices" in c
            for ch in c["choices"]
            if ch["finish_reason"] is not None
        ]

    def has_error(self) -> bool:
        return self.error() is not None

    def error(self) -> dict | None:
        errors = [c["error"] for c in self.chunks() if "error" in c]
        return errors[-1] if errors else None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == b"data: [DONE]"


async def stream_into(http: httpx.AsyncClient, body: dict, rec: SSE, started_after: int = 2):
    """POST a streaming completion and record it; ``rec.started`` is set after
    ``started_after`` events."""
    try:
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            rec.status = r.status_code
            buf = b""
            async for chunk in r.aiter_raw():
                now = trio.current_time()
                rec.body += chunk
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    rec.events.append(event)
                    rec.times.append(now)
                    if len(rec.events) >= started_after:
                        rec.started.set()
    finally:
        rec.ended = trio.current_time()
        rec.started.set()
        rec.finished.set()


async def completion_payloads(client: httpx.AsyncClient, url: str, body: dict,
                              started: list) -> list[str]:
    """The ``data:`` payloads of one streamed completion to ``url`` (``body`` is sent with
    ``stream`` on); ``started`` gets a 1 when its first event arrives, so that a test can
    wait until all its streams run."""
    events: list[str] = []
    async with client.stream("POST", url + "/v1/completions",
                             json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if not events:
                    started.append(1)
                events.append(line[6:])
    return events


def assert_whole(events: list[str], max_tokens: int) -> None:
    """One stream's payloads (:func:`completion_payloads`) ended [DONE], with no error
    event, at its full length (the sim engine: a word a token)."""
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(text.split()) == max_tokens
