"""A testing kit: the engine in memory, for tests of your own code under ``autojump_clock``.

Real worker processes run on real time: under pytest-trio's ``autojump_clock`` their
startup timeout passes in virtual time before they say HELLO. This kit runs the real sim
engine (:class:`server.engines.sim.engine.SimEngine`) in a Trio task instead, behind the real wire
protocol on in-memory streams, with the worker loop's own message handling: the engine,
the request manager, cancellation, pacing and timeouts all behave as in production, and
virtual time jumps over every wait. The project's own tests run on it.

Example (a pytest-trio test)::

    from server import EngineConfig, SamplingParams
    from server.testing import open_in_memory_engine, sim_engine_config

    async def test_my_timeout_policy(autojump_clock):
        config = sim_engine_config(itl_ms=100)          # one token every 100 ms
        async with open_in_memory_engine(config) as engine:
            with trio.move_on_after(1.0):               # one virtual second
                async with engine.generate("hi", SamplingParams(max_tokens=50)) as stream:
                    async for out in stream:
                        ...
        # leaving the block checked that nothing is left in the manager or the worker

Pytest fixtures (``llm_engine``, ``llm_engine_config``) are in
:mod:`server.testing.pytest_plugin`; docs/testing.md has the whole story.

The parts:

* :func:`open_in_memory_engine`: an :class:`~server.Engine` on in-memory workers; on a clean
  exit it asserts that nothing is left (:func:`assert_engine_idle`) and that every worker
  exited with the engine.
* :func:`open_in_memory_spawner` / :class:`InMemorySpawner`: the ``spawn`` argument of
  :func:`server.open_engine`, for tests that want the workers themselves: each
  :class:`InMemoryWorkerProcess` can crash, hang, be killed or break the protocol, and
  every frame that crossed its pipe is recorded (:class:`PipeLog`).
* :func:`sim_engine_config`, :func:`fault`: configurations and sim fault injection.
* :func:`open_asgi_client` (:mod:`server.testing.asgi`): the HTTP app on that engine, in
  virtual time, without sockets; a response read whole, or as it arrives
  (:meth:`ASGIClient.stream`, which can disconnect mid-stream).
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import AsyncIterator

import trio
import trio.testing

from ..config import EngineConfig
from ..manager.engine import Engine, open_engine
from ..manager.unwrap import body_errors_unwrapped
from ..worker_protocol import wire
from ..workers.base import WorkerCrash, WorkerGarbage, WorkerHang
from ..workers.main import handle_message, step_message
from ..engines.sim.engine import SimEngine
from .asgi import ASGIClient, ASGIResponse, ASGIStream, open_asgi_client

__all__ = [
    "ASGIClient",
    "ASGIResponse",
    "ASGIStream",
    "Frame",
    "InMemorySpawner",
    "InMemoryWorkerProcess",
    "PipeLog",
    "assert_engine_idle",
    "fault",
    "open_asgi_client",
    "open_in_memory_engine",
    "open_in_memory_spawner",
    "sim_engine_config",
]

#: One message that crossed a worker's pipe: when (trio clock), which process, what.
Frame = namedtuple("Frame", "time pid msg")

# Fake pids lie above the largest pid_max Linux allows (2**22), so they name no real process.
_fake_pids = itertools.count(10_000_001)


def fault(kind: str, after: int = 0, **more) -> dict:
    """``SamplingParams.extra`` that asks the sim engine for a fault (``more``: its other
    fields, such as ``seconds`` of a ``slow_step``)."""
    return {"fault": {"kind": kind, "after": after, **more}}



def sim_engine_config(**kw) -> EngineConfig:
    """An EngineConfig for the sim engine; engine options may be given inline.

    >>> sim_engine_config(itl_ms=2, drain_timeout=0.5).engine_options["itl_ms"]
    2
    """
    option_names = {"itl_ms", "ttft_ms", "prefill_us_per_token", "max_batch", "max_model_len",
                    "faults", "model", "startup_delay_ms", "prefix_cache_tokens",
                    "prefix_block_size", "image_tokens", "images_per_prompt"}
    options = {"itl_ms": 10.0, "ttft_ms": 20.0, "faults": True}
    options.update(kw.pop("engine_options", {}))
    for name in list(kw):
        if name in option_names:
            options[name] = kw.pop(name)
    return EngineConfig(engine_options=options, **kw)


class PipeLog:
    """What crossed the pipes of every process a spawner started."""

    def __init__(self) -> None:
        self.processes: list = []
        #: frames the workers received (frontend -> worker), in order
        self.received: list[Frame] = []
        #: frames the workers sent (worker -> frontend), in order
        self.sent: list[Frame] = []

    def messages(self, kind: int) -> list[Frame]:
        return [f for f in self.received if f.msg[0] == kind]

    def rids(self) -> list[int]:
        """The rids submitted so far, in order."""
        return [f.msg[1] for f in self.received if f.msg[0] == wire.SUBMIT]

    def submits(self) -> list[Frame]:
        return self.messages(wire.SUBMIT)

    def aborts(self, rid: int | None = None) -> int:
        """How many ABORT frames reached a worker (for ``rid``, or in all)."""
        return sum(
            1 for f in self.received
            if f.msg[0] == wire.ABORT and (rid is None or f.msg[1] == rid)
        )

    def outputs_for(self, rid: int) -> list[tuple[float, list]]:
        """``(time, [rid, text, ntok, finish, err])`` for each output a worker sent for rid."""
        return [
            (f.time, out)
            for f in self.sent
            if f.msg[0] == wire.STEP
            for out in f.msg[2]
            if out[0] == rid
        ]


class InMemoryWorkerProcess:
    """A worker "process" over in-memory streams, with the parts of :class:`trio.Process`
    that :class:`~server.manager.worker.WorkerClient` uses."""

    def __init__(self, spawner: InMemorySpawner, options: dict, *, start_fails: bool) -> None:
        self.pid = next(_fake_pids)
        self._spawner = spawner
        # frontend -> worker
        self.stdin, self._in = trio.testing.memory_stream_one_way_pair()
        # worker -> frontend
        self._out, self.stdout = trio.testing.memory_stream_one_way_pair()
        self.engine = SimEngine(**options, clock=trio.current_time)
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.hung = False
        self.ignore_terminate = spawner.ignore_terminate
        self._start_fails = start_fails
        self._exited = trio.Event()
        self._kill_scope = trio.CancelScope()  # the whole "process"
        self._serve_scope = trio.CancelScope()  # its loop (cancelled by hang())
        self.signals: list[str] = []

    # -- the trio.Process surface ------------------------------------------------------------

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self.signals.append("SIGTERM")
        if not self.ignore_terminate:
            self.die(-15)

    def kill(self) -> None:
        self.signals.append("SIGKILL")
        self.die(-9)

    # -- what a test does to it --------------------------------------------------------------

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    def die(self, code: int = -9) -> None:
        """The process exits now with ``code`` (its pipes close; output not yet written is
        lost)."""
        if self.returncode is None and not self._exited.is_set():
            self.returncode = code
        self._kill_scope.cancel()

    def hang(self) -> None:
        """Stop reading and writing, but stay alive (until terminated or killed)."""
        self.hung = True
        self._serve_scope.cancel()

    async def inject(self, data: bytes) -> None:
        """Write raw bytes on the worker's stdout (call it while the worker is idle)."""
        await self._out.send_all(data)

    # -- the loop (server.workers.main.serve, with trio) -------------------------------------

    async def _main(self) -> None:
        code = 0
        try:
            with self._kill_scope:
                try:
                    with self._serve_scope:
                        code = await self._serve()
                except WorkerCrash:
                    code = 17
                except WorkerHang:
                    self.hung = True
                except WorkerGarbage:  # as server.workers.main does: garbage, then idle
                    self.hung = True
                    await self._out.send_all(b"\xff\xff\xff\xffthis is not a frame")
                except (trio.BrokenResourceError, trio.ClosedResourceError, wire.ProtocolError):
                    code = 1
                if self.hung:
                    await trio.sleep_forever()
        finally:
            if self.returncode is None:
                self.returncode = code
            self.exit_time = trio.current_time()
            for stream in (self._out, self._in):
                try:
                    stream.close()
                except trio.BrokenResourceError:
                    pass
            self._exited.set()

    async def _send(self, message: list) -> None:
        self._spawner.sent.append(Frame(trio.current_time(), self.pid, message))
        await self._out.send_all(wire.encode(message))

    async def _serve(self) -> int:
        engine = self.engine
        log = self._spawner.received
        if self._start_fails:
            return 2  # "cannot start engine": exit before HELLO
        decoder = wire.FrameDecoder(wire.check_request)
        await self._send([wire.HELLO, wire.hello_info(engine.info)])
        accepts: list = []
        outputs: list = []
        while True:
            deadline = engine.next_deadline()
            data = None
            if deadline is None or deadline > trio.current_time():
                with trio.move_on_at(math.inf if deadline is None else deadline):
                    data = await self._in.receive_some(1 << 20)
            if data is not None:
                if not data:
                    return 0
                now = trio.current_time()
                replies = []
                for msg in decoder.feed(data):
                    log.append(Frame(now, self.pid, msg))
                    if msg[0] == wire.SHUTDOWN:
                        return 0
                    reply = handle_message(engine, msg, accepts, outputs)
                    if reply is not None:
                        replies.append(reply)
                for reply in replies:
                    await self._send(reply)
            deadline = engine.next_deadline()
            now = trio.current_time()
            if deadline is not None and now >= deadline:
                outputs.extend(engine.step(now))
            if accepts or outputs:
                await self._send(step_message(engine, accepts, outputs))
                accepts = []
                outputs = []


class InMemorySpawner(PipeLog):
    """The ``spawn`` argument of :func:`open_engine`: makes :class:`InMemoryWorkerProcess`
    objects whose tasks run in the nursery this spawner was opened around.

    ``fail_next_starts``: that many of the next processes exit (code 2) before HELLO.
    ``fail_next_spawns``: that many of the next calls raise ``OSError`` (as a failed fork).
    ``ignore_terminate``: processes survive SIGTERM (only SIGKILL ends them).
    """

    def __init__(self, nursery: trio.Nursery, *, ignore_terminate: bool = False) -> None:
        super().__init__()
        self._nursery = nursery
        self.ignore_terminate = ignore_terminate
        self.fail_next_starts = 0
        self.fail_next_spawns = 0

    async def __call__(self, config: EngineConfig) -> InMemoryWorkerProcess:
        await trio.lowlevel.checkpoint()
        if self.fail_next_spawns > 0:
            self.fail_next_spawns -= 1
            raise BlockingIOError(11, "Resource temporarily unavailable")
        argument = config.worker_argument()
        assert argument["engine"] == "sim", "the fake worker runs the sim engine only"
        fails = self.fail_next_starts > 0
        if fails:
            self.fail_next_starts -= 1
        proc = InMemoryWorkerProcess(self, argument["options"], start_fails=fails)
        self.processes.append(proc)
        self._nursery.start_soon(proc._main)
        return proc

    def assert_all_exited(self) -> None:
        """No fake process outlives the engine."""
        alive = [p.pid for p in self.processes if not p.exited]
        assert not alive, f"worker processes still running: {alive}"


def open_in_memory_spawner(**kw) -> AbstractAsyncContextManager[InMemorySpawner]:
    """A :class:`InMemorySpawner` whose processes run in a nursery owned by this block. Processes
    still running at the end are killed (a test checks :meth:`~InMemorySpawner.assert_all_exited`
    first when that matters). An exception raised in the block comes out as itself, not in
    an exception group, as from :func:`server.open_engine`."""
    return body_errors_unwrapped(_in_memory_spawner(**kw))


@asynccontextmanager
async def _in_memory_spawner(**kw) -> AsyncIterator[InMemorySpawner]:
    async with trio.open_nursery() as nursery:
        spawner = InMemorySpawner(nursery, **kw)
        try:
            yield spawner
        finally:
            for proc in spawner.processes:
                proc.ignore_terminate = False
                proc.die(-9)


def open_in_memory_engine(
    config: EngineConfig | None = None,
    *,
    spawner: InMemorySpawner | None = None,
    timeout: float = 600.0,
    **options,
) -> AbstractAsyncContextManager[Engine]:
    """An :class:`~server.Engine` over in-memory sim workers, for the block's duration.

    ``config`` defaults to :func:`sim_engine_config` of ``options``. ``spawner``: one
    opened with :func:`open_in_memory_spawner`, to reach the workers (a new one otherwise).
    On a clean exit the block checks that nothing is left in the manager or any worker,
    and that every worker exited with the engine. It fails after ``timeout`` seconds of
    Trio time: under ``autojump_clock`` a test that would wait forever (heartbeats keep the
    clock jumping) fails at once instead. An exception raised in the block comes out as
    itself, as from :func:`server.open_engine`.
    """
    config = config or sim_engine_config(**options)
    return body_errors_unwrapped(_in_memory_engine(config, spawner, timeout))


@asynccontextmanager
async def _in_memory_engine(
    config: EngineConfig, spawner: InMemorySpawner | None, timeout: float
) -> AsyncIterator[Engine]:
    with trio.fail_after(timeout):
        if spawner is None:
            async with _in_memory_spawner() as spawner:
                async with _engine(config, spawner) as engine:
                    yield engine
        else:
            async with _engine(config, spawner) as engine:
                yield engine


@asynccontextmanager
async def _engine(config: EngineConfig, spawner: InMemorySpawner) -> AsyncIterator[Engine]:
    async with open_engine(config, spawn=spawner) as engine:
        yield engine
        await assert_engine_idle(engine)
    spawner.assert_all_exited()


async def assert_engine_idle(engine: Engine, *, settle: float = 0.0) -> None:
    """Nothing left in the manager, nothing running or waiting in any live worker.

    The manager must be empty at once; the workers get ``settle`` seconds (for requests that
    ignored their abort and run on after the stream was cut off).
    """
    stats = engine.statistics()
    assert stats.open_streams == 0, stats
    assert stats.outstanding == 0, stats
    deadline = trio.current_time() + settle
    while True:
        counts = await engine.ping_all()
        if all(c == (0, 0) for c in counts):
            return
        if trio.current_time() >= deadline:
            raise AssertionError(f"requests left in workers (running, waiting): {counts}")
        await trio.sleep(0.01)


