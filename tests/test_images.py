"""Image parts end to end on the sim engine (issue 46): chat ``image_url`` and Responses
``input_image`` parts fetched by the frontend (server.http.images), carried to the worker
as bytes with their SHA-256, counted as prompt tokens (``--sim-image-tokens``).

Real servers (``running_server``), real worker processes, the openai SDK; http URLs are
served by the test on loopback, real time.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import struct
import zlib

import httpx
import openai
import pytest
import trio

from server.config import EngineConfig
from server.manager.routing import canonical_text
from tests.conftest import FAST_SIM, JSON, running_server

#: Prompt tokens the sim counts per image here.
IMAGE_TOKENS = 7
IMAGES = EngineConfig(engine_options={**FAST_SIM, "image_tokens": IMAGE_TOKENS,
                                      "images_per_prompt": 2})
#: A loopback image server, listed and let through (the switch needs the list).
LOOPBACK = {"allowed_media_domains": ("127.0.0.1",), "allow_private_media_addresses": True}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(rgb: tuple[int, int, int], width: int = 3, height: int = 2, rows: bytes | None = None
        ) -> bytes:
    """A real RGB PNG of one colour (``rows``: other pixel data, e.g. too little)."""
    if rows is None:
        rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b""))


RED, BLUE = png((255, 0, 0)), png((0, 0, 255))


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_part(url: str, **more) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


class ImageServer:
    """HTTP on 127.0.0.1 port 0: answers every GET with ``body`` as a PNG, counting them."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.requests = 0
        self.port = 0

    def url(self, path: str = "/a.png") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                data = await stream.receive_some(4096)
                if not data:
                    return
                head += data
            self.requests += 1
            await self._answer(stream)

    async def _answer(self, stream: trio.SocketStream) -> None:
        """Answer a GET whose head has arrived."""
        await stream.send_all(
            f"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: "
            f"{len(self.body)}\r\nConnection: close\r\n\r\n".encode() + self.body)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)


async def chat_tokens(client, content, **kw) -> tuple[int, str]:
    """usage.prompt_tokens and the text of a greedy 6-token chat answer."""
    r = await client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": content}], max_tokens=6,
        temperature=0, **kw)
    return r.usage.prompt_tokens, r.choices[0].message.content


async def refused(coro) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        await coro
    return caught.value.body


async def test_a_data_url_image_is_counted_and_reaches_the_worker():
    with trio.fail_after(60):
        async with running_server(IMAGES) as url:
            client = client_of(url)
            text_only, _ = await chat_tokens(client, [{"type": "text", "text": "describe"}])
            red = [{"type": "text", "text": "describe"}, image_part(data_url(RED))]
            tokens, red_answer = await chat_tokens(client, red)
            assert tokens == text_only + IMAGE_TOKENS
            # the answer depends on the image's bytes (the sim renders its digest)
            blue = [{"type": "text", "text": "describe"}, image_part(data_url(BLUE))]
            assert (await chat_tokens(client, blue))[1] != red_answer
            assert (await chat_tokens(client, red))[1] == red_answer
            # detail: accepted as OpenAI spells it (no effect), refused by name otherwise
            high = [{"type": "text", "text": "describe"},
                    image_part(data_url(RED), detail="high")]
            assert await chat_tokens(client, high) == (tokens, red_answer)
            body = await refused(chat_tokens(client, [image_part(data_url(RED),
                                                                 detail="huge")]))
            assert body["param"] == "messages[0].content[0].image_url.detail"
            # an image in earlier turns of a conversation counts too
            r = await client.chat.completions.create(model="sim", max_tokens=2, messages=[
                {"role": "user", "content": red}, {"role": "assistant", "content": "red"},
                {"role": "user", "content": "and now?"}])
            assert r.usage.prompt_tokens > IMAGE_TOKENS


def image_cache(m, worker: str = "0") -> tuple[float, float]:
    """The image-cache lookups and hits ``/metrics`` reports for ``worker``."""
    return (m.value("trio_llm:mm_cache_queries_total", worker=worker),
            m.value("trio_llm:mm_cache_hits_total", worker=worker))


def reports_image_cache(m, worker: str = "0") -> bool:
    return "trio_llm:mm_cache_queries" in m.families and any(
        s.labels.get("worker") == worker for s in m.families["trio_llm:mm_cache_queries"].samples)


async def test_metrics_count_the_image_caches_lookups_and_hits():
    """A pipe worker (told by its argument that its frontend reads them) reports its image
    cache's counters in each PONG; ``/metrics`` exports them as vLLM names them."""
    from tests.test_metrics import scrape

    with trio.fail_after(60):
        async with running_server(IMAGES) as url:
            client = client_of(url)
            text = [{"type": "text", "text": "describe"}]
            for content in ([*text, image_part(data_url(RED))],  # a miss
                            [*text, image_part(data_url(BLUE))],  # a miss
                            [image_part(data_url(RED)), image_part(data_url(BLUE))],  # 2 hits
                            text):  # (no image: no lookup)
                await chat_tokens(client, content)
            # (what a PONG says: the next heartbeat's answer has them)
            m = await scrape(url, until=lambda m: reports_image_cache(m) and image_cache(m) == (
                4.0, 2.0), timeout=30)
            assert m.families["trio_llm:mm_cache_hits"].type == "counter"


async def test_an_http_url_is_fetched_only_when_its_host_is_allowed():
    server = ImageServer(RED)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            content = [{"type": "text", "text": "describe"}, image_part(server.url())]
            async with running_server(IMAGES, **LOOPBACK) as url:
                client = client_of(url)
                tokens, answer = await chat_tokens(client, content)
                assert server.requests == 1
                assert (tokens, answer) == await chat_tokens(
                    client, [{"type": "text", "text": "describe"}, image_part(data_url(RED))])
            async with running_server(IMAGES) as url:  # loopback not allowed: the default
                client = client_of(url)
                body = await refused(chat_tokens(client, content))
                assert body["param"] == "messages[0].content[1].image_url.url"
                assert body["code"] == "media_refused" and "loopback" in body["message"]
                assert server.requests == 1  # (nothing fetched)
                assert url.app.metrics.of("sim").prompt_tokens_total == 0  # nor sent
            nursery.cancel_scope.cancel()


async def test_two_images_and_one_too_many():
    with trio.fail_after(60):
        async with running_server(IMAGES) as url:
            client = client_of(url)
            one, _ = await chat_tokens(client, [image_part(data_url(RED))])
            two, answer = await chat_tokens(client, [image_part(data_url(RED)),
                                                     image_part(data_url(BLUE))])
            assert two == one + IMAGE_TOKENS
            swapped = await chat_tokens(client, [image_part(data_url(BLUE)),
                                                 image_part(data_url(RED))])
            assert swapped[1] != answer  # in order
            body = await refused(client.chat.completions.create(model="sim", messages=[
                {"role": "user", "content": [image_part(data_url(RED))]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "and"},
                                             image_part(data_url(RED)),
                                             image_part(data_url(BLUE))]}]))
            assert body["param"] == "messages[2].content[2]"  # the third image of the prompt
            assert body["code"] == "too_many_images"
            # a part of another image type than OpenAI's: refused by its shape, not as if
            # the model took no images
            body = await refused(chat_tokens(client, [{"type": "image", "image": "x"}]))
            assert body["param"] == "messages[0].content[0]"
            assert "image_url" in body["message"] and "text only" not in body["message"]


async def test_an_engine_without_images_refuses_naming_the_part_and_the_model():
    server = ImageServer(RED)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with running_server(**LOOPBACK) as url:  # the sim at its default: text only
                client = client_of(url)
                for part in (image_part(server.url()), image_part(data_url(RED))):
                    body = await refused(chat_tokens(client, [{"type": "text", "text": "x"},
                                                              part]))
                    assert body["param"] == "messages[0].content[1]"
                    assert "model 'sim' takes text only" in body["message"]
                body = await refused(client.responses.create(model="sim", input=[
                    {"role": "user", "content": [{"type": "input_image",
                                                  "image_url": server.url()}]}]))
                assert body["param"] == "input[0].content[0]"
                assert "model 'sim' takes text only" in body["message"]
                assert server.requests == 0  # refused before any fetch
            nursery.cancel_scope.cancel()


async def test_responses_input_image():
    with trio.fail_after(60):
        async with running_server(IMAGES) as url:
            client = client_of(url)
            text = {"type": "input_text", "text": "describe"}
            plain = await client.responses.create(model="sim", max_output_tokens=4,
                                                  input=[{"role": "user", "content": [text]}])
            r = await client.responses.create(model="sim", max_output_tokens=4, input=[
                {"role": "user", "content": [text, {"type": "input_image", "detail": "low",
                                                    "image_url": data_url(RED)}]}])
            assert r.usage.input_tokens == plain.usage.input_tokens + IMAGE_TOKENS
            for part, param, code in [
                ({"file_id": "file-1"}, "input[0].content[1].file_id", "unsupported_parameter"),
                ({"image_url": "http://127.0.0.1:9/a.png"}, "input[0].content[1].image_url",
                 "media_refused"),
                ({"image_url": data_url(RED), "detail": "huge"}, "input[0].content[1].detail",
                 None),
            ]:
                body = await refused(client.responses.create(model="sim", input=[
                    {"role": "user", "content": [text, {"type": "input_image", **part}]}]))
                assert (body["param"], body["code"]) == (param, code), part


async def test_the_minimal_body():
    with trio.fail_after(60):
        async with running_server(IMAGES) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/chat/completions", headers=JSON, json={
                    "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": data_url(RED)}}]}]})
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                # "<|user|>", the image's tokens, "<|assistant|>"
                assert usage["prompt_tokens"] == 2 + IMAGE_TOKENS


def test_the_router_names_an_image_by_its_digest():
    def prompt(data: bytes, digest: str) -> dict:
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image", "data": data, "sha256": digest}]}]}

    text = canonical_text(prompt(b"\x89PNG" * 1000, "ab" * 32))
    assert text is not None and "ab" * 32 in text and "PNG" not in text
    assert text == canonical_text(prompt(b"other bytes", "ab" * 32))
    assert text != canonical_text(prompt(b"\x89PNG" * 1000, "cd" * 32))


def test_the_vllm_engines_images_are_bounded_before_they_are_decoded():
    """server.engines.vllm.images without vLLM: the parts split out in order, a
    decompression bomb refused by its header (naming its part), a non-image refused."""
    pytest.importorskip("PIL")
    from server.engines.vllm.images import decode_images, split_images
    from server.workers.base import Rejected

    prompt = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image", "data": RED, "sha256": "x"},
        {"type": "image", "data": BLUE, "sha256": "y"}]}]}
    rendered, images = split_images(prompt)
    assert rendered["messages"][1]["content"] == [{"type": "text", "text": "a"},
                                                  {"type": "image"}, {"type": "image"}]
    assert images == [(RED, "messages[1].content[1]"), (BLUE, "messages[1].content[2]")]
    assert [i.size for i in decode_images(images)] == [(3, 2), (3, 2)]
    bomb = png((0, 0, 0), 9000, 9000, rows=bytes(64))
    with pytest.raises(Rejected) as caught:  # (its rows are not there: never decompressed)
        decode_images([(bomb, "messages[0].content[1]")], max_pixels=8192 * 8192)
    assert caught.value.param == "messages[0].content[1]"
    assert "9000 x 9000 pixels" in str(caught.value)
    with pytest.raises(Rejected) as caught:
        decode_images([(b"GIF89a not really", "messages[0].content[0]")])
    assert caught.value.param == "messages[0].content[0]"
    # the prompt's images together: each within its own bound, the second past the
    # prompt's, refused by its header before any image is decompressed
    big = png((0, 0, 0), 6000, 6000, rows=bytes(64))
    with pytest.raises(Rejected) as caught:
        decode_images([(big, "messages[0].content[0]"), (big, "messages[0].content[1]")])
    assert caught.value.param == "messages[0].content[1]"
    assert "together" in str(caught.value)


def test_the_vllm_engine_keys_images_by_their_checked_digest_and_skips_known_ones():
    """server.engines.vllm.images without vLLM: each image's SHA-256 (vLLM's uuid for it,
    the key of its caches) checked against its bytes; an image vLLM holds processed is
    header-checked like any other but not decompressed (None in its place)."""
    pytest.importorskip("PIL")
    import hashlib

    from server.engines.vllm.images import decode_images, image_digests
    from server.workers.base import Rejected

    red, blue = hashlib.sha256(RED).hexdigest(), hashlib.sha256(BLUE).hexdigest()
    prompt = {"messages": [{"role": "user", "content": [
        {"type": "image", "data": RED, "sha256": red}, {"type": "text", "text": "a"},
        {"type": "image", "data": BLUE, "sha256": blue}]}]}
    assert image_digests(prompt) == [red, blue]
    prompt["messages"][0]["content"][2]["sha256"] = red  # (another image's digest)
    with pytest.raises(Rejected) as caught:
        image_digests(prompt)
    assert caught.value.param == "messages[0].content[2]"
    images = [(RED, "messages[0].content[0]"), (BLUE, "messages[0].content[2]")]
    first, second = decode_images(images, skip={0})
    assert first is None and second.size == (3, 2)
    bomb = png((0, 0, 0), 9000, 9000, rows=bytes(64))
    with pytest.raises(Rejected) as caught:  # (known or not, the same refusal)
        decode_images([(bomb, "messages[0].content[0]")], skip={0})
    assert caught.value.param == "messages[0].content[0]"


async def test_a_client_that_goes_away_cancels_its_fetch():
    """A fetch runs under the request's cancellation monitor: the client's disconnect
    closes the fetch's connection at once (the image server sees its end), long before
    --media-fetch-timeout, and the fetch slot is free again."""
    asked, closed = trio.Event(), trio.Event()

    async def stall(stream: trio.SocketStream) -> None:
        async with stream:
            asked.set()
            while await stream.receive_some(4096):  # (until the fetcher hangs up)
                pass
            closed.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, stall, 0,
                                                              host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            async with running_server(IMAGES, media_fetch_timeout=3600.0, **LOOPBACK) as url:
                body = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": [
                    image_part(f"http://127.0.0.1:{port}/slow.png")]}]}
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    async with trio.open_nursery() as client:
                        client.start_soon(functools.partial(
                            http.post, "/v1/chat/completions", json=body))
                        await asked.wait()
                        client.cancel_scope.cancel()  # (the client hangs up mid-fetch)
                await closed.wait()
                while url.app.media.statistics().borrowed_tokens:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()


async def test_a_pool_of_text_and_vision_workers_sends_images_to_the_vision_ones(tmp_path):
    """Two listening workers, the first text only: the pool takes image parts (a vision
    worker says it does), and round robin sends every image request to the vision worker
    (the text one would refuse it), while text requests go to both."""
    from contextlib import AsyncExitStack

    from tests.remote import listening_worker, remote_config
    from tests.test_metrics import scrape

    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            text = await stack.enter_async_context(listening_worker(tmp_path, name="text"))
            vision = await stack.enter_async_context(listening_worker(
                tmp_path, "127.0.0.1:0", "--sim-image-tokens", str(IMAGE_TOKENS), name="vision"))
            config = remote_config(text, vision, routing="round-robin")
            async with running_server(config) as url:
                client = client_of(url)
                for _ in range(2):  # one to each worker
                    plain, _ = await chat_tokens(client, [{"type": "text", "text": "describe"}])
                red = [{"type": "text", "text": "describe"}, image_part(data_url(RED))]
                for _ in range(4):  # (round robin alone would alternate)
                    assert (await chat_tokens(client, red))[0] == plain + IMAGE_TOKENS
                # the vision worker's image cache: the frontend subscribed to its counters
                # (the text worker has none: no image family for it)
                m = await scrape(url, timeout=30, until=lambda m: reports_image_cache(
                    m, "1") and image_cache(m, "1") == (4.0, 3.0))
                assert not reports_image_cache(m, "0")
                async with httpx.AsyncClient() as http:
                    metrics = (await http.get(url + "/metrics")).text
    # text requests went to both workers (round robin), image requests to the vision one
    served = {line.split('worker="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines()
              if line.startswith("trio_llm:routed_requests_total{")}
    assert served == {"0": 1.0, "1": 5.0}, served


async def test_a_listening_worker_sends_image_counters_to_a_connection_that_asked_only(
        tmp_path):
    """A frontend by hand: before it subscribes to ``image_stats``, the worker's PONGs hold
    no image counters (an older frontend would refuse them); after, they count its image."""
    from server.worker_protocol import wire
    from tests.remote import listening_worker

    digest = hashlib.sha256(RED).hexdigest()
    prompt = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe"}, {"type": "image", "data": RED, "sha256": digest}]}]}
    with trio.fail_after(120):
        async with listening_worker(tmp_path, "127.0.0.1:0", "--sim-image-tokens",
                                    str(IMAGE_TOKENS), secret=None) as worker:
            address = worker.address
            stream = await trio.open_tcp_stream(address.host, address.port)
            decoder = wire.FrameDecoder()
            frames: list = []

            async def next_of(kind: int) -> list:
                while True:
                    while frames:
                        frame = frames.pop(0)
                        if frame[0] == kind and (kind != wire.PONG or frame[1]):
                            return frame
                    data = await stream.receive_some(1 << 16)
                    assert data, "the worker closed the connection"
                    frames.extend(decoder.feed(data))

            async with stream:
                await next_of(wire.CHALLENGE)
                await stream.send_all(wire.encode([wire.AUTH, bytes(32), None]))
                hello = await next_of(wire.HELLO)
                assert hello[1][wire.IMAGE_STATS_KEY] is True
                await stream.send_all(wire.encode([wire.SUBMIT, 1, prompt, {"max_tokens": 1}]))
                await next_of(wire.STEP)
                await stream.send_all(wire.encode([wire.PING, 1]))
                assert not isinstance((await next_of(wire.PONG))[-1], dict)
                await stream.send_all(wire.encode([wire.SUBSCRIBE, [wire.IMAGE_STATS_TOPIC]])
                                      + wire.encode([wire.PING, 2]))
                assert (await next_of(wire.PONG))[-1] == {"mm_cache_queries": 1,
                                                          "mm_cache_hits": 0}


@contextlib.asynccontextmanager
async def serving_from(server: ImageServer, per_prompt: int, **options):
    """``server`` running, and the app on the sim taking ``per_prompt`` images a prompt,
    loopback allowed (``options``: more of the app's); yields the app's URL."""
    config = EngineConfig(engine_options={**FAST_SIM, "image_tokens": IMAGE_TOKENS,
                                          "images_per_prompt": per_prompt})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with running_server(config, **LOOPBACK, **options) as url:
            yield url
        nursery.cancel_scope.cancel()


class HeldImageServer(ImageServer):
    """An :class:`ImageServer` that answers no GET until ``hold`` have arrived (never, by
    default); counts the connections the fetcher closed while held."""

    def __init__(self, body: bytes, hold: float = float("inf")) -> None:
        super().__init__(body)
        self.hold = hold
        self.arrived = trio.Event()
        self.closed = 0

    async def _answer(self, stream: trio.SocketStream) -> None:
        if self.requests >= self.hold:
            self.arrived.set()
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                if not await stream.receive_some(1):  # the fetcher hung up
                    self.closed += 1
                nursery.cancel_scope.cancel()
            nursery.start_soon(watch)
            await self.arrived.wait()
            nursery.cancel_scope.cancel()
        if self.requests >= self.hold:
            await super()._answer(stream)


async def test_a_requests_images_are_fetched_at_once():
    """Two URLs whose server answers neither until both are asked: fetched one after the
    other, the first would wait out --media-fetch-timeout and be a 400."""
    server = HeldImageServer(RED, hold=2)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with running_server(IMAGES, **LOOPBACK, media_fetch_timeout=20) as url:
                client = client_of(url)
                plain, _ = await chat_tokens(client, [{"type": "text", "text": "describe"}])
                tokens, _ = await chat_tokens(client, [
                    {"type": "text", "text": "describe"}, image_part(server.url("/a.png")),
                    image_part(server.url("/b.png"))])
                assert tokens == plain + 2 * IMAGE_TOKENS and server.requests == 2
            nursery.cancel_scope.cancel()


async def test_a_refused_image_cancels_the_requests_other_fetches():
    """The first URL's server never answers, the second URL's host is not allowed: the
    request is a 400 naming the second at once, and the first fetch is cancelled (its
    connection closed), not left to --media-fetch-timeout."""
    server = HeldImageServer(RED)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            async with running_server(IMAGES, **LOOPBACK, media_fetch_timeout=30) as url:
                client = client_of(url)
                body = await refused(chat_tokens(client, [
                    image_part(server.url()), image_part("http://not-listed.invalid/a.png")]))
                assert body["param"] == "messages[0].content[1].image_url.url"
                assert body["code"] == "media_refused"
                with trio.fail_after(20):  # (a hang guard: the close follows the 400)
                    while server.closed < server.requests:
                        await trio.sleep(0.02)
            nursery.cancel_scope.cancel()


class BigAndHeldServer(HeldImageServer):
    """``/big.png`` is answered at once with ``body``; every other GET is held (never
    answered) and counted in ``closed`` when the fetcher hangs up."""

    async def _handle(self, stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(4096)
            if not data:
                await stream.aclose()
                return
            head += data
        if head.startswith(b"GET /big.png "):
            async with stream:
                await stream.send_all(
                    f"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: "
                    f"{len(self.body)}\r\nConnection: close\r\n\r\n".encode() + self.body)
            return
        async with stream:
            self.requests += 1
            if not await stream.receive_some(1):  # the fetcher hung up
                self.closed += 1


async def test_images_past_the_requests_bytes_are_refused_as_soon_as_known():
    """Three 20 MB images pass the bytes a request's images may have together
    (server.http.images.MAX_IMAGE_BYTES, 56 MiB): the 400 comes once they are in, and the
    fetch still under way is cancelled, not waited for (it would time out: a 400
    media_timeout)."""
    from server.http.images import MAX_IMAGE_BYTES

    big = RED + bytes(20_000_000 - len(RED))
    assert 2 * len(big) <= MAX_IMAGE_BYTES < 3 * len(big)
    server = BigAndHeldServer(big)
    with trio.fail_after(60):
        async with serving_from(server, 4, media_fetch_timeout=40) as url:
            held = image_part(server.url("/held.png"))
            body = await refused(chat_tokens(client_of(url), [
                held, *[image_part(server.url("/big.png"))] * 3]))
            assert body["code"] == "media_too_large", body
            assert body["param"] in [f"messages[0].content[{j}]" for j in (1, 2, 3)]
            with trio.fail_after(20):  # (a hang guard: the close follows the 400)
                while server.closed < server.requests:
                    await trio.sleep(0.02)


async def test_one_request_fetches_at_most_four_images_at_a_time():
    """Five URLs whose server answers none until five are asked: the request's fifth fetch
    waits for one of the first four (the server's fetch slots are for every request), so
    they wait out --media-fetch-timeout and the request is a 400 with four asked."""
    from server.http.images import FETCHES_PER_REQUEST

    server = HeldImageServer(RED, hold=FETCHES_PER_REQUEST + 1)
    with trio.fail_after(60):
        async with serving_from(server, 8, media_fetch_timeout=3) as url:
            body = await refused(chat_tokens(client_of(url), [
                image_part(server.url(f"/{k}.png")) for k in range(FETCHES_PER_REQUEST + 1)]))
            assert body["code"] == "media_timeout", body
            assert server.requests == FETCHES_PER_REQUEST
