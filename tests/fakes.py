"""Test doubles for the core, and the invariant checks every engine test ends with.

In-memory workers (for ``autojump_clock`` tests)::

    async with open_fake_spawner() as spawn:
        async with server.open_engine(config, spawn=spawn) as engine:
            ...
            await assert_engine_idle(engine)
        spawn.assert_all_exited()

``open_fake_engine(**config)`` does all of that around a test body, and
``open_real_engine(**config)`` does the same with real worker processes (``python -m
server.workers``), recording every frame that crosses their pipes.

A :class:`FakeWorkerProcess` runs the real :class:`~server.workers.sim.SimEngine` in a trio task
driven by trio's clock, behind the real wire protocol: it is the loop of
:func:`server.workers.main.serve` written with trio instead of ``selectors``. Its task lives in
the nursery of the :class:`FakeSpawner` that made it, which the test owns. Everything it reads
and writes is recorded (:attr:`FakeSpawner.received`, :attr:`FakeSpawner.sent`). It can crash
(sim fault ``crash``, or :meth:`FakeWorkerProcess.die`), hang (fault ``hang``, or
:meth:`FakeWorkerProcess.hang`), be killed, and break the protocol (fault ``garbage``, or
:meth:`~FakeWorkerProcess.inject`).
"""

from __future__ import annotations

import itertools
import math
import os
import weakref
from collections import namedtuple
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio
import trio.testing

import server
from server.manager import engine as engine_module
from server.manager import stream as stream_module
from server.manager.worker import spawn_process
from server.protocol import wire
from server.workers.base import WorkerCrash, WorkerGarbage, WorkerHang
from server.workers.main import handle_message
from server.workers.sim import SimEngine

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

#: One message that crossed a worker's pipe: when (trio clock), which process, what.
Frame = namedtuple("Frame", "time pid msg")

# Fake pids lie above the largest pid_max Linux allows (2**22), so they name no real process.
_fake_pids = itertools.count(10_000_001)


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



def fault(kind: str, after: int = 0) -> dict:
    """``SamplingParams.extra`` that asks the sim engine for a fault."""
    return {"fault": {"kind": kind, "after": after}}


def sim_config(**kw) -> server.EngineConfig:
    """An EngineConfig for the sim engine; engine options may be given inline.

    >>> sim_config(itl_ms=2, drain_timeout=0.5).engine_options["itl_ms"]
    2
    """
    option_names = {"itl_ms", "ttft_ms", "prefill_us_per_token", "max_batch", "max_model_len",
                    "faults", "model", "startup_delay_ms"}
    options = {"itl_ms": 10.0, "ttft_ms": 20.0, "faults": True}
    options.update(kw.pop("engine_options", {}))
    for name in list(kw):
        if name in option_names:
            options[name] = kw.pop(name)
    return server.EngineConfig(engine_options=options, **kw)


# ------------------------------------------------------------------------------------------
# Recording, shared by the fake and the real spawner
# ------------------------------------------------------------------------------------------


class _Log:
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


# ------------------------------------------------------------------------------------------
# The in-memory worker
# ------------------------------------------------------------------------------------------


class FakeWorkerProcess:
    """A worker "process" over in-memory streams, with the parts of :class:`trio.Process`
    that :class:`~server.manager.worker.WorkerClient` uses."""

    def __init__(self, spawner: FakeSpawner, options: dict, *, start_fails: bool) -> None:
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
        decoder = wire.FrameDecoder()
        await self._send([wire.HELLO, engine.info])
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
                await self._send([wire.STEP, accepts, outputs])
                accepts = []
                outputs = []


class FakeSpawner(_Log):
    """The ``spawn`` argument of :func:`server.open_engine`: makes :class:`FakeWorkerProcess`
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

    async def __call__(self, config: server.EngineConfig) -> FakeWorkerProcess:
        await trio.lowlevel.checkpoint()
        if self.fail_next_spawns > 0:
            self.fail_next_spawns -= 1
            raise BlockingIOError(11, "Resource temporarily unavailable")
        argument = config.worker_argument()
        assert argument["engine"] == "sim", "the fake worker runs the sim engine only"
        fails = self.fail_next_starts > 0
        if fails:
            self.fail_next_starts -= 1
        proc = FakeWorkerProcess(self, argument["options"], start_fails=fails)
        self.processes.append(proc)
        self._nursery.start_soon(proc._main)
        return proc

    def assert_all_exited(self) -> None:
        """No fake process outlives the engine."""
        alive = [p.pid for p in self.processes if not p.exited]
        assert not alive, f"worker processes still running: {alive}"


@asynccontextmanager
async def open_fake_spawner(**kw) -> AsyncIterator[FakeSpawner]:
    """A :class:`FakeSpawner` whose processes run in a nursery owned by this block. Processes
    still running at the end are killed (a test checks :meth:`~FakeSpawner.assert_all_exited`
    first when that matters)."""
    async with trio.open_nursery() as nursery:
        spawner = FakeSpawner(nursery, **kw)
        try:
            yield spawner
        finally:
            for proc in spawner.processes:
                proc.ignore_terminate = False
                proc.die(-9)


@asynccontextmanager
async def open_fake_engine(config: server.EngineConfig | None = None, *, spawner_kw=None,
                           timeout: float = 600.0, **config_kw):
    """``(engine, spawner)`` over in-memory workers; on a clean exit, checks that nothing is
    left in the manager or the workers, and that every process exited with the engine.

    The block fails after ``timeout`` seconds of trio time: under ``autojump_clock`` a test
    that would wait forever (heartbeats keep the clock jumping) fails at once instead.
    """
    config = config or sim_config(**config_kw)
    with trio.fail_after(timeout):
        async with open_fake_spawner(**(spawner_kw or {})) as spawner:
            async with server.open_engine(config, spawn=spawner) as engine:
                yield engine, spawner
                await assert_engine_idle(engine)
            spawner.assert_all_exited()


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


async def assert_engine_idle(engine: server.Engine, *, settle: float = 0.0) -> None:
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
        for _, t, n, finish, _err in engine.step(clock.t):
            text += t
            ntok += n
    return text, ntok, finish


class ObjectTracker:
    """Weak sets of every Choice, _Waker and RequestOutput made while installed, and weak
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

    ``Choice``, ``_Waker`` and ``RequestOutput`` use ``__slots__`` without ``__weakref__``;
    the subclasses add only that slot (and registration), so their lifetime is the original
    one. Installed with ``monkeypatch`` on the names the manager looks up at run time.
    """
    tracker = ObjectTracker()

    class TrackedChoice(stream_module.Choice):
        __slots__ = ("__weakref__",)

        def __init__(self, *args) -> None:
            super().__init__(*args)
            tracker.add(tracker.choices, self)

    class TrackedWaker(stream_module._Waker):
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
    monkeypatch.setattr(engine_module, "_Waker", TrackedWaker)
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
