"""A worker's big frames in the frontend's router (issue 23): a big RESULT (a /tokenize
answer of millions of ids, seconds of decoding) is decoded beside the router, so the other
streams' outputs on that worker do not wait for it; garbage in one still ends the session.

In-memory sim workers (tests/fakes.py) on the real clock (the decoding runs in a thread).
Whether the router waits is shown without timing: the decoding threads' limiter is held
by the test, so a big frame cannot be decoded until the test lets it; a stream on the same
worker must finish meanwhile. Every ``fail_after`` is a guard against a hang.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import msgpack
import pytest
import trio
import trio.testing

import server
from server.manager.worker import _ASIDES
from server.thread_limits import run_limiter
from server.worker_protocol import wire
from tests.fakes import all_outputs, open_fake_engine, wait_for

#: Token ids enough for a RESULT frame over wire.BIG_FRAME (about 3 bytes an id).
IDS = list(range(1000, 1000 + (wire.BIG_FRAME // 2)))


class _Held:
    """Every token of the limiter of the threads that decode big RESULT frames aside,
    held until released."""

    def __init__(self) -> None:
        self.limiter = run_limiter("frame_decode_aside", _ASIDES)
        self._owners = [object() for _ in range(int(self.limiter.total_tokens))]

    async def __aenter__(self) -> trio.CapacityLimiter:
        for owner in self._owners:
            await self.limiter.acquire_on_behalf_of(owner)
        return self.limiter

    async def __aexit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        owners, self._owners = self._owners, []  # (released once only)
        for owner in owners:
            self.limiter.release_on_behalf_of(owner)


def _answer_big(worker, asked: list | None = None) -> dict:
    """Make the in-memory ``worker`` answer every tokenize with :data:`IDS` (the sim has no
    tokenizer), packed where the request asks, as a worker packs; returns that answer as
    its waiter should get it. The requests go to ``asked`` when given."""
    answer = {"count": len(IDS), "max_model_len": 2048, "tokens": IDS, "token_strs": None}

    def tokenize(request: dict) -> dict:
        if asked is not None:
            asked.append(request)
        return {**answer, "tokens": wire.pack_ids(IDS)} if request.get("packed_ids") else answer

    worker.engine.tokenize = tokenize
    return answer


async def _tokenize(engine, got: list) -> None:
    """A /tokenize round trip; its answer, or the EngineError it raised, goes to ``got``."""
    try:
        got.append(await engine.tokenize({"op": "tokenize", "prompt": "x"}))
    except server.EngineError as exc:
        got.append(exc)


@asynccontextmanager
async def _big_answer_waiting(engine, spawn, asked: list | None = None):
    """A /tokenize round trip on the first worker whose big answer has arrived and waits
    for a decoding thread (the test holds them all until ``held.release()``); yields
    ``(held, answer, got)``, ``got`` receiving the round trip's outcome (see _tokenize),
    which has come at the end of the block."""
    answer = _answer_big(spawn.processes[0], asked)
    held = _Held()
    got: list = []
    async with held as limiter:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_tokenize, engine, got)
            await wait_for(lambda: limiter.statistics().tasks_waiting == 1, timeout=60)
            yield held, answer, got


async def test_streams_go_on_while_a_big_tokenize_answer_is_decoded():
    async with open_fake_engine(workers=1) as (engine, spawn):
        asked: list = []
        async with _big_answer_waiting(engine, spawn, asked) as (held, answer, got):
            with trio.fail_after(60):  # (the router would wait for that thread)
                outs = await all_outputs(
                    engine.generate("a b", server.SamplingParams(max_tokens=20)))
            assert outs[-1].finish_reason == "length"
            assert not got
            held.release()
        assert got == [answer]
        assert asked == [{"op": "tokenize", "prompt": "x", "packed_ids": True,
                          wire.ERROR_PARAM_KEY: True}]


async def _inject_beside_a_stream(engine, spawn, body: bytes) -> list:
    """The outputs of a stream on the (last) worker, which sends the frame ``body`` while
    the stream runs, and then nothing."""
    victim = spawn.processes[-1]
    stream = engine.generate("a b", server.SamplingParams(max_tokens=5000))
    outs: list = []
    async with trio.open_nursery() as nursery:

        async def consume() -> None:
            outs.extend(await all_outputs(stream))

        nursery.start_soon(consume)
        await wait_for(lambda: bool(outs) or victim.engine.running() > 0, timeout=60)
        victim.hang()
        await trio.testing.wait_all_tasks_blocked()  # (its last write has ended)
        await victim.inject(len(body).to_bytes(4, "big") + body)
    return outs


async def test_garbage_in_a_big_tokenize_answer_ends_the_session():
    async with open_fake_engine(workers=1, restart_backoff=0.05) as (engine, spawn):
        victim = spawn.processes[0]
        body = msgpack.packb([wire.RESULT, 99, {"tokens": IDS}, None]) + b"\xc1"
        assert len(body) >= wire.BIG_FRAME and wire.is_result(body)
        outs = await _inject_beside_a_stream(engine, spawn, body)
        assert outs[-1].finish_reason == "error"
        assert "protocol violation" in (outs[-1].error or "")
        await wait_for(lambda: engine.statistics().workers[0].restarts == 1, timeout=60)
        assert victim.exited


async def test_packed_ids_that_are_not_whole_uint32s_end_the_session():
    """In a big RESULT (decoded aside) or a small one (in the router)."""
    async with open_fake_engine(workers=1, restart_backoff=0.05) as (engine, spawn):
        stats = engine.statistics
        for restarts, size in enumerate((4 * len(IDS) + 1, 4 * wire.PACK_MIN + 3), 1):
            bad = msgpack.ExtType(wire.PACKED_IDS, b"\x01" * size)
            body = msgpack.packb([wire.RESULT, 99, {"tokens": bad}, None])
            assert (len(body) >= wire.BIG_FRAME) == (restarts == 1)
            await wait_for(lambda: engine.workers[0].alive, timeout=60)
            victim = spawn.processes[-1]
            outs = await _inject_beside_a_stream(engine, spawn, body)
            assert outs[-1].finish_reason == "error"
            assert "packed ids of" in (outs[-1].error or ""), outs[-1].error
            with trio.fail_after(60):
                while stats().workers[0].restarts != restarts:
                    await trio.sleep(0.01)
            assert victim.exited


async def test_big_answers_beyond_the_aside_bound_are_decoded_in_the_routers_way():
    """A worker sending more big RESULT frames than are decoded aside at once: the rest
    are decoded by the router itself, so the pipe pushes back instead of the frontend
    holding every frame in memory (answers nobody asked for are dropped)."""
    async with open_fake_engine(workers=1) as (engine, spawn):
        worker = spawn.processes[0]
        body = msgpack.packb([wire.RESULT, 10**6, {"tokens": IDS}, None])
        held = _Held()
        async with held as limiter:
            await trio.testing.wait_all_tasks_blocked()  # (the worker is not writing)
            for _ in range(_ASIDES + 2):
                await worker.inject(len(body).to_bytes(4, "big") + body)
            # a stream's outputs come after those frames on the pipe: when it is done, the
            # router has read them all
            with trio.fail_after(60):
                outs = await all_outputs(
                    engine.generate("a b", server.SamplingParams(max_tokens=3)))
            assert outs[-1].finish_reason == "length"
            assert limiter.statistics().tasks_waiting == _ASIDES
            held.release()
        await wait_for(lambda: engine.workers[0]._asides == 0, timeout=60)


async def test_a_big_answer_that_arrived_is_delivered_when_the_worker_exits_meanwhile():
    """The worker answers a big /tokenize and exits while the answer waits to be decoded:
    the answer arrived whole, so its waiter gets it, not the session's error."""
    async with open_fake_engine(workers=1, restart_backoff=0.05,
                                shutdown_grace=60) as (engine, spawn):
        async with _big_answer_waiting(engine, spawn) as (held, answer, got):
            worker = spawn.processes[0]
            worker.die(0)  # its pipe closes: the session ends
            await wait_for(lambda: worker.exited, timeout=60)
            await trio.testing.wait_all_tasks_blocked()  # (the router has ended)
            assert engine.statistics().workers[0].restarts == 0  # (its end waits)
            held.release()
        assert got == [answer]
        await wait_for(lambda: engine.statistics().workers[0].restarts == 1, timeout=60)


async def test_a_session_that_waits_for_a_big_answer_is_down_meanwhile():
    """While a session that ended waits for a big answer's decode (up to shutdown_grace),
    its worker is down: not picked nor asked anything, and the stream it held ends (or
    moves) at once, not when the decode is done (review: it waited the whole grace)."""
    async with open_fake_engine(workers=1, restart_backoff=0.05,
                                shutdown_grace=60) as (engine, spawn):
        async with _big_answer_waiting(engine, spawn) as (held, answer, got):
            worker = spawn.processes[0]
            stream = engine.generate("a b", server.SamplingParams(max_tokens=8000))
            outs: list = []
            with trio.fail_after(60):  # (it would wait for the held decode)
                async with trio.open_nursery() as nursery:

                    async def consume() -> None:
                        outs.extend(await all_outputs(stream))

                    nursery.start_soon(consume)
                    await wait_for(lambda: bool(outs) or worker.engine.running() > 0,
                                   timeout=60)
                    worker.die(0)
            assert outs[-1].finish_reason == "error" and "failed" in (outs[-1].error or "")
            front = engine.workers[0]
            assert not front.alive and not front.healthy()
            with pytest.raises(server.EngineError, match="not running"):
                await front.ping()
            assert not got and engine.statistics().workers[0].restarts == 0
            held.release()
        assert got == [answer]


async def test_a_session_ends_within_its_grace_while_a_big_answer_waits_to_be_decoded():
    """The grace a big answer's decode gets at a session's end is bounded (shutdown_grace):
    a decode that cannot run in it is cut off, and its waiter gets the session's error."""
    async with open_fake_engine(workers=1, restart_backoff=0.05,
                                shutdown_grace=0.05) as (engine, spawn):
        async with _big_answer_waiting(engine, spawn) as (held, _, got):
            spawn.processes[0].die(0)
            # the decoding thread never gets a token, yet the session ends
            await wait_for(lambda: engine.statistics().workers[0].restarts == 1, timeout=60)
            assert held.limiter.statistics().tasks_waiting == 0
        assert len(got) == 1 and isinstance(got[0], server.EngineError)
        assert "went away" in str(got[0])


async def test_an_older_worker_is_sent_id_lists_and_may_answer_them(monkeypatch):
    """A worker whose HELLO does not say ``packed_ids`` (an older one, to which packed ids
    are a bad extension value) gets long token-id prompts and detokenize ids as msgpack
    arrays, and is not asked for packed tokenize answers."""
    real = wire._unpack_ext

    def older(code: int, data: bytes):
        if code == wire.PACKED_IDS:
            raise ValueError(f"bad extension value (type {code})")
        return real(code, data)

    monkeypatch.setattr(wire, "_unpack_ext", older)
    monkeypatch.setattr(wire, "hello_info", lambda info: info)
    ids = list(range(wire.PACK_MIN + 1))
    async with open_fake_engine(workers=1) as (engine, spawn):
        assert not engine.workers[0].reads_packed
        asked: list = []

        def tokenize(request: dict) -> dict:
            asked.append(request)
            return {"tokens": ids, "max_model_len": 8192}

        spawn.processes[0].engine.tokenize = tokenize
        assert (await engine.tokenize({"op": "tokenize", "prompt": "x"}))["tokens"] == ids
        await engine.tokenize({"op": "detokenize", "tokens": ids})
        flag = {wire.ERROR_PARAM_KEY: True}  # (every frontend asks refusals to name the field)
        assert asked == [{"op": "tokenize", "prompt": "x", **flag},
                         {"op": "detokenize", "tokens": ids, **flag}]
        with trio.fail_after(60):
            outs = await all_outputs(engine.generate(ids, server.SamplingParams(max_tokens=2)))
        assert outs[-1].finish_reason == "length" and outs[0].prompt_tokens == len(ids)
        assert engine.statistics().workers[0].restarts == 0
