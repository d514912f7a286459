"""Shared fixtures: a real server on a loopback port, and the invariants checked after tests.

``running_server(config, **server_options)`` serves the real app with hypercorn on
127.0.0.1 port 0, real worker processes behind it, and yields its base URL (a ``str`` with
an ``app`` attribute for tests that look inside). When the block exits it checks the
invariants: no stream left in the manager, no request left in any worker, and, once the
server is down, no worker process left.

With ``TRIO_LLM_HTTP_FALLBACK=1`` every server here serves through hypercorn's public
``serve()`` (:mod:`server.connections.private_api`), and the tests marked ``direct_http`` (what
only the direct path does: connection limits, bounded writes, request-head refusals) are
skipped: ``.ci/run`` runs the HTTP test files that way too.
"""

from __future__ import annotations

import functools
import os
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from server.config import EngineConfig, Limits, ServerConfig
from server.http.app import create_app
from server.connections.private_api import FALLBACK_ENV
from server.http.serve import serve

FAST_SIM = {"itl_ms": 2.0, "ttft_ms": 5.0, "prefill_us_per_token": 0.0}

#: The header a generation request's body needs (a body sent with ``content=``).
JSON = {"Content-Type": "application/json"}


def pytest_collection_modifyitems(config, items):
    if os.environ.get(FALLBACK_ENV, "") in ("", "0"):
        return
    skip = pytest.mark.skip(reason=f"needs the direct HTTP path ({FALLBACK_ENV} is set)")
    for item in items:
        if item.get_closest_marker("direct_http") is not None:
            item.add_marker(skip)


class ServerURL(str):
    """The base URL, e.g. ``http://127.0.0.1:41234``; ``.app`` is the running app."""

    app = None

    @property
    def engine(self):
        return self.app.engine


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this test process, from /proc."""
    return children_of(os.getpid())


def children_of(pid: int) -> set[int]:
    """Live (non-zombie) child processes of ``pid``, from /proc."""
    me = pid
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry))
    return found


def pid_exists(pid: int) -> bool:
    """True while ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def wait_http_ok(url: str, timeout: float = 60.0) -> None:
    async with httpx.AsyncClient() as client:
        with trio.fail_after(timeout):
            while True:
                try:
                    r = await client.get(url)
                    if r.status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.02)


async def assert_engine_idle(engine, timeout: float = 30.0) -> None:
    """Nothing in the manager, nothing running or waiting in any worker (waits up to
    ``timeout`` for in-flight aborts and requests that ignore aborts to finish)."""
    with trio.fail_after(timeout):
        while True:
            stats = engine.statistics()
            counts = await engine.ping_all()
            if (
                stats.open_streams == 0
                and stats.outstanding == 0
                and all(c == (0, 0) for c in counts)
            ):
                return
            await trio.sleep(0.02)


@asynccontextmanager
async def running_server(config: EngineConfig | None = None, *, not_ours=frozenset(),
                         **server_options):
    """(``not_ours``: pids of processes a test starts meanwhile, that the server does not
    own: a set it may fill while the server runs. ``models=``: several models, each its
    own pool; then no ``config``.)"""
    models = [m.engine for m in server_options.get("models", ())]
    engine_config = config or (EngineConfig() if models else
                               EngineConfig(engine_options=dict(FAST_SIM)))
    server_options.setdefault("shutdown_timeout", 0)
    server_options.setdefault("close_timeout", 0.2)
    if "limits" not in server_options:
        faults = any(e.engine_options.get("faults") for e in [engine_config, *models])
        server_options["limits"] = Limits(allow_faults=faults)
    cfg = ServerConfig(engine=engine_config, host="127.0.0.1", port=0, **server_options)
    app = create_app(cfg)
    before = child_pids()
    async with trio.open_nursery() as nursery:
        shutdown = trio.Event()
        binds = await nursery.start(
            functools.partial(serve, cfg, app=app, shutdown_trigger=shutdown)
        )
        url = ServerURL(binds[0])
        url.app = app
        try:
            await wait_http_ok(url + "/health")
            yield url
            for engine in app.models.engines():
                await assert_engine_idle(engine)
        finally:
            shutdown.set()
    with trio.fail_after(30):  # (bounds that pass at once when all is well: generous,
        while child_pids() - before - not_ours:  # for 2 busy cores)
            await trio.sleep(0.05)


@pytest.fixture
async def server_url():
    async with running_server() as url:
        yield url


@pytest.fixture
async def fault_server_url():
    config = EngineConfig(engine_options={**FAST_SIM, "faults": True}, drain_timeout=0.5)
    async with running_server(config) as url:
        yield url
