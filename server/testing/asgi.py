"""Drive an ASGI app (``server.create_app(engine=...)``) in virtual time, without sockets.

With an in-memory engine (:func:`server.testing.open_in_memory_engine`) the whole HTTP path
(validation, streaming, errors, timeouts, metrics) runs under ``autojump_clock``: a request
that streams for a minute of engine time takes milliseconds, and every timing is exact::

    async def test_a_stream(autojump_clock):
        async with open_in_memory_engine(itl_ms=100) as engine:
            async with open_asgi_client(server.create_app(engine=engine)) as client:
                r = await client.post("/v1/completions",
                                      json={"prompt": "hi", "max_tokens": 5, "stream": True})
        assert r.status == 200 and r.sse()[-1] == "[DONE]"

The app runs its lifespan (startup and shutdown) around the block, and each request is one
ASGI call: the body is sent at once, and the client "disconnects" (``http.disconnect``)
once the response is complete, or when the request's scope is cancelled (the app sees a
client that went away). What hypercorn adds on real sockets (framing, keep-alive, the
direct writes of :mod:`server.connections.sink`) is not here: test those on port 0.
"""

from __future__ import annotations

import json as jsonlib
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import trio

__all__ = ["ASGIClient", "ASGIResponse", "open_asgi_client"]


@dataclass
class ASGIResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    #: (trio time, bytes) of each body message, in order: when each event went out.
    chunks: list[tuple[float, bytes]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == key), None)

    def json(self):
        return jsonlib.loads(self.body)

    def sse(self) -> list:
        """The data of each server-sent event: parsed JSON, or the text (``"[DONE]"``)."""
        out = []
        for event in self.body.split(b"\n\n"):
            if event.startswith(b"data: "):
                data = event[6:].decode()
                out.append(data if not data.startswith("{") else jsonlib.loads(data))
        return out


class ASGIClient:
    """Requests to one ASGI app, each a direct call of the app (see the module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def post(self, path: str, *, json=None, headers=()) -> ASGIResponse:
        return await self.request("POST", path, json=json, headers=headers)

    async def get(self, path: str, *, headers=()) -> ASGIResponse:
        return await self.request("GET", path, headers=headers)

    async def request(self, method: str, path: str, *, json=None, body: bytes = b"",
                      headers=()) -> ASGIResponse:
        if json is not None:
            body = jsonlib.dumps(json).encode()
            headers = [("content-type", "application/json"), *headers]
        raw_path, _, query = path.partition("?")
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method, "scheme": "http",
            "path": raw_path, "raw_path": raw_path.encode(), "query_string": query.encode(),
            "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 40000),
            "headers": [(b"host", b"test"), (b"content-length", str(len(body)).encode()),
                        *((k.lower().encode(), v.encode()) for k, v in headers)],
            "extensions": {},
        }
        done = trio.Event()
        sent_body = False
        response: ASGIResponse | None = None

        async def receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal response
            await trio.lowlevel.checkpoint()
            if message["type"] == "http.response.start":
                response = ASGIResponse(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                assert response is not None, "a body before the response started"
                data = message.get("body", b"")
                if data:
                    response.body += data
                    response.chunks.append((trio.current_time(), data))
                if not message.get("more_body", False):
                    done.set()

        try:
            await self.app(scope, receive, send)
        finally:
            done.set()
        assert response is not None, "the app answered nothing"
        return response


@asynccontextmanager
async def open_asgi_client(app) -> AsyncIterator[ASGIClient]:
    """Run ``app``'s lifespan around the block; yield a client that calls it."""
    async with trio.open_nursery() as nursery:
        to_app, app_receives = trio.open_memory_channel[dict](1)
        app_sends, from_app = trio.open_memory_channel[dict](1)

        async def lifespan() -> None:
            scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                     "state": {}}
            await app(scope, app_receives.receive, app_sends.send)

        nursery.start_soon(lifespan)
        await to_app.send({"type": "lifespan.startup"})
        started = await from_app.receive()
        if started["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {started}")
        try:
            yield ASGIClient(app)
        finally:
            with trio.CancelScope(shield=True):
                await to_app.send({"type": "lifespan.shutdown"})
                await from_app.receive()
