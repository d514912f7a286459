"""A stored response keeps the bytes its image URLs gave (server.http.responses_images): a
later turn (``previous_response_id``) replays them instead of fetching the URLs again.

Real servers on the sim (it answers by the image's digest and checks the bytes against
it), the openai SDK, images served by the test on loopback (allowed explicitly), real
time; on SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import random

import openai
import pytest
import trio

from server.http.responses_images import IMAGES_KIND
from tests.conftest import running_server
from tests.postgres_server import STORES, state_options
from tests.test_images import BLUE, IMAGES, LOOPBACK, RED, ImageServer, client_of, data_url, png

#: An image of 48 KiB that does not compress: past a quota that a text response fits in.
BIG = png((0, 0, 0), 128, 128, rows=random.Random(46).randbytes(49152))


@pytest.fixture(params=STORES)
def store_options(request, tmp_path) -> dict:
    return state_options(request, tmp_path, "si")


class ChangingImageServer(ImageServer):
    """An image server whose URL can stop answering (a presigned URL that expired: 404)."""

    gone = False

    async def _answer(self, stream: trio.SocketStream) -> None:
        if self.gone:
            await stream.send_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                                  b"Connection: close\r\n\r\n")
        else:
            await super()._answer(stream)


def first_turn(*urls: str) -> list:
    return [{"role": "user", "content": [{"type": "input_text", "text": "describe"}, *(
        {"type": "input_image", "image_url": url} for url in urls)]}]


async def ask(client: openai.AsyncOpenAI, input, **more):
    """A stored response of 4 greedy tokens."""
    return await client.responses.create(model="sim", max_output_tokens=4, temperature=0,
                                         input=input, **more)


async def chain(client: openai.AsyncOpenAI, turns: int, *urls: str) -> list:
    """The answers of a chain of ``turns`` stored turns, the first with the images."""
    answers = [await ask(client, first_turn(*urls))]
    for _ in range(turns - 1):
        answers.append(await ask(client, "and now?", previous_response_id=answers[-1].id))
    return answers


@contextlib.asynccontextmanager
async def serving(image: bytes, store_options: dict, **options):
    """An image server on loopback answering ``image``, and a server that may fetch from
    it, storing in ``store_options``' store: (image server, server URL, client)."""
    server = ChangingImageServer(image)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with running_server(IMAGES, **LOOPBACK, **store_options, **options) as url:
                yield server, url, client_of(url)
            nursery.cancel_scope.cancel()


async def test_a_follow_up_replays_the_kept_image_not_its_url(store_options):
    """The URL gone (404), then answering another image: the later turns see the first
    turn's image, without a fetch."""
    async with serving(RED, store_options) as (server, url, client):
        red = [r.output_text for r in await chain(client, 3, data_url(RED))]
        blue = [r.output_text for r in await chain(client, 3, data_url(BLUE))]
        assert red[1:] != blue[1:]  # (the answers tell the images apart)
        first = await ask(client, first_turn(server.url()))
        assert (server.requests, first.output_text) == (1, red[0])
        server.gone = True
        second = await ask(client, "and now?", previous_response_id=first.id)
        assert second.output_text == red[1]
        server.gone, server.body = False, BLUE  # the URL now names another image
        # (the second turn's record kept it again)
        third = await ask(client, "and now?", previous_response_id=second.id)
        assert third.output_text == red[2]
        assert server.requests == 1
        # the items still name the URL the client sent, not the bytes
        items = await client.responses.input_items.list(third.id, order="asc")
        assert items.data[0].content[1].image_url == server.url()


async def test_a_background_response_keeps_its_images_beside_data_urls(store_options):
    """A background response keeps the bytes of its http URL; its data: URL, first, is
    replayed from the items."""
    async with serving(RED, store_options) as (server, url, client):
        expected = await chain(client, 2, data_url(BLUE), data_url(RED))
        first = await ask(client, first_turn(data_url(BLUE), server.url()), background=True)
        while first.status in ("queued", "in_progress"):
            await trio.sleep(0.05)
            first = await client.responses.retrieve(first.id)
        assert first.output_text == expected[0].output_text
        kept = await url.app.state_store.get(IMAGES_KIND, "", first.id)
        assert kept.body == RED  # (the data: URL's bytes are in the items)
        server.gone = True
        second = await ask(client, "and now?", previous_response_id=first.id)
        assert second.output_text == expected[1].output_text
        assert server.requests == 1


async def test_a_response_stored_without_kept_images_fetches_again(store_options):
    """A response a server before this one stored (no images record beside it): a later
    turn fetches its URLs, as it did then."""
    async with serving(RED, store_options) as (server, url, client):
        first = await ask(client, first_turn(server.url()))
        assert await url.app.state_store.delete(IMAGES_KIND, "", first.id)
        await ask(client, "and now?", previous_response_id=first.id)
        assert server.requests == 2


async def test_kept_images_count_against_the_quota_and_go_with_their_response(store_options):
    async with serving(BIG, store_options) as (server, url, client):
        part = {"type": "input_image", "image_url": server.url()}
        two = [{"role": "user", "content": [part, part]}]
        store = url.app.state_store
        text = await ask(client, "describe")
        text_only = (await store.read_statistics()).bytes
        await client.responses.delete(text.id)
        r = await ask(client, two)
        # the same image twice is kept once
        assert (await store.get(IMAGES_KIND, "", r.id)).body == BIG
        assert (await store.read_statistics()).bytes > len(BIG)
        await client.responses.delete(r.id)
        assert (await store.read_statistics()).bytes == 0
    # a quota that the text response fits in, and the image does not
    quota = len(BIG) // 2
    assert text_only < quota
    async with serving(BIG, store_options, state_max_bytes_per_key=quota) as (
            server, url, client):
        part = {"type": "input_image", "image_url": server.url()}
        with pytest.raises(openai.APIStatusError) as caught:
            await ask(client, [{"role": "user", "content": [part]}])
        assert caught.value.status_code == 413
        assert caught.value.body["code"] == "storage_quota_exceeded"
        assert (await url.app.state_store.read_statistics()).bytes == 0  # (nor its response)
        kept = await ask(client, "describe")
        assert (await client.responses.retrieve(kept.id)).id == kept.id


def test_a_kept_images_record_maps_each_part_and_refuses_one_that_does_not_add_up():
    """Sans-IO: each input_image part of the items maps to its kept bytes in order (None
    for a data: URL), the same image stored once; a record whose meta and body disagree
    (a blob longer than the body) gives nothing, so that every URL is fetched again."""
    from dataclasses import replace

    from server.http.responses_images import images_record, kept_of

    urls = ["http://a/red.png", data_url(BLUE), "HTTPS://b/red.png"]
    items = [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": url} for url in urls]}]
    digests = {RED: "r" * 64, BLUE: "b" * 64}
    wire = [{"type": "image", "data": image, "sha256": digests[image]}
            for image in (RED, BLUE, RED)]
    prompts = [{"messages": [{"role": "user", "content": wire}]}]
    record = images_record(items, prompts, "owner", "resp_1", 0)
    assert record is not None and record.body == RED
    assert kept_of(record) == [(RED, "r" * 64), None, (RED, "r" * 64)]
    assert kept_of(replace(record, body=RED[:-1])) == []
    assert images_record(items, [{"messages": []}], "owner", "resp_1", 0) is None
