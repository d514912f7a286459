"""The request body of a generation route (server.http.asgi.read_body), on the Trio memory
channel hypercorn queues it in: what is queued is taken at once, the rest awaited under
the body's timeout; the limit and a disconnect end it either way."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from server.errors import BodyTimeout, PayloadTooLarge
from server.http.asgi import read_body

SCOPE = {"headers": []}


def _part(data: bytes, more: bool = True) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


def _queued(*messages: dict):
    send, receive = trio.open_memory_channel(len(messages) + 1)
    for message in messages:
        send.send_nowait(message)
    return send, receive.receive


async def test_a_body_waiting_in_the_queue_is_read_without_a_scheduler_trip():
    _, receive = _queued(_part(b"ab"), _part(b"c"), _part(b"", more=False))
    with trio.testing.assert_no_checkpoints():
        assert await read_body(SCOPE, receive, 100, 30.0) == b"abc"
    _, receive = _queued(_part(b"ab"), _part(b"c", more=False))
    assert await read_body(SCOPE, receive, 100, 30.0, keep=False) == b""


async def test_the_rest_of_a_body_is_awaited_after_what_was_queued():
    send, receive = _queued(_part(b"ab"))

    async def rest():
        await trio.testing.wait_all_tasks_blocked()
        await send.send(_part(b"cd"))
        await trio.testing.wait_all_tasks_blocked()
        await send.send(_part(b"e", more=False))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rest)
            assert await read_body(SCOPE, receive, 100, 30.0) == b"abcde"


async def _send_later(send, messages: list[dict]) -> None:
    await trio.testing.wait_all_tasks_blocked()
    for message in messages:
        await send.send(message)


@pytest.mark.parametrize("queued", [True, False])
async def test_the_limit_and_a_disconnect_end_a_body_queued_or_not(queued):
    for messages, expected in (
        ([_part(b"x" * 60), _part(b"x" * 60, more=False)], PayloadTooLarge),
        ([_part(b"x" * 10), {"type": "http.disconnect"}], None),
    ):
        send, receive = _queued(*(messages if queued else []))
        async with trio.open_nursery() as nursery:
            if not queued:
                nursery.start_soon(_send_later, send, messages)
            with trio.fail_after(30):
                if expected is PayloadTooLarge:
                    with pytest.raises(PayloadTooLarge):
                        await read_body(SCOPE, receive, 100, 30.0)
                else:
                    assert await read_body(SCOPE, receive, 100, 30.0) is None


async def test_a_body_that_stops_arriving_ends_at_its_timeout(autojump_clock):
    _, receive = _queued(_part(b"ab"))
    start = trio.current_time()
    with pytest.raises(BodyTimeout):
        await read_body(SCOPE, receive, 100, 5.0)
    assert trio.current_time() - start == pytest.approx(5.0)
