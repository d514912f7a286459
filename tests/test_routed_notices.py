"""Routed notices: several frontends sharing workers tell each other, through the worker,
which prompts' blocks they sent it (docs/routing.md, "Several frontends"), so that a text or
chat conversation's follow-up that reaches another frontend still goes to the worker holding
its first turn.

Sans-IO: the router's prediction fed with notices, against the same router routing the
prompt itself; the messages' shapes (a SUBMIT's block names, SUBSCRIBE, the notice), which
only a listening worker takes. End to end: two real listening sim workers (with their
prefix cache) shared by two frontends; a conversation's first turn through one, its
follow-up through the other lands on the same worker, and the sim reports it cached.
"""

from __future__ import annotations

import re
from contextlib import asynccontextmanager

import pytest
import trio

from server import EngineConfig, SamplingParams, ServerError
from server.manager.engine import Engine, open_engine
from server.manager.routing import NAMING
from server.manager.transport import open_connected
from server.manager.routing import Router
from server.observability.metrics import _routing_families
from server.worker_protocol import wire
from tests.remote import listening_worker, remote_config, wait_until
from tests.test_routing_processes import conversation

LIMIT = 120
NAME = b"12345678"
TOPIC = wire.routed_topic(NAMING)


def test_a_notice_predicts_as_if_the_router_had_routed_the_prompt():
    a, b = Router(2, block_chars=32), Router(2, block_chars=32)
    first = a.blocks(conversation("Ann", 1))
    follow_up = a.blocks(conversation("Ann", 2))
    assert len(first.hashes) > 4 and follow_up.hashes[:len(first.hashes)] == first.hashes
    other = a.blocks(conversation("Bob", 1))
    a.routed(1, other.hashes)
    b.noticed(1, other.hashes)
    a.routed(1, first.hashes)
    b.noticed(1, first.hashes)
    # the same blocks in the same LRU order
    assert list(b.indexes[1]._blocks) == list(a.indexes[1]._blocks)
    assert b.stats.notices == [0, 2] and a.stats.notices == [0, 0]
    assert b.stats.routed == [0, 0]  # (a notice is not a decision)
    decision = b.pick(follow_up.hashes, [0, 0])
    assert decision is not None and decision.worker == 1 and decision.reason == "prefix"
    assert decision.matched == len(first.hashes)
    # without it: a new conversation, by load (the lowest index on a tie)
    decision = Router(2).pick(follow_up.hashes, [0, 0])
    assert decision is not None and decision.worker == 0 and decision.reason == "load"
    # bounded as routing is, and forgotten with a restart
    small = Router(1, capacity=3, block_chars=32)
    small.noticed(0, first.hashes)
    assert len(small.indexes[0]) == 3 and small.indexes[0].match(first.hashes) == 0
    b.reset(1)
    assert b.indexes[1].match(first.hashes) == 0


async def test_a_notice_after_a_restart_clears_the_prediction_first():
    """A notice of the worker's new session, arriving before any routing decision saw the
    restart: the old session's blocks go, the notice's stay (through the engine's
    WorkerClient.noticed, as a session calls it)."""
    engine = Engine(EngineConfig(workers=2, routing="prefix"))
    router = engine.router
    old = router.blocks(conversation("Ann", 1)).hashes
    new = router.blocks(conversation("Bob", 1)).hashes
    router.routed(0, old)
    assert router.indexes[0].match(old) == len(old)
    engine.workers[0].generation += 1  # (its session ended; a new one began)
    engine.workers[0].noticed(0, new)
    assert router.indexes[0].match(old) == 0
    assert router.indexes[0].match(new) == len(new)
    assert router.stats.notices == [1, 0]
    engine.workers[1].noticed(1, old)  # (no restart: nothing forgotten)
    engine.workers[0].noticed(0, old)
    assert router.indexes[0].match(new) == len(new)


async def test_a_session_that_ended_leaves_no_routed_notices_on(tmp_path):
    """Whether a worker passes notices on is its session's: false while it is down (the
    next session's worker may be another, or an older one)."""
    with trio.fail_after(LIMIT):
        async with listening_worker(tmp_path, "127.0.0.1:0", name="w0") as w0:
            config = remote_config(w0, routing="prefix")
            async with open_engine(config) as engine:
                worker = engine.workers[0]
                assert worker.routed_notices
                w0.proc.kill()  # (its session ends: the connection closes)
                await wait_until(lambda: not worker.alive, 30)
                assert not worker.routed_notices


def test_block_names_and_subscriptions_only_to_a_listening_worker():
    names = [NAME, b"abcdefgh"]
    good = [
        [wire.SUBMIT, 1, "p", {}, None, names],
        [wire.SUBMIT, 1, {"messages": []}, {}, "adapter", names],
        [wire.SUBMIT, 1, "p", {}, None, [NAME] * wire.ROUTED_MAX],
        [wire.SUBSCRIBE, [TOPIC]],
        [wire.SUBSCRIBE, ["routed/999999"]],
        [wire.SUBSCRIBE, [wire.PARTS_TOPIC]],  # (big answers in parts: test_answer_parts)
        [wire.SUBSCRIBE, [TOPIC, wire.PARTS_TOPIC]],
    ]
    for message in good:
        assert wire.check_listener_request(message) is message
        with pytest.raises(wire.ProtocolError):  # a pipe worker has one frontend
            wire.check_request(message)
    for message in (
        [wire.SUBMIT, 1, "p", {}, None, [b"short"]],
        [wire.SUBMIT, 1, "p", {}, None, [NAME] * (wire.ROUTED_MAX + 1)],
        [wire.SUBMIT, 1, "p", {}, 3, names],
        [wire.SUBMIT, 1, "p", {}, None, "names"],
        [wire.SUBSCRIBE, []],
        [wire.SUBSCRIBE, [TOPIC] * 9],  # (at most 8 topics)
        [wire.SUBSCRIBE, ["everything"]],
        [wire.SUBSCRIBE, ["routed/1", "routed/2"]],  # (a connection's names: one naming)
        [wire.SUBSCRIBE, ["routed/1", "parts", "routed/2"]],
        [wire.SUBSCRIBE, ["parts/1"]],
        [wire.SUBSCRIBE, [b"parts"]],
        [wire.SUBSCRIBE, ["routed"]],  # (of no naming)
        [wire.SUBSCRIBE, ["routed/0"]],
        [wire.SUBSCRIBE, ["routed/01"]],
        [wire.SUBSCRIBE, ["routed/1000000"]],
        [wire.SUBSCRIBE, [TOPIC.encode()]],
        [wire.SUBSCRIBE, TOPIC],
        [wire.SUBSCRIBE, [TOPIC], 1],
    ):
        with pytest.raises(wire.ProtocolError):
            wire.check_listener_request(message)
    # the notice, a note of no request's
    step = [wire.STEP, [], [], [[None, {"routed": names}]]]
    assert wire.check_reply(step) is step
    for bad in ([b"short"], [NAME] * (wire.ROUTED_MAX + 1), NAME):
        with pytest.raises(wire.ProtocolError):
            wire.check_reply([wire.STEP, [], [], [[None, {"routed": bad}]]])
    with pytest.raises(wire.ProtocolError):  # a request's note it is not
        wire.check_reply([wire.STEP, [], [], [[1, {"routed": names}]]])


async def cached_on(engine, prompt) -> tuple[int, int | None]:
    """(the worker that ran ``prompt``, its cached_tokens)."""
    async with engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0)) as s:
        async for _ in s:
            pass
        choice = s.choice_states()[0]
        return choice.worker.index, choice.cached_tokens


@asynccontextmanager
async def raw_frontend(config, worker, *, subscribe: str | None = None):
    """A frontend by hand on ``worker``'s wire (a Link, after the handshake), subscribed
    to the topic ``subscribe``: it sends and reads only what the test says."""
    link = await open_connected(config, worker.address, None)
    try:
        await link.handshake()
        if subscribe is not None:
            await link.send.send_all(wire.encode([wire.SUBSCRIBE, [subscribe]]))
        yield link
    finally:
        await link.aclose(0)


async def until_pong(link, seq: int) -> list[list]:
    """PING ``seq``: the messages the worker sent ``link`` before its PONG."""
    await link.send.send_all(wire.encode([wire.PING, seq]))
    seen: list[list] = []
    data = b""
    while True:
        for message in link.decoder.feed(data):
            if message[0] == wire.PONG and message[1] == seq:
                return seen
            seen.append(message)
        data = await link.receive.receive_some(1 << 16)
        assert data, "the worker closed the connection"


def routed_notes(messages: list[list]) -> list:
    """The routed notices among ``messages``."""
    return [note["routed"] for m in messages if m[0] == wire.STEP and len(m) > 3
            for rid, note in m[3] if rid is None and "routed" in note]


async def test_a_follow_up_through_another_frontend_goes_where_its_first_turn_went(
        tmp_path):
    args = ("--sim-prefix-cache-tokens", "100000", "--sim-prefix-block-size", "4",
            "--frontend-timeout", "300")  # (the raw frontend speaks only at the end)
    with trio.fail_after(LIMIT):
        async with listening_worker(tmp_path, "127.0.0.1:0", *args, name="w0") as w0, \
                listening_worker(tmp_path, "127.0.0.1:0", *args, name="w1") as w1:
            config = remote_config(w0, w1, routing="prefix")
            async with open_engine(config) as a, open_engine(config) as b, \
                    raw_frontend(config, w0) as older:  # (it never subscribes)
                assert all(w.routed_notices for w in (*a.workers, *b.workers))
                await a.ping_all()  # (each one's SUBSCRIBE has reached both workers)
                await b.ping_all()
                # frontend a: one conversation each (its recent decisions count as load)
                assert await cached_on(a, conversation("Ann", 1)) == (0, 0)
                assert await cached_on(a, conversation("Bob", 1)) == (1, 0)
                # (Ann's and Bob's notices come over different connections: either first)
                await wait_until(lambda: b.router.stats.notices == [1, 1], 30)
                bob = b.router.blocks(conversation("Bob", 1)).hashes
                assert b.router.indexes[1].match(bob) == len(bob)
                # a frontend that did not subscribe (an older one) was told nothing: what
                # worker 0 sent it before answering its ping, after b had Ann's notice
                assert routed_notes(await until_pong(older, 1)) == []
                # frontend b never routed Bob's first turn: his follow-up goes to worker 1
                worker, cached = await cached_on(b, conversation("Bob", 2))
                assert worker == 1 and cached is not None and cached >= 120
                assert b.router.stats.decisions["prefix"] == 1
                # and a hears of b's: not of its own
                await wait_until(lambda: a.router.stats.notices == [0, 1], 30)
                families = {f.name: f for f in _routing_families([("sim", b.router.stats)])}
                notices = {s.labels["worker"]: s.value
                           for s in families["trio_llm:routing_notices"].samples}
                assert notices == {"0": 1, "1": 1}


async def test_a_lone_frontend_is_sent_no_notices_and_least_loaded_sends_no_names(
        tmp_path):
    """A frontend that routes by load neither sends block names nor subscribes: the
    prefix-routing frontend beside it hears nothing. A SUBMIT's names beside an adapter
    leave the adapter to the engine."""
    args = ("--sim-prefix-cache-tokens", "100000", "--sim-prefix-block-size", "4")
    with trio.fail_after(LIMIT):
        async with listening_worker(tmp_path, "127.0.0.1:0", *args, name="w0") as w0, \
                listening_worker(tmp_path, "127.0.0.1:0", *args, name="w1") as w1:
            async with open_engine(remote_config(w0, w1, routing="least-loaded")) as a, \
                    open_engine(remote_config(w0, w1, routing="prefix")) as b:
                assert not any(w.routed_notices for w in a.workers)
                await b.ping_all()
                assert await cached_on(a, conversation("Cy", 1)) == (0, 0)
                # (a's request has ended: a fresh count of each worker's, so that b's load
                # holds no heartbeat answer of one sent while a's ran)
                await b.ping_all()
                assert await cached_on(b, "x " * 300) == (0, 0)  # (after a's, on worker 0)
                assert b.router.stats.notices == [0, 0]
                # names beside an adapter: the worker takes the adapter (the sim has none)
                params = SamplingParams(max_tokens=2)
                with pytest.raises(ServerError, match="'ad' does not exist"):
                    async with b.generate_many(["y " * 300], params, adapter="ad") as s:
                        async for _ in s:
                            pass
                worker, cached = await cached_on(b, "x " * 350)  # (still connected)
                assert worker == 0 and cached is not None and cached >= 280


@pytest.mark.parametrize(("max_buffer", "count", "sent"), [
    (1_000_000, wire.ROUTED_MAX, 40),  # big notices: a few fill the socket, then its buffer
    (100_000, 300, 400),  # small ones, many read in one pass: counted as they are queued
])
async def test_a_subscriber_that_does_not_read_is_skipped_not_dropped(
        tmp_path, max_buffer, count, sent):
    """Notices are hints: another frontend's SUBMITs fill a subscriber that does not read
    up to a quarter of --max-buffer-bytes, then are skipped for it; it is not dropped for
    not reading, and reads what it was sent when it reads again."""
    path = tmp_path / "w.sock"  # (unix socket buffers are small: the worker's fills soon)
    async with listening_worker(tmp_path, f"unix:{path}", "--max-buffer-bytes",
                                str(max_buffer), "--frontend-timeout", "300",
                                secret=None) as w:
        config = remote_config(w, secret=None)
        with trio.fail_after(LIMIT):
            async with raw_frontend(config, w, subscribe=TOPIC) as slow, \
                    raw_frontend(config, w, subscribe=TOPIC) as sender:
                await until_pong(slow, 1)  # (its SUBSCRIBE is in)
                params = SamplingParams(max_tokens=1).to_wire(0)
                names = [i.to_bytes(8, "big") for i in range(count)]
                await sender.send.send_all(b"".join(  # (at once: many read in one pass)
                    wire.encode([wire.SUBMIT, rid, "p", params, None, names])
                    for rid in range(sent)))
                finished = 0  # (every SUBMIT handled: every notice queued or skipped)
                while finished < sent:
                    data = await sender.receive.receive_some(1 << 16)
                    assert data, w.text()
                    finished += sum(row[3] is not None for m in sender.decoder.feed(data)
                                    if m[0] == wire.STEP for row in m[2])
                # ... and slow, still connected, reads a few of them
                received = routed_notes(await until_pong(slow, 2))
                assert 0 < len(received) < sent and received[0] == names
    assert re.search(rf"skipped {sent - len(received)} routed notice\(s\)", w.text()), \
        w.text()
    assert "not reading" not in w.text()


async def test_notices_go_only_to_the_frontends_of_the_same_naming(tmp_path):
    """A SUBMIT's names are of its sender's naming (its topic): they reach the frontends
    subscribed to that one only, never one of another naming (a future version's names
    would push valid entries out of its index); a sender that did not subscribe has named
    no naming, and its names go nowhere."""
    with trio.fail_after(LIMIT):
        async with listening_worker(tmp_path, "127.0.0.1:0", "--frontend-timeout", "300",
                                    name="w0") as w0:
            config = remote_config(w0)
            async with raw_frontend(config, w0, subscribe=TOPIC) as same, \
                    raw_frontend(config, w0, subscribe="routed/99") as other, \
                    raw_frontend(config, w0, subscribe=TOPIC) as sender, \
                    raw_frontend(config, w0) as unsubscribed, \
                    raw_frontend(config, w0) as older:
                for link in (same, other, sender, unsubscribed):  # (each SUBSCRIBE is in)
                    await until_pong(link, 1)
                params = SamplingParams(max_tokens=1).to_wire(0)
                await unsubscribed.send.send_all(
                    wire.encode([wire.SUBMIT, 1, "p", params, None, [b"unnamed."]]))
                await until_pong(unsubscribed, 2)  # (handled)
                await sender.send.send_all(
                    wire.encode([wire.SUBMIT, 1, "p", params, None, [NAME]]))
                await until_pong(sender, 2)
                assert routed_notes(await until_pong(same, 2)) == [[NAME]]
                assert routed_notes(await until_pong(other, 2)) == []
                assert routed_notes(await until_pong(sender, 3)) == []
                assert routed_notes(await until_pong(older, 1)) == []
