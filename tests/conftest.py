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
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from server.config import EngineConfig, Limits, ServerConfig
from server.http.app import create_app
from server.connections.private_api import FALLBACK_ENV
from server.http.serve import serve
from tests.processes import child_pids, children_of, pid_exists  # noqa: F401 (theirs)

FAST_SIM = {"itl_ms": 2.0, "ttft_ms": 5.0, "prefill_us_per_token": 0.0}

#: The header a generation request's body needs (a body sent with ``content=``).
JSON = {"Content-Type": "application/json"}


def pytest_collection_modifyitems(config, items):
    slow_units_first(items)
    if os.environ.get(FALLBACK_ENV, "") in ("", "0"):
        return
    skip = pytest.mark.skip(reason=f"needs the direct HTTP path ({FALLBACK_ENV} is set)")
    for item in items:
        if item.get_closest_marker("direct_http") is not None:
            item.add_marker(skip)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


#: Modules whose tests share nothing (no module-scoped server or model): under ``-n`` each
#: test goes to whichever worker is free.
SPREAD = {"tests/test_bench_smoke.py"}
#: Modules that share a session-scoped server or process with another (``vllm_server``,
#: ``vllm_checks``, ``transformers_server``, ``tools_server``): they run in that module's
#: unit of work, so that one worker starts it once, and it stops when the unit ends.
SHARED = {"tests/test_vllm_token_ids.py": "tests/test_vllm_engine.py",
          "tests/test_vllm_prep_helper.py": "tests/test_structured_defaults.py",
          "tests/test_minimal_bodies.py": "tests/test_structured_defaults.py",
          "tests/test_hostile_bodies.py": "tests/test_structured_defaults.py",
          "tests/test_embeddings.py": "tests/test_structured_defaults.py",
          "tests/test_transformers_engine.py": "tests/test_structured_defaults.py",
          "tests/test_token_ids.py": "tests/test_structured_defaults.py",
          "tests/test_refusal_params.py": "tests/test_structured_defaults.py",
          "tests/test_background_responses.py": "tests/test_structured_defaults.py",
          "tests/test_tools_defaults.py": "tests/test_tools.py",
          "tests/test_clients.py": "tests/test_tools.py",
          "tests/test_responses.py": "tests/test_tools.py"}


def unit_of(nodeid: str) -> str:
    """The unit of work of a test: its module, the module it shares a server with
    (:data:`SHARED`), or the test itself (:data:`SPREAD`)."""
    module = _module(nodeid)
    return nodeid if module in SPREAD else SHARED.get(module, module)


#: Units without a ``slow`` test that still take 25 s or more on two busy cores (measured
#: at a2347d7): they go after the slow units and before the rest. Last, one of them kept
#: the other xdist worker idle for 40 s. An order, never an outcome: a stale entry costs
#: only wall time.
LONG = {"tests/test_migration_engines.py", "tests/test_worker_leaving.py",
        "tests/test_dns_discovery.py", "tests/test_reliability.py", "tests/test_batches.py",
        "tests/test_prep_helper.py", "tests/test_resume_engines.py", "tests/test_tools.py",
        "tests/test_api_servers.py", "tests/test_remote_workers.py", "tests/test_hostile.py",
        "tests/test_engine_processes.py", "tests/test_llguidance_fallback.py"}


def slow_units_first(items) -> None:
    """Each unit's tests together, in their order; the units with a test marked ``slow``
    (minutes of engine start-ups) first, then the :data:`LONG` ones. Under ``-n`` the end
    of the run is then short units, which keep every worker busy until the last. Without
    ``-n`` too, a unit's shared servers can stop when it ends (:func:`close_with_unit`)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(unit_of(item.nodeid), i)
    slow = {unit_of(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, int]:
        unit = unit_of(item.nodeid)
        return (0 if unit in slow else 1 if unit in LONG else 2), first[unit]

    items.sort(key=rank)


#: What stops the running unit's shared servers, by fixture name (:func:`close_with_unit`).
_unit_closers: dict[str, Callable[[], None]] = {}
#: The shared servers stopped so far, with the unit that used them.
_closed: dict[str, str] = {}


def close_with_unit(name: str, close: Callable[[], None]) -> Callable[[], None]:
    """Have the session fixture ``name``'s ``close`` called once the running unit of work
    ends, not at the end of the session: an idle vLLM server still costs a few percent of a
    core, and each server holds a gigabyte or more. Its users must be one unit
    (:data:`SHARED`). Returns ``close`` made idempotent, for the fixture's own teardown."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            _closed.setdefault(name, "(the session's end)")
            close()

    _unit_closers[name] = once
    return once


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a unit of work (``nextitem`` is in another, or none is left),
    stop the shared servers it started (:func:`close_with_unit`)."""
    result = yield
    if nextitem is None or unit_of(nextitem.nodeid) != unit_of(item.nodeid):
        while _unit_closers:
            name, close = _unit_closers.popitem()
            _closed[name] = unit_of(item.nodeid)
            close()
    return result


def pytest_runtest_setup(item):
    """A test that asks for a shared server stopped with another unit fails at once, saying
    why, rather than talking to a server that is gone."""
    for name in item.fixturenames:
        if name in _closed:
            pytest.fail(f"{name} stopped at the end of the unit of {_closed[name]}, which "
                        f"{_module(item.nodeid)} is not part of: add it to SHARED (tests/conftest.py)")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # (optional: pytest-xdist's hook)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n N --dist loadgroup`` (``./run-tests``): each module is one unit of work,
    run by one xdist worker, so that its module-scoped servers and models are made once, not
    once per worker; a test of a :data:`SPREAD` module is a unit of its own, a
    :data:`SHARED` module is part of the unit of the module whose server it shares. The units are
    handed out in collection order (slow units first). Ours rather than xdist's own
    ``loadgroup``, whose ``xdist_group`` marks pytest 9.2 no longer carries to the
    scheduler (pytest-xdist issue 1386: the tests would spread one by one)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # (xdist's would put the biggest modules first)
    return ByModule(config, log)


class ServerURL(str):
    """The base URL, e.g. ``http://127.0.0.1:41234``; ``.app`` is the running app."""

    app = None

    @property
    def engine(self):
        return self.app.engine


async def wait_http_ok(url: str, timeout: float = 60.0) -> None:
    # (verify=False: plain HTTP on loopback; building the default SSL context costs 15-40 ms,
    # at every server start of the suite)
    async with httpx.AsyncClient(verify=False) as client:
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


class ThreadServer:
    """:func:`running_server` in a thread with a Trio run of its own, so that it can outlive
    a test (pytest-trio gives each test a Trio run of its own, which its servers cannot
    outlive): one server for a session's tests of one configuration that only talk to it
    over HTTP. ``url`` (its ``app`` lives in that other run: look inside through
    :meth:`call`). :meth:`assert_idle` after each test; :func:`running_server`'s own checks
    when it stops (:meth:`close`)."""

    def __init__(self, config: EngineConfig, *, timeout: float = 300, **server_options) -> None:
        self.url = ServerURL("")
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, server_options),
                                        name="shared server", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):  # (a bound that fails a hang)
            raise AssertionError(f"the shared server did not start in {timeout} s")
        if self._error is not None:
            raise self._error

    def _run(self, config, server_options) -> None:
        try:
            trio.run(self._serve, config, server_options)
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()

    async def _serve(self, config, server_options) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with running_server(config, **server_options) as url:
            self.url = url
            self._started.set()
            await self._stop.wait()

    def call(self, async_fn, *args):
        """``await async_fn(*args)`` in the server's Trio run, from outside it."""
        self.check_running()
        return trio.from_thread.run(async_fn, *args, trio_token=self._token)

    def check_running(self) -> None:
        """Raise why the server's Trio run ended, if it has (else each later test would fail
        with a RunFinishedError or a refused connect, and the cause would be lost)."""
        if not self._thread.is_alive():
            raise AssertionError("the shared server's Trio run has ended") from self._error

    def assert_idle(self) -> None:
        """Nothing in the manager, nothing in any worker (as :func:`running_server` checks
        when it exits). From a Trio run: ``await trio.to_thread.run_sync(s.assert_idle)``."""

        async def idle() -> None:
            for engine in self.url.app.models.engines():
                await assert_engine_idle(engine)

        self.call(idle)

    def close(self) -> None:
        self.check_running()
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(120)
        if self._error is not None:
            raise self._error


def checked_url(server: ThreadServer):
    """A shared server's URL for one test (a fixture's body), checked idle after it."""
    server.check_running()
    yield server.url
    server.assert_idle()


def transformers_thread_server(directory, shape: dict | None = None,
                               **server_options) -> ThreadServer:
    """A :class:`ThreadServer` on a tiny model built in ``directory`` (``shape``: more options
    of tests/tiny_model.py's build), the transformers engine with one torch thread; skipped
    where transformers is not installed. Its ``model_dir``: the model."""
    pytest.importorskip("transformers")
    from tests.tiny_model import build_tiny_model

    model_dir = build_tiny_model(directory, **(shape or {}))
    server = ThreadServer(EngineConfig(engine="transformers", drain_timeout=5.0,
                                       engine_options={"model_path": str(model_dir),
                                                       "num_threads": 1}), **server_options)
    server.model_dir = model_dir  # type: ignore[attr-defined]
    return server


@pytest.fixture(scope="session")
def transformers_server(tmp_path_factory):
    """One transformers server on tests/tiny_model.py's default model, served as
    ``tiny-llama``, with one torch thread, for the tests that only talk to a server of that
    configuration (tests/test_structured_defaults.py, test_minimal_bodies.py,
    test_hostile_bodies.py, test_embeddings.py, test_transformers_engine.py,
    test_token_ids.py, test_refusal_params.py, test_background_responses.py: one unit of
    work, :data:`SHARED`): one start-up for them all. ``model_dir``: its model. Through
    :func:`transformers_url`."""
    server = transformers_thread_server(tmp_path_factory.mktemp("shared-hf") / "tiny-llama")
    close = close_with_unit("transformers_server", server.close)
    yield server
    close()


@pytest.fixture
def transformers_url(transformers_server):
    """:func:`transformers_server`'s URL for a test, checked idle after it."""
    yield from checked_url(transformers_server)


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory):
    """tests/test_tools.py's tiny model (a context long enough for tools) served as
    ``tiny-tools`` by the transformers engine with the hermes tool-call parser, for the tests
    that only talk to a server of that configuration (tests/test_tools.py,
    test_tools_defaults.py, test_clients.py, test_responses.py: one unit of work,
    :data:`SHARED`): one start-up
    for them all. ``model_dir``: its model. Through :func:`tools_url`."""
    server = transformers_thread_server(tmp_path_factory.mktemp("shared-tools") / "tiny-tools",
                                        {"max_position_embeddings": 4096},
                                        tool_call_parser="hermes")
    close = close_with_unit("tools_server", server.close)
    yield server
    close()


@pytest.fixture
def tools_url(tools_server):
    """:func:`tools_server`'s URL for a test, checked idle after it."""
    yield from checked_url(tools_server)


@pytest.fixture
async def server_url():
    async with running_server() as url:
        yield url


@pytest.fixture
async def fault_server_url():
    config = EngineConfig(engine_options={**FAST_SIM, "faults": True}, drain_timeout=0.5)
    async with running_server(config) as url:
        yield url


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """tests/test_vllm_engine.py's tiny model, built once for ``vllm_server``'s users."""
    from tests.test_vllm_engine import build_shared_model

    return build_shared_model(tmp_path_factory)


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir):
    """One ``python -m server --engine vllm`` on that model for the modules whose tests need
    no server of their own (tests/test_vllm_engine.py, tests/test_vllm_token_ids.py): one
    vLLM start-up for them all, not one per module. It is a child process: its tests see
    its state over HTTP (``Server.wait_idle`` reads its /metrics), as they did with a server
    per module; tests that stop a server start their own."""
    from tests.test_vllm_engine import start_shared_server

    server = start_shared_server(vllm_model_dir)
    stop = close_with_unit("vllm_server", server.stop)
    yield server
    stop()


@pytest.fixture(scope="session")
def vllm_checks(tmp_path_factory):
    """One process for the vllm checks that need vLLM in process (tests/vllm_reference.py's
    ``ChecksApart``: tests/test_structured_defaults.py, tests/test_vllm_prep_helper.py), so
    that the checks on the same engine configuration share its start-up."""
    from tests.vllm_reference import ChecksApart

    checks = ChecksApart(tmp_path_factory.mktemp("vllm-checks"))
    close = close_with_unit("vllm_checks", checks.close)
    yield checks
    close()


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server these tests start (tests/postgres_server.py), one per xdist worker;
    skipped, saying why, where Debian's postgresql or psycopg is not installed."""
    from tests.postgres_server import find_binaries, start_postgres

    bin_dir = find_binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb/pg_ctl under /usr/lib/postgresql "
                    "or on PATH): the PostgreSQL backend's tests need it")
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed (the state-postgres extra)")
    server = start_postgres(bin_dir)
    yield server
    server.stop()
