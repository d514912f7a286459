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

:meth:`ASGIClient.stream` reads a response as the app sends it, and can leave in the middle,
as a client that closes its connection does::

    async with client.stream("POST", "/v1/completions", json=body) as r:
        events = r.events()
        first, second = await anext(events), await anext(events)
        await r.disconnect()        # the app's next receive() is http.disconnect
"""

from __future__ import annotations

import json as jsonlib
import math
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import trio

from ..manager.unwrap import body_errors_unwrapped

__all__ = ["ASGIClient", "ASGIResponse", "ASGIStream", "open_asgi_client"]


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
        events = (_event_data(event) for event in self.body.split(b"\n\n"))
        return [data for data in events if data is not None]


def _event_data(event: bytes):
    """One server-sent event's data (parsed JSON, or the text), or None (a comment)."""
    if not event.startswith(b"data: "):
        return None
    data = event[6:].decode()
    return data if not data.startswith("{") else jsonlib.loads(data)


class ASGIStream:
    """A response read as the app sends it (:meth:`ASGIClient.stream` makes it).

    ``async for chunk in stream`` yields the bytes of each body message once the app sent
    it; :meth:`events` yields each server-sent event; :meth:`disconnect` is the client going
    away mid-response. ``response`` holds everything the app sent so far (``status``,
    ``headers``, ``body``, the time of each chunk). An exception of the app is raised
    where the reading ends (the end of the body, :meth:`disconnect`, or leaving the block).
    """

    def __init__(self, body: bytes) -> None:
        self.response: ASGIResponse | None = None
        self._body = body
        self._body_sent = False
        self._chunks_in, self._chunks = trio.open_memory_channel[bytes](math.inf)
        self._started = trio.Event()  # the response started, or the app returned
        self._gone = trio.Event()  # the client went away (or the response is complete)
        self._returned = trio.Event()
        self._error: Exception | None = None

    @property
    def status(self) -> int:
        assert self.response is not None
        return self.response.status

    def header(self, name: str) -> str | None:
        assert self.response is not None
        return self.response.header(name)

    def __aiter__(self) -> ASGIStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.receive()
        except trio.EndOfChannel:
            self._raise_error()
            raise StopAsyncIteration from None

    async def events(self) -> AsyncIterator:
        """Each server-sent event's data as it arrives: parsed JSON, or the text
        (``"[DONE]"``); comments (a heartbeat) are skipped."""
        pending = b""
        async for chunk in self:
            pending += chunk
            *whole, pending = pending.split(b"\n\n")
            for event in whole:
                data = _event_data(event)
                if data is not None:
                    yield data

    async def disconnect(self) -> None:
        """Close the connection: the app's next ``receive()`` is ``http.disconnect``, and
        what it sends from now on is dropped. Returns once the app has returned."""
        self._gone.set()
        self._chunks_in.close()
        await self._returned.wait()
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    async def _receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        await trio.lowlevel.checkpoint()
        if self._gone.is_set():
            return  # the client went away: nobody reads it
        if message["type"] == "http.response.start":
            self.response = ASGIResponse(message["status"], list(message.get("headers", [])))
            self._started.set()
        elif message["type"] == "http.response.body":
            assert self.response is not None, "a body before the response started"
            data = message.get("body", b"")
            if data:
                self.response.body += data
                self.response.chunks.append((trio.current_time(), data))
                self._chunks_in.send_nowait(data)
            if not message.get("more_body", False):
                self._chunks_in.close()
                self._gone.set()  # complete: the connection's end is the app's disconnect

    async def _run(self, app, scope: dict) -> None:
        try:
            await app(scope, self._receive, self._send)
        except Exception as exc:
            self._error = exc
        finally:
            self._chunks_in.close()
            self._gone.set()
            self._returned.set()
            self._started.set()


class ASGIClient:
    """Requests to one ASGI app, each a call of the app (see the module docstring)."""

    def __init__(self, app) -> None:
        self.app = app

    async def post(self, path: str, *, json=None, headers=()) -> ASGIResponse:
        return await self.request("POST", path, json=json, headers=headers)

    async def get(self, path: str, *, headers=()) -> ASGIResponse:
        return await self.request("GET", path, headers=headers)

    async def request(self, method: str, path: str, *, json=None, body: bytes = b"",
                      headers=()) -> ASGIResponse:
        """The whole response, once the app has returned."""
        async with self.stream(method, path, json=json, body=body, headers=headers) as r:
            async for _ in r:
                pass
        assert r.response is not None
        return r.response

    def stream(self, method: str, path: str, *, json=None, body: bytes = b"",
               headers=()) -> AbstractAsyncContextManager[ASGIStream]:
        """Call the app; the block starts once the response has started (status and
        headers), and reads its body as the app sends it (:class:`ASGIStream`). Leaving the
        block before the response is complete disconnects, and waits for the app to return.
        """
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
        return body_errors_unwrapped(self._stream(scope, body))

    @asynccontextmanager
    async def _stream(self, scope: dict, body: bytes) -> AsyncIterator[ASGIStream]:
        stream = ASGIStream(body)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream._run, self.app, scope)
            await stream._started.wait()
            if stream.response is not None:
                try:
                    yield stream
                except BaseException:
                    stream._gone.set()  # a client that failed goes away
                    stream._chunks_in.close()
                    raise
            stream._gone.set()  # (when the response is complete: it was already)
        stream._raise_error()  # (not in the nursery, which would put it in a group)
        if stream.response is None:
            raise AssertionError("the app answered nothing")


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
