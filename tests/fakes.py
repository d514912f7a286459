"""Test doubles for the core, and the invariant checks every engine test ends with.

The in-memory workers are the public testing kit's (:mod:`server.testing`), under the names
the tests have always used::

    async with open_fake_spawner() as spawn:
        async with server.open_engine(config, spawn=spawn) as engine:
            ...
            await assert_engine_idle(engine)
        spawn.assert_all_exited()

``open_fake_engine(**config)`` does all of that around a test body and yields
``(engine, spawner)``; ``open_real_engine(**config)`` does the same with real worker
processes (``python -m server.workers``), recording every frame that crosses their pipes.
Also here: the scenarios of the refcount tests, an object tracker, and ``sim_reference``
(what the sim engine produces for a prompt, computed without a worker).
"""

from __future__ import annotations

import os
import weakref
from contextlib import asynccontextmanager

import trio
import trio.testing

import server
from server.manager import engine as engine_module
from server.manager import stream as stream_module
from server.manager.worker import spawn_process
from server.worker_protocol import wire
from server.testing import (
    Frame,
    InMemorySpawner as FakeSpawner,
    InMemoryWorkerProcess as FakeWorkerProcess,
    PipeLog as _Log,
    assert_engine_idle,
    fault,
    open_in_memory_engine,
    open_in_memory_spawner as open_fake_spawner,
    sim_engine_config as sim_config,
)
from server.engines.sim.engine import SimEngine

__all__ = [
    "Frame",
    "FakeWorkerProcess",
    "FakeSpawner",
    "RecordingSpawner",
    "open_fake_spawner",
    "open_fake_engine",
    "open_real_engine",
    "sim_config",
    "fault",
    "assert_engine_idle",
    "wait_for",
    "sim_reference",
    "ObjectTracker",
    "track_request_objects",
]


async def all_outputs(stream) -> list:
    """Every output of ``stream``; a failed request's error, which the stream raises,
    ends the list with the output that carried it (``exc.output``)."""
    outs = []
    try:
        async for out in stream:
            outs.append(out)
    except server.ServerError as exc:
        assert exc.output is not None and exc.output.finish_reason == "error"
        outs.append(exc.output)
    return outs


@asynccontextmanager
async def open_fake_engine(config: server.EngineConfig | None = None, *, spawner_kw=None,
                           timeout: float = 600.0, **config_kw):
    """``(engine, spawner)`` over the testing kit's in-memory workers (see
    :func:`server.testing.open_in_memory_engine`, which checks the invariants at the end)."""
    async with open_fake_spawner(**(spawner_kw or {})) as spawner:
        async with open_in_memory_engine(
            config, spawner=spawner, timeout=timeout, **config_kw
        ) as engine:
            yield engine, spawner


# ------------------------------------------------------------------------------------------
# Real processes, recorded
# ------------------------------------------------------------------------------------------


class _TapSend(trio.abc.SendStream):
    def __init__(self, inner: trio.abc.SendStream, log: list, pid: int) -> None:
        self._inner = inner
        self._log = log
        self._pid = pid
        self._decoder = wire.FrameDecoder()

    async def send_all(self, data) -> None:
        now = trio.current_time()
        for msg in self._decoder.feed(bytes(data)):
            self._log.append(Frame(now, self._pid, msg))
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._inner.aclose()


class _TapReceive(trio.abc.ReceiveStream):
    def __init__(self, inner: trio.abc.ReceiveStream, log: list, pid: int) -> None:
        self._inner = inner
        self._log = log
        self._pid = pid
        self._decoder = wire.FrameDecoder()

    async def receive_some(self, max_bytes=None) -> bytes:
        data = await self._inner.receive_some(max_bytes)
        now = trio.current_time()
        try:
            for msg in self._decoder.feed(data):
                self._log.append(Frame(now, self._pid, msg))
        except wire.ProtocolError:
            pass  # the frontend will notice
        return data

    async def aclose(self) -> None:
        await self._inner.aclose()


class _RecordedProcess:
    def __init__(self, proc: trio.Process, log: _Log) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.stdin = _TapSend(proc.stdin, log.received, proc.pid)
        self.stdout = _TapReceive(proc.stdout, log.sent, proc.pid)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


class RecordingSpawner(_Log):
    """The real :func:`~server.manager.worker.spawn_process`, with every frame recorded."""

    async def __call__(self, config: server.EngineConfig) -> _RecordedProcess:
        proc = _RecordedProcess(await spawn_process(config), self)
        self.processes.append(proc)
        return proc

    def assert_all_exited(self) -> None:
        """Every worker process was reaped and no longer exists."""
        for proc in self.processes:
            assert proc.returncode is not None, f"worker pid {proc.pid} was never reaped"
            assert not _our_process_exists(proc.pid), f"worker pid {proc.pid} still exists"


def _our_process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # The pid exists: ours (a zombie or live child), or reused by someone else since.
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1]) == os.getpid()
    except OSError:
        return False
    return True


@asynccontextmanager
async def open_real_engine(config: server.EngineConfig | None = None, *, settle: float = 2.0,
                           **config_kw):
    """``(engine, spawner)`` over real worker processes; on a clean exit, the same checks as
    :func:`open_fake_engine` (waiting up to ``settle`` s for workers to finish requests that
    ignored their abort), then that no worker process exists any more."""
    config = config or sim_config(**config_kw)
    spawner = RecordingSpawner()
    async with server.open_engine(config, spawn=spawner) as engine:
        yield engine, spawner
        await assert_engine_idle(engine, settle=settle)
    spawner.assert_all_exited()


# ------------------------------------------------------------------------------------------
# Invariants and helpers
# ------------------------------------------------------------------------------------------


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.005) -> None:
    """Poll ``predicate()`` until it is true; fail after ``timeout`` s (trio's clock)."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)


class _FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sim_reference(prompt, params: server.SamplingParams, sample: int = 0, **options):
    """What the sim engine produces for one sample, run sans-IO: ``(text, ntok, finish)``."""
    clock = _FakeClock()
    engine = SimEngine(clock=clock, **options)
    engine.add(1, prompt, params.to_wire(sample))
    text, ntok, finish = "", 0, None
    while finish is None:
        clock.t = engine.next_deadline()
        for _, t, n, finish, _err in engine.step(clock.t):  # noqa: B007 - the loop ends on it
            text += t
            ntok += n
    return text, ntok, finish


class ObjectTracker:
    """Weak sets of every Choice, Waker and RequestOutput made while installed, and weak
    references to all of them in the order they were made."""

    def __init__(self) -> None:
        self.choices: weakref.WeakSet = weakref.WeakSet()
        self.wakers: weakref.WeakSet = weakref.WeakSet()
        self.outputs: weakref.WeakSet = weakref.WeakSet()
        self.created: list[weakref.ref] = []

    def add(self, kind: weakref.WeakSet, obj) -> None:
        kind.add(obj)
        self.created.append(weakref.ref(obj))

    def alive_since(self, mark: int) -> list:
        """The tracked objects made after ``len(created)`` was ``mark`` that are still alive."""
        return [o for o in (r() for r in self.created[mark:]) if o is not None]

    def live(self) -> dict[str, int]:
        return {
            "choices": len(self.choices),
            "wakers": len(self.wakers),
            "outputs": len(self.outputs),
        }


def track_request_objects(monkeypatch) -> ObjectTracker:
    """Make the manager build weak-referenceable subclasses of its per-request objects.

    ``Choice``, ``Waker`` and ``RequestOutput`` use ``__slots__`` without ``__weakref__``;
    the subclasses add only that slot (and registration), so their lifetime is the original
    one. Installed with ``monkeypatch`` on the names the manager looks up at run time.
    """
    tracker = ObjectTracker()

    class TrackedChoice(stream_module.Choice):
        __slots__ = ("__weakref__",)

        def __init__(self, *args) -> None:
            super().__init__(*args)
            tracker.add(tracker.choices, self)

    class TrackedWaker(stream_module.Waker):
        __slots__ = ("__weakref__",)

        def __init__(self, *args) -> None:
            super().__init__(*args)
            tracker.add(tracker.wakers, self)

    class TrackedOutput(stream_module.RequestOutput):
        __slots__ = ("__weakref__",)

        def __init__(self, *args) -> None:
            super().__init__(*args)
            tracker.add(tracker.outputs, self)

    monkeypatch.setattr(engine_module, "Choice", TrackedChoice)
    monkeypatch.setattr(engine_module, "Waker", TrackedWaker)
    monkeypatch.setattr(stream_module, "RequestOutput", TrackedOutput)
    return tracker


# ------------------------------------------------------------------------------------------
# Request scenarios for the reference-counting tests: each runs one request to its end and
# returns a weak reference to its stream (its own locals die when it returns)
# ------------------------------------------------------------------------------------------


async def finished(engine):
    async with engine.generate("a b", server.SamplingParams(max_tokens=5)) as stream:
        outs = await all_outputs(stream)
    assert outs[-1].finish_reason == "length"
    return weakref.ref(stream)


async def cancelled(engine):
    stream = engine.generate("a b", server.SamplingParams(max_tokens=2000))
    with trio.move_on_after(0.1):
        async for _ in stream:
            pass
    assert stream.finished
    return weakref.ref(stream)


async def failed(engine):
    params = server.SamplingParams(max_tokens=50, extra=fault("error", 2))
    stream = engine.generate("a b", params)
    outs = await all_outputs(stream)
    assert outs[-1].finish_reason == "error"
    return weakref.ref(stream)


async def rejected(engine):
    stream = engine.generate("a b " * 5000, server.SamplingParams(max_tokens=5))
    try:
        await stream.wait_started()
    except server.ClientError:
        pass
    else:
        raise AssertionError("not rejected")
    return weakref.ref(stream)


async def cut_off(engine, max_tokens: int = 600):
    """Server abort of a request whose worker ignores it (the drain deadline must pass before
    the worker could finish ``max_tokens``)."""
    params = server.SamplingParams(max_tokens=max_tokens, extra=fault("ignore_abort"))
    stream = engine.generate("a b", params)
    async with stream:
        await stream.__anext__()
        stream.abort()
        outs = await all_outputs(stream)
    assert outs[-1].finish_reason == "abort"
    return weakref.ref(stream)


async def dropped(engine):
    """Dropped without aclose, with output pending (the __del__ safety net)."""
    stream = engine.generate("a b", server.SamplingParams(max_tokens=2000))
    await stream.__anext__()
    await trio.sleep(0.1)
    return weakref.ref(stream)


async def one_more_request(engine):
    async with engine.generate("x", server.SamplingParams(max_tokens=1)) as stream:
        async for _ in stream:
            pass
