"""A big answer in parts (issue 23; server.worker_protocol.parts): a pipe worker sends a
RESULT of ``wire.BIG_FRAME`` or more as PART frames, a few per pass of its loop, so the
STEP frames of the other streams go between them; the frontend joins them back.

Sans-IO for the splitting, joining and refusing; one real transformers worker (tiny model)
for the whole path, its frames recorded on the pipe. Every ``fail_after`` is a hang guard.
"""

from __future__ import annotations

import contextlib
import os
import random

import msgpack
import pytest
import trio

from server import EngineConfig, SamplingParams, open_engine
from server.worker_protocol import parts, wire
from server.worker_protocol.wire import OutputRow
from server.workers.base import EngineBroken
from server.workers.main import serve
from server.engines.sim.engine import SimEngine
from tests.fakes import open_real_engine

LIMIT = 240  # seconds: a test that starts a process importing torch (busy CI cores)


def _tokenized(n: int, seq: int = 5) -> bytes:
    """A RESULT frame answering ``seq`` with ``n`` ids, packed as a worker packs it."""
    result = {"tokens": wire.pack_ids(list(range(n))), "count": n, "max_model_len": 64}
    return wire.encode([wire.RESULT, seq, result, None])


BIG = (wire.BIG_FRAME // 4) + 1000  # ids enough for a big answer (4 bytes an id, packed)


def _feed_in_pieces(decoder: wire.FrameDecoder, data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    bodies: list[bytes] = []
    pos = 0
    while pos < len(data):
        step = rng.choice((1, 7, 4096, 100_000, 700_000))
        bodies += decoder.frames(data[pos:pos + step])
        pos += step
    return bodies


@pytest.mark.parametrize("seed", range(3))
def test_parts_are_joined_into_the_frame_they_came_from_in_the_place_of_the_last(seed):
    big = _tokenized(BIG)
    pieces = list(parts.split(big))
    assert len(pieces) == -(-(len(big) - 4) // parts.PART_BYTES) > 1
    assert all(len(p) - 4 < wire.BIG_FRAME for p in pieces)  # each decoded inline
    # STEP frames between the parts, as a worker's loop writes them.
    steps = [wire.encode([wire.STEP, [], [[i, "x", 1, None, None]]]) for i in range(len(pieces))]
    stream = b"".join(step + piece for step, piece in zip(steps, pieces))
    decoder = parts.PartsDecoder(wire.check_reply)
    bodies = _feed_in_pieces(decoder, stream, seed)
    assert decoder.buffered == 0
    assert [b.startswith(wire.RESULT_HEAD) for b in bodies] == [False] * len(steps) + [True]
    assert bytes(bodies[-1]) == big[4:]
    assert wire.decode_sliced(bodies[-1]) == msgpack.unpackb(big[4:], ext_hook=wire._unpack_ext)
    assert [decoder.decode(b)[2][0][0] for b in bodies[:-1]] == list(range(len(steps)))


def test_the_joined_pieces_count_as_buffered_so_the_router_sees_a_big_frame_coming():
    pieces = list(parts.split(_tokenized(BIG)))
    decoder = parts.PartsDecoder()
    assert decoder.frames(pieces[0]) == []
    assert decoder.buffered == wire.BIG_FRAME  # (one piece: 256 KiB joined)
    assert decoder.frames(b"".join(pieces[1:-1])) == []
    assert decoder.buffered == max((len(pieces) - 1) * parts.PART_BYTES, wire.BIG_FRAME)
    assert len(decoder.frames(pieces[-1])) == 1 and decoder.buffered == 0


def test_a_worker_loop_writes_a_few_parts_per_pass_and_answers_in_order():
    written: list[bytes] = []
    queue = parts.PartQueue(written.append)
    first, second = _tokenized(BIG, seq=1), _tokenized(BIG, seq=2)
    queue.add(first)
    queue.add(second)
    passes = 0
    while queue.pending():
        before = len(written)
        queue.write_some()
        passes += 1
        assert len(written) - before <= parts.PARTS_PER_PASS
    total = len(list(parts.split(first))) + len(list(parts.split(second)))
    assert len(written) == total and passes == -(-total // parts.PARTS_PER_PASS)
    bodies = parts.PartsDecoder().frames(b"".join(written))
    assert [bytes(b) for b in bodies] == [first[4:], second[4:]]


def test_a_pile_of_big_answers_is_written_down_to_the_bound_at_once():
    written: list[bytes] = []
    queue = parts.PartQueue(written.append)
    frame = _tokenized(BIG)
    each = len(list(parts.split(frame)))
    for _ in range(parts.MAX_QUEUED_PARTS // each + 2):
        queue.add(frame)
    total = each * (parts.MAX_QUEUED_PARTS // each + 2)
    queue.write_some()
    assert len(written) == total - parts.MAX_QUEUED_PARTS  # over the bound: pushed back
    queue.write_some()
    assert len(written) == total - parts.MAX_QUEUED_PARTS + parts.PARTS_PER_PASS


def test_flush_writes_every_part_left():
    written: list[bytes] = []
    queue = parts.PartQueue(written.append)
    queue.add(_tokenized(BIG))
    queue.write_some(1)
    queue.flush()
    assert not queue.pending()
    assert len(parts.PartsDecoder().frames(b"".join(written))) == 1


def test_only_big_answers_go_in_parts():
    assert parts.is_big_answer(_tokenized(BIG))
    assert not parts.is_big_answer(_tokenized(100))
    big_step = wire.encode([wire.STEP, [], [[1, "x" * wire.BIG_FRAME, 1, None, None]]])
    assert not parts.is_big_answer(big_step)  # STEPs keep their order: never in parts


@pytest.mark.parametrize("message", [
    [wire.PART, "text", False],
    [wire.PART, b"x"],
    [wire.PART, b"x", 1],
    [wire.PART, b"x", False, None],
])
def test_a_malformed_part_is_a_protocol_violation_after_the_good_frames(message):
    good = wire.encode([wire.PONG, 1, 0, 0])
    decoder = parts.PartsDecoder(wire.check_reply)
    with pytest.raises(wire.ProtocolError, match="(malformed|unexpected) PART") as info:
        decoder.feed(good + wire.encode(message))
    assert info.value.messages == [[wire.PONG, 1, 0, 0]]


def test_an_undecodable_part_is_a_protocol_violation():
    body = b"\x93" + msgpack.packb(wire.PART) + b"\xc1"  # 0xc1: never used in msgpack
    decoder = parts.PartsDecoder(wire.check_reply)
    with pytest.raises(wire.ProtocolError, match="undecodable"):
        decoder.feed(len(body).to_bytes(4, "big") + body)


def test_parts_that_never_end_are_cut_at_the_frame_limit(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME", 3 * parts.PART_BYTES)
    piece = wire.encode([wire.PART, bytes(parts.PART_BYTES), True])
    decoder = parts.PartsDecoder(wire.check_reply)
    decoder.feed(piece * 3)
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        decoder.feed(piece)


def test_a_frontend_that_did_not_ask_for_parts_refuses_them():
    decoder = wire.FrameDecoder(wire.check_reply)  # a remote worker's link
    with pytest.raises(wire.ProtocolError, match="unexpected PART"):
        decoder.feed(next(parts.split(_tokenized(BIG))))


class _TokenizingSim(SimEngine):
    """The sim, with a tokenizer that answers every tokenize with :data:`IDS` (5 bytes an
    id on the wire: the answer goes in about 20 parts)."""

    def tokenize(self, request: dict) -> dict:
        return {"tokens": IDS, "count": len(IDS), "max_model_len": 8192}


IDS = list(range(70_000, 70_000 + 1_000_000))


class _BreakingSim(_TokenizingSim):
    """Breaks at its first step after answering a tokenize (parts of it still queued)."""

    answered = broke = False

    def tokenize(self, request: dict) -> dict:
        self.answered = True
        return super().tokenize(request)

    def step(self, now: float) -> list:
        if self.answered:
            self.broke = True
            raise EngineBroken("broken", [OutputRow(1, "", 0, "error", ["engine_error", "x"])])
        return super().step(now)


async def _run_loop(shutdown: str, engine: SimEngine | None = None
                    ) -> tuple[list[int], list]:
    """The worker's own loop (server.workers.main.serve, in a thread) on a sim that steps
    every pass (``itl_ms=0``), running one long request; once it runs, a CALL; then a
    SHUTDOWN: ``"answered"`` once the answer arrived, ``"first part"`` at its first PART,
    ``"together"`` in the same write as the CALL. Returns the kinds of the frames the
    worker sent, and the answers (joined)."""
    engine = engine or _TokenizingSim(itl_ms=0.0, ttft_ms=0.0, prefill_us_per_token=0.0)
    to_worker, worker_in = os.pipe()
    worker_out, from_worker = os.pipe()
    params = SamplingParams(max_tokens=8000, ignore_eos=True).to_wire()  # (8,192 at most)
    os.write(worker_in, wire.encode([wire.SUBMIT, 1, "hi", params]))
    kinds: list[int] = []
    answers: list = []
    tokenize = wire.encode([wire.CALL, 9, {"op": "tokenize"}])
    stop = wire.encode([wire.SHUTDOWN])

    def run_worker() -> None:
        try:
            serve(engine, to_worker, from_worker, parts=True)
        finally:
            os.close(from_worker)

    async def read_frames() -> None:
        decoder = wire.FrameDecoder()  # sees the PARTs as they are
        joiner = parts.PartsDecoder()
        asked = stopped = False
        async with trio.lowlevel.FdStream(worker_out) as stream:
            while data := await stream.receive_some(1 << 16):
                for message in decoder.feed(data):
                    kinds.append(message[0])
                    if message[0] == wire.STEP and not asked:  # running: ask
                        asked = True
                        os.write(worker_in, tokenize + stop if shutdown == "together"
                                 else tokenize)
                    elif message[0] == wire.PART and shutdown == "first part" and not stopped:
                        stopped = True
                        os.write(worker_in, stop)
                answers.extend(joiner.decode_sliced(b) for b in joiner.frames(data)
                               if b.startswith(wire.RESULT_HEAD))
                if answers and shutdown == "answered" and not stopped:
                    stopped = True
                    os.write(worker_in, stop)

    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_frames)
                with contextlib.suppress(EngineBroken):  # (_BreakingSim's)
                    await trio.to_thread.run_sync(run_worker)
    finally:
        os.close(worker_in)
        os.close(to_worker)
    return kinds, answers


async def test_a_worker_loop_writes_its_steps_between_the_parts_of_a_big_answer():
    """A STEP goes between every :data:`parts.PARTS_PER_PASS` parts (counted on the
    frames, not timed)."""
    kinds, answers = await _run_loop("answered")
    assert len(answers) == 1 and answers[0][2]["tokens"] == IDS
    first = kinds.index(wire.PART)
    last = len(kinds) - kinds[::-1].index(wire.PART)
    run = 0
    for kind in kinds[first:last]:  # never more than one pass's parts in a row
        run = run + 1 if kind == wire.PART else 0
        assert run <= parts.PARTS_PER_PASS
    assert kinds[first:last].count(wire.PART) >= len(IDS) * 5 // parts.PART_BYTES
    assert wire.RESULT not in kinds


async def test_an_engine_that_breaks_lets_the_answers_made_go_first():
    engine = _BreakingSim(itl_ms=0.0, ttft_ms=0.0, prefill_us_per_token=0.0)
    kinds, answers = await _run_loop("never", engine)
    assert len(answers) == 1 and answers[0][2]["tokens"] == IDS
    assert engine.broke and kinds[-1] == wire.STEP and wire.PART in kinds  # the last: its end


@pytest.mark.parametrize("shutdown", ["first part", "together"])
async def test_a_shutdown_after_a_tokenize_still_gets_its_whole_answer_out(shutdown):
    kinds, answers = await _run_loop(shutdown)
    assert len(answers) == 1 and answers[0][2]["tokens"] == IDS
    assert (wire.PART in kinds) == (shutdown == "first part")  # else in one frame, at once


async def test_a_real_worker_sends_a_big_answer_in_parts_that_the_frontend_joins(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.tiny_model import build_tiny_model
    from transformers import AutoTokenizer

    path = build_tiny_model(tmp_path / "tiny", max_position_embeddings=4096)
    prompt = "a" * (BIG + 50_000)  # one id per "a" with this tokenizer: checked below
    expected = AutoTokenizer.from_pretrained(path)(prompt, add_special_tokens=False)["input_ids"]
    assert len(expected) * 4 >= wire.BIG_FRAME
    # Tokenized in the worker's preparation thread, not in its helper process: a big RESULT
    # goes in parts whichever made it (the helper's big answers: test_worker_prepare.py),
    # and the helper's start-up (it imports transformers, so torch) was most of this test.
    config = EngineConfig(engine="transformers", drain_timeout=5.0, startup_timeout=LIMIT,
                          engine_options={"model_path": str(path), "num_threads": 1,
                                          "prepare_process": False})
    with trio.fail_after(LIMIT):
        async with open_real_engine(config) as (engine, spawn):
            # A stream running meanwhile, ended (its rows are not what this test shows:
            # test_a_worker_loop_writes_its_steps_between_the_parts_of_a_big_answer is).
            params = SamplingParams(max_tokens=4000, ignore_eos=True)
            async with engine.generate("hi", params) as stream:
                assert await stream.__anext__()
                answer = await engine.tokenize(
                    {"op": "tokenize", "prompt": prompt, "add_special_tokens": False})
                assert answer["tokens"] == expected
                kinds = [f.msg[0] for f in spawn.sent]
                assert kinds.count(wire.PART) >= len(expected) * 4 // parts.PART_BYTES
                assert wire.RESULT not in kinds  # the answer came in parts only
                await stream.aclose()


# -- a listening worker (server.workers.listen), to a connection that subscribed ------------


class _StoppableSim(_TokenizingSim):
    """Breaks at its next step once ``stop`` is set: how a test ends a listening worker's
    loop (EngineBroken comes out of ``Server.run`` after the errors went out)."""

    stop = False

    def next_deadline(self):
        return 0.0 if self.stop else super().next_deadline()

    def step(self, now: float) -> list:
        if self.stop:
            raise EngineBroken("the test is over", [])
        return super().step(now)


@contextlib.asynccontextmanager
async def _listening_sim():
    """A listening worker's loop on a :class:`_StoppableSim`, in a thread of this process,
    on a loopback port (no secret: loopback only); yields ``(server, address)``."""
    import socket

    from server.worker_protocol.handshake import WorkerAddress
    from server.workers.listen import Server

    engine = _StoppableSim(itl_ms=0.0, ttft_ms=0.0, prefill_us_per_token=0.0)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    server = Server(engine, listener, secret=None, tls=None, frontend_timeout=30.0,
                    max_buffer=64 << 20)
    port = listener.getsockname()[1]

    def run() -> None:
        try:
            server.run()
        except EngineBroken:
            pass
        finally:
            server.close()
            listener.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, run)
        try:
            yield server, WorkerAddress(host="127.0.0.1", port=port, path=None)
        finally:
            engine.stop = True
            # Wakes the loop, asleep when idle with no connection. A loop that woke on
            # its own (the last frontend leaving) may have closed its listener with this
            # connection in the backlog: refused or reset, it has stopped either way.
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                pass


def _by_hand(address, subscribe: bool) -> tuple[list[int], list, dict]:
    """A frontend by hand on a blocking socket: the handshake, SUBSCRIBE ["parts"] if
    ``subscribe``, a long request, and once it runs a CALL. Returns the kinds of the
    frames the worker sent until the answer was whole, the answers (joined) and the
    worker's HELLO info."""
    import socket

    sock = socket.create_connection((address.host, address.port), timeout=60)
    raw = wire.FrameDecoder()  # sees the PARTs as they are
    joiner = parts.PartsDecoder()
    kinds: list[int] = []
    answers: list = []
    pending: list[list] = []

    def receive() -> bytes:
        data = sock.recv(1 << 16)
        assert data, "the worker closed the connection"
        return data

    try:
        while not pending:
            pending.extend(raw.feed(receive()))
        assert pending.pop(0)[0] == wire.CHALLENGE
        sock.sendall(wire.encode([wire.AUTH, os.urandom(32), None]))
        while not pending:
            pending.extend(raw.feed(receive()))
        hello = pending.pop(0)
        assert hello[0] == wire.HELLO, hello
        joiner.frames(b"")  # (nothing buffered: the HELLO went to `raw` alone)
        params = SamplingParams(max_tokens=8000, ignore_eos=True).to_wire()
        sock.sendall((wire.encode([wire.SUBSCRIBE, [wire.PARTS_TOPIC]]) if subscribe else b"")
                     + wire.encode([wire.SUBMIT, 1, "hi", params]))
        asked = False
        while not answers:
            data = receive()
            for message in raw.feed(data):
                kinds.append(message[0])
                if message[0] == wire.STEP and not asked:
                    asked = True
                    sock.sendall(wire.encode([wire.CALL, 9, {"op": "tokenize"}]))
            answers.extend(joiner.decode_sliced(b) for b in joiner.frames(data)
                           if b.startswith(wire.RESULT_HEAD))
        sock.sendall(wire.encode([wire.ABORT, 1]))
    finally:
        sock.close()
    return kinds, answers, hello[1]


async def test_a_listening_worker_sends_big_answers_in_parts_to_a_connection_that_asked():
    """A connection that subscribed to parts gets a big RESULT as PART frames, with its
    STEPs between every :data:`parts.PARTS_PER_PASS` of them (counted on the frames, not
    timed); one that did not gets it whole."""
    with trio.fail_after(LIMIT):
        async with _listening_sim() as (_, address):
            kinds, answers, info = await trio.to_thread.run_sync(_by_hand, address, True)
            assert info[wire.PARTS_KEY] is True
            assert len(answers) == 1 and answers[0][2]["tokens"] == IDS
            assert wire.RESULT not in kinds
            first = kinds.index(wire.PART)
            run = 0
            for kind in kinds[first:]:  # never more than one pass's parts in a row
                run = run + 1 if kind == wire.PART else 0
                assert run <= parts.PARTS_PER_PASS
            assert kinds.count(wire.PART) >= len(IDS) * 5 // parts.PART_BYTES
            assert kinds[first:].count(wire.STEP) >= kinds.count(wire.PART) // 4 - 1

            kinds, answers, _ = await trio.to_thread.run_sync(_by_hand, address, False)
            assert len(answers) == 1 and answers[0][2]["tokens"] == IDS
            assert wire.PART not in kinds and wire.RESULT in kinds


async def test_a_frontend_subscribes_to_a_listening_workers_parts_and_joins_them():
    """The frontend's session asks a listening worker that offers parts for them, and its
    link joins them: the answer is whole and right."""
    from tests.remote import remote_config

    class _At:  # (what remote_config reads of a listening worker)
        def __init__(self, address) -> None:
            self.address = address

    with trio.fail_after(LIMIT):
        async with _listening_sim() as (server, address):
            async with open_engine(remote_config(_At(address), secret=None)) as engine:
                answer = await engine.tokenize({"op": "tokenize", "prompt": "hi"})
                assert answer["tokens"] == IDS
                assert [c.parts is not None for c in server.conns] == [True]
