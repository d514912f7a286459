"""The Batch API (/v1/batches; server/http/batches.py, server/batches/): the create body's
and the list's refusals (sans-IO), then the openai SDK end to end through a real server on
the sim, on SQLite and PostgreSQL: files.create, batches.create to completion polled with
batches.retrieve, the output and error files read with files.content and matched by
custom_id, cancel, list, another key's 404; and a server SIGKILLed in the middle of a batch
whose restart on the same store (either backend) finishes it with every line exactly
once."""

from __future__ import annotations

import io
import json
import logging
import signal
import time

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from server.batches.objects import (
    COMPLETION_WINDOW_S, output_line, parse_create, parse_list_query,
)
from server.errors import ClientError
from server.manager.batch_priority import BATCH_PRIORITY, batch_priority
from server.config import EngineConfig
from server.state import Record, StateConfig, open_state_store
from server.worker_protocol import wire
from tests.conftest import FAST_SIM, running_server
from tests.postgres_server import STORES, state_options
from tests.test_shutdown import cli_server

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "sim", "prompt": "hi", "max_tokens": 3},
    "/v1/embeddings": {"model": "sim", "input": "hi"},
    "/v1/responses": {"model": "sim", "input": "hi", "max_output_tokens": 3},
}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def requests(url: str, n: int, body: dict | None = None, prefix: str = "r") -> list[dict]:
    return [{"custom_id": f"{prefix}{i}", "method": "POST", "url": url,
             "body": body or BODIES[url]} for i in range(n)]


def client_of(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def upload(client, lines: list[dict]):
    return await client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))),
                                     purpose="batch")


async def wait_status(client, batch_id: str, statuses=("completed",), timeout: float = 60):
    with trio.fail_after(timeout):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            assert batch.status not in ("failed", "expired", "cancelled"), batch
            await trio.sleep(0.05)


async def read_lines(client, file_id: str | None) -> dict[str, dict]:
    """custom_id -> output line, checking that each custom_id appears once."""
    if file_id is None:
        return {}
    text = (await client.files.content(file_id)).text
    lines = [json.loads(line) for line in text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id appears more than once"
    return by_id


# -- sans-IO ------------------------------------------------------------------------------


GOOD = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}


@pytest.mark.parametrize("change, param", [
    ({"completion_window": "48h"}, "completion_window"),
    ({"endpoint": "/v1/moderations"}, "endpoint"),
    ({"output_expires_after": {"anchor": "created_at", "seconds": 3600}},
     "output_expires_after"),
    ({"priority": 1}, "priority"),
    ({"input_file_id": None}, "input_file_id"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
])
def test_a_create_body_is_refused_naming_its_field(change, param):
    with pytest.raises(ClientError) as info:
        parse_create({**GOOD, **change})
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("missing", ["input_file_id", "endpoint", "completion_window"])
def test_a_create_body_without_a_required_field_is_refused(missing):
    body = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(ClientError) as info:
        parse_create(body)
    assert info.value.param == missing and info.value.code == "missing_required_parameter"


def test_the_minimal_create_body_and_metadata_at_its_limits():
    created = parse_create(GOOD)
    assert (created.input_file_id, created.endpoint, created.metadata) == \
        ("file-1", "/v1/chat/completions", None)
    metadata = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert parse_create({**GOOD, "metadata": metadata}).metadata == metadata


@pytest.mark.parametrize("query, param", [
    ({"limit": ["0"]}, "limit"), ({"limit": ["101"]}, "limit"), ({"limit": ["²"]}, "limit"),
    ({"order": ["asc"]}, "order"), ({"after": ["a", "b"]}, "after"),
])
def test_the_list_query_refuses_naming_the_parameter(query, param):
    with pytest.raises(ClientError) as info:
        parse_list_query(query)
    assert info.value.param == param


def test_the_list_query_defaults():
    assert parse_list_query({}).limit == 20
    assert parse_list_query({"limit": ["100"], "after": ["batch_x"]}).after == "batch_x"


# -- the openai SDK end to end ------------------------------------------------------------


@pytest.fixture(params=STORES)
def store_options(request, tmp_path) -> dict:
    """Where one test's server keeps its state: SQLite, or PostgreSQL (tests/postgres_server.py)."""
    return state_options(request, tmp_path, "b")


async def test_a_batch_of_each_endpoint_runs_to_completion(store_options):
    async with running_server(**store_options) as url:
        client = client_of(url)
        for endpoint in BODIES:
            bad = {"custom_id": "bad", "method": "POST", "url": endpoint,
                   "body": {**BODIES[endpoint], "model": "no-such-model"}}
            streamed = {"custom_id": "streamed", "method": "POST", "url": endpoint,
                        "body": {**BODIES[endpoint], "stream": True}}
            lines = requests(endpoint, 3) + [bad, streamed]
            file = await upload(client, lines)
            batch = await client.batches.create(input_file_id=file.id, endpoint=endpoint,
                                                completion_window="24h",
                                                metadata={"job": "nightly"})
            assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
            assert batch.request_counts.total == 5
            done = await wait_status(client, batch.id)
            assert done.request_counts.model_dump() == {"total": 5, "completed": 3, "failed": 2}
            assert done.completed_at and done.in_progress_at and done.finalizing_at
            assert done.expires_at == done.created_at + 24 * 3600
            outputs = await read_lines(client, done.output_file_id)
            assert sorted(outputs) == ["r0", "r1", "r2"]
            for line in outputs.values():
                response = line["response"]
                assert response["status_code"] == 200 and line["error"] is None
                assert response["request_id"] and line["id"].startswith("batch_req_")
            expected = {"/v1/chat/completions": "chat.completion",
                        "/v1/completions": "text_completion", "/v1/embeddings": "list",
                        "/v1/responses": "response"}[endpoint]
            assert outputs["r0"]["response"]["body"]["object"] == expected
            errors = await read_lines(client, done.error_file_id)
            assert sorted(errors) == ["bad", "streamed"]
            assert errors["bad"]["response"]["status_code"] == 404
            assert errors["streamed"]["response"]["body"]["error"]["param"] == "stream"
            output_file = await client.files.retrieve(done.output_file_id)
            assert output_file.purpose == "batch_output"


async def test_create_refusals_through_the_sdk():
    async with running_server() as url:
        client = client_of(url)
        file = await upload(client, requests("/v1/completions", 2))
        with pytest.raises(openai.BadRequestError) as info:  # a line of another endpoint
            await client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
        assert info.value.body["param"] == "input_file_id"
        with pytest.raises(openai.BadRequestError) as info:
            await client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                        completion_window="1h")  # type: ignore[arg-type]
        assert info.value.body["param"] == "completion_window"
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                                        completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")


async def test_a_batch_belongs_to_its_key():
    async with running_server(api_keys=("key-a", "key-b")) as url:
        a, b = client_of(url, "key-a"), client_of(url, "key-b")
        file = await upload(a, requests("/v1/chat/completions", 2))
        batch = await a.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        with pytest.raises(openai.NotFoundError):  # b cannot use a's file either
            await b.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            await b.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            await b.batches.cancel(batch.id)
        assert [x.id async for x in b.batches.list()] == []
        done = await wait_status(a, batch.id)
        assert done.request_counts.completed == 2  # (the lines ran as key-a: a 401 else)
        with pytest.raises(openai.NotFoundError):
            await b.files.content(done.output_file_id)


async def test_list_pages_newest_first():
    async with running_server() as url:
        client = client_of(url)
        file = await upload(client, requests("/v1/embeddings", 1))
        ids = []
        for _ in range(3):
            batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                                                completion_window="24h")
            ids.append(batch.id)
        page = await client.batches.list(limit=2)
        assert [x.id for x in page.data] == ids[::-1][:2] and page.has_more
        assert [x.id async for x in client.batches.list(limit=2)] == ids[::-1]
        for batch_id in ids:
            await wait_status(client, batch_id)


async def test_cancel_stops_a_batch_and_keeps_what_finished():
    async with running_server() as url:
        client = client_of(url)
        slow = {**CHAT, "max_tokens": 1000, "ignore_eos": True}
        file = await upload(client, requests("/v1/chat/completions", 40, slow))
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = await wait_status(client, batch.id, ("cancelled",))
        assert done.cancelled_at
        counts = done.request_counts
        assert counts.total == 40 and counts.completed + counts.failed < 40
        again = await client.batches.cancel(batch.id)
        assert again.status == "cancelled"
        # a finished batch cannot be cancelled
        file = await upload(client, requests("/v1/embeddings", 1))
        other = await client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        await wait_status(client, other.id)
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(other.id)


async def test_a_keys_unfinished_batches_are_bounded_by_its_quota(store_options):
    """--max-batches-per-key 1: a key's second create while its first runs is a 429 naming
    the quota, storing nothing, counted in /metrics (the SDK does not retry it), even with
    an input file that is invalid or missing (refused before it is read);
    another key's create is its own; once the first has ended (cancelled) the key creates
    again."""
    async with running_server(api_keys=("key-a", "key-b"), max_batches_per_key=1,
                              **store_options) as url:
        a, b = client_of(url, "key-a"), client_of(url, "key-b")
        slow = {**CHAT, "max_tokens": 1000, "ignore_eos": True}
        file = await upload(a, requests("/v1/chat/completions", 40, slow))
        first = await a.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        quick = await upload(a, requests("/v1/embeddings", 1))
        # (the SDK's default client, which retries a 429 unless told it cannot help)
        retrying = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-a")
        with pytest.raises(openai.RateLimitError) as info:
            await retrying.batches.create(input_file_id=quick.id, endpoint="/v1/embeddings",
                                          completion_window="24h")
        error = info.value.body
        assert info.value.status_code == 429 and error["code"] == "batch_quota_exceeded"
        assert info.value.response.headers["x-should-retry"] == "false"
        assert "at most 1 (--max-batches-per-key)" in error["message"], error
        assert [x.id async for x in a.batches.list()] == [first.id]  # (nothing stored)
        # at its quota, a key is refused before its input file is read: a file whose line
        # calls another endpoint (a 400 once read) and a missing one (a 404) are 429s too
        for file_id in (file.id, "file-missing"):
            with pytest.raises(openai.RateLimitError) as info:
                await a.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                       completion_window="24h")
            assert info.value.body["code"] == "batch_quota_exceeded", info.value.body
        with pytest.raises(openai.NotFoundError):  # (under its quota: the file is looked up)
            await b.batches.create(input_file_id="file-missing", endpoint="/v1/embeddings",
                                   completion_window="24h")
        theirs = await b.batches.create(input_file_id=(await upload(
            b, requests("/v1/embeddings", 1))).id, endpoint="/v1/embeddings",
            completion_window="24h")
        async with httpx.AsyncClient() as http:
            text = (await http.get(url + "/metrics")).text
        assert "trio_llm:state_refused_batches_total{model_name=\"sim\"} 3.0" in text
        await a.batches.cancel(first.id)
        await wait_status(a, first.id, ("cancelled",))
        again = await a.batches.create(input_file_id=quick.id, endpoint="/v1/embeddings",
                                       completion_window="24h")
        await wait_status(a, again.id)
        await wait_status(b, theirs.id)


async def batch_metrics(url: str) -> dict[str, float]:
    """The live ``trio_llm:batch*`` samples: name, then ``{status}`` when labelled by it."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(url + "/metrics")).text
    return {s.name + (f"{{{s.labels['status']}}}" if "status" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text)
            if family.name.startswith("trio_llm:batch") for s in family.samples
            if not s.name.endswith("_created")}


async def test_the_batch_metrics_of_a_live_server():
    """/metrics: the store's batches by status and the lines in flight while one runs; the
    batches ended by status and the lines completed and failed once it ends."""
    async with running_server(batch_concurrency=2) as url:
        client = client_of(url)
        assert (await batch_metrics(url))["trio_llm:batches_running"] == 0
        bad = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
               "body": {**CHAT, "model": "no-such-model"}}
        file = await upload(client, requests("/v1/chat/completions", 3) + [bad])
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        await wait_status(client, batch.id)
        seen = await batch_metrics(url)
        assert (seen["trio_llm:batch_lines_completed_total"],
                seen["trio_llm:batch_lines_failed_total"]) == (3, 1)
        assert seen["trio_llm:batches_ended_total{completed}"] == 1
        assert seen["trio_llm:batches_ended_total{cancelled}"] == 0
        assert (seen["trio_llm:batches_running"], seen["trio_llm:batch_lines_in_flight"]) \
            == (0, 0)
        slow = {**CHAT, "max_tokens": 1000, "ignore_eos": True}  # (cancelled before its end)
        file = await upload(client, requests("/v1/chat/completions", 40, slow))
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        with trio.fail_after(60):
            while True:
                seen = await batch_metrics(url)
                if (seen["trio_llm:batches{in_progress}"], seen["trio_llm:batches_running"],
                        seen["trio_llm:batch_lines_in_flight"]) == (1, 1, 2):
                    break
                await trio.sleep(0.05)
        assert seen["trio_llm:batches{validating}"] == seen["trio_llm:batches{cancelling}"] == 0
        await client.batches.cancel(batch.id)
        done = await wait_status(client, batch.id, ("cancelled",))
        seen = await batch_metrics(url)
        assert seen["trio_llm:batches_ended_total{cancelled}"] == 1
        assert (seen["trio_llm:batches_running"], seen["trio_llm:batch_lines_in_flight"]) \
            == (0, 0)
        assert seen["trio_llm:batch_lines_completed_total"] == 3 + done.request_counts.completed


async def test_answers_past_the_keys_quota_end_the_batch_storage_full(caplog):
    """--state-max-bytes-per-key: a line's answer the store refuses ends the batch
    ``failed`` with ``storage_full`` naming the quota, as output files that do not fit do,
    and stops its other lines; nothing is logged as the server's own failure."""
    async with running_server(api_keys=("key-a",), state_max_bytes_per_key=12_000) as url:
        client = client_of(url, "key-a")
        body = {**CHAT, "max_tokens": 500, "ignore_eos": True}  # (an answer of ~3 KB)
        file = await upload(client, requests("/v1/chat/completions", 20, body))
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        failed = await wait_status(client, batch.id, ("failed",))
        [error] = failed.errors.data
        assert error.code == "storage_full" and "--state-max-bytes-per-key" in error.message
        assert failed.request_counts.completed < 20
        assert (await client.completions.create(model="sim", prompt="hi", max_tokens=2)
                ).choices[0].finish_reason == "length"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_batch_failed_at_its_keys_quota_is_recorded_however_little_room_is_left():
    """The quota refuses a line's answer with less room left than the batch's failed
    status and error need: that write still goes in (it is the batch's own bookkeeping),
    and the batch ends ``failed``, ``storage_full``. Lines of one size run one at a time;
    each key's metadata shifts where its quota falls among them, so that one key's
    refusal leaves less room than that write needs (without the fix: the store refuses
    it too, and the runner fails the server)."""
    keys = [f"key-{i}" for i in range(6)]
    body = {**CHAT, "max_tokens": 2, "ignore_eos": True}  # (an answer of ~500 bytes)
    async with running_server(api_keys=tuple(keys), batch_concurrency=1,
                              state_max_bytes_per_key=5_000) as url:
        batches = []
        for i, key in enumerate(keys):
            client = client_of(url, key)
            file = await upload(client, requests("/v1/chat/completions", 9, body))
            batches.append((client, await client.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions",
                completion_window="24h", metadata={"pad": "x" * (i * 90)})))
        for client, batch in batches:
            failed = await wait_status(client, batch.id, ("failed",))
            [error] = failed.errors.data
            assert error.code == "storage_full", failed
        assert (await client.completions.create(model="sim", prompt="hi", max_tokens=2)
                ).choices[0].finish_reason == "length"


async def test_two_creates_past_the_early_quota_check_store_one(store_options):
    """--max-batches-per-key 1: two creates of a key with none both pass the early count
    (held there until both have read it, the race it cannot settle); the put's count under
    the write lock stores one, and refuses the other with the same 429."""
    async with running_server(api_keys=("key-a",), max_batches_per_key=1,
                              **store_options) as url:
        client = client_of(url, "key-a")
        file = await upload(client, requests("/v1/embeddings", 1))
        store, counted, both = url.app.state_store, [], trio.Event()
        early_check = store.check

        async def held_check(kind, owner, at_most):
            held = await early_check(kind, owner, at_most)
            counted.append(held)
            if len(counted) == 2:
                both.set()
            await both.wait()
            return held

        store.check = held_check
        outcomes: list = []

        async def create():
            try:
                outcomes.append(await client.batches.create(
                    input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"))
            except openai.RateLimitError as exc:
                outcomes.append(exc.body["code"])

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(create)
                nursery.start_soon(create)
        assert counted == [0, 0]  # (both passed the early count)
        created = [x for x in outcomes if not isinstance(x, str)]
        assert len(created) == 1 and "batch_quota_exceeded" in outcomes, outcomes
        assert [x.id async for x in client.batches.list()] == [created[0].id]


class ScanRendezvous:
    """Holds each of two runners' first scan of the store that finds a batch to claim until
    the other's has found it too: both then claim it from the same read, the race that the
    claim's compare-and-set settles. Wraps the runners' real stores (:meth:`wrap`)."""

    def __init__(self) -> None:
        self.arrived = 0
        self.both = trio.Event()

    def wrap(self, store):
        rendezvous = self

        class Gated:
            def __getattr__(self, name):
                return getattr(store, name)

            async def with_status(self, kind, statuses, **options):
                records = await store.with_status(kind, statuses, **options)
                if not rendezvous.both.is_set() and any(
                        r.meta["status"] == "validating" for r in records):
                    rendezvous.arrived += 1
                    if rendezvous.arrived == 2:
                        rendezvous.both.set()
                    await rendezvous.both.wait()
                return records

        return Gated()


async def test_two_frontends_on_one_store_never_both_run_a_line(store_options):
    """Two servers' runners read the same unclaimed batch at once (held at a rendezvous):
    one claim wins, so each line runs once, on one of them, and is recorded once."""
    n = 30
    async with running_server(**store_options) as a_url, \
            running_server(**store_options) as b_url:
        runners = [a_url.app.batches, b_url.app.batches]
        rendezvous = ScanRendezvous()
        for runner in runners:
            runner.store = rendezvous.wrap(runner.store)
        client = client_of(a_url)
        file = await upload(client, requests("/v1/chat/completions", n))
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        done = await wait_status(client, batch.id)
        assert rendezvous.both.is_set()  # (both runners saw it unclaimed, from one read)
        assert done.request_counts.completed == n
        events = await a_url.app.state_store.read_events("batch", "", batch.id)
        assert sorted(json.loads(e)["custom_id"] for e in events) \
            == sorted(f"r{i}" for i in range(n)), "a line ran on both frontends"
        stats = [runner.statistics() for runner in runners]
        assert sum(s.lines_done for s in stats) == n
        assert sorted(s.ended["completed"] for s in stats) == [0, 1]


# -- a server SIGKILLed in the middle of a batch ------------------------------------------


async def test_a_batch_past_its_completion_window_expires_keeping_what_finished():
    """A batch whose 24 h window is over (its record put as the create writes it, a day and
    a second old, with one line answered as the runner records one) runs no more lines: it
    is ``expired``, the answered line in its output file, each other one in its error file
    as ``batch_expired``."""
    async with running_server() as url:
        client = client_of(url)
        file = await upload(client, requests("/v1/completions", 4))
        store, runner = url.app.state_store, url.app.batches
        meta = {"status": "validating", "endpoint": "/v1/completions",
                "input_file_id": file.id, "metadata": None,
                "request_counts": {"total": 4, "completed": 0, "failed": 0},
                "holder": None, "lease_until_ms": None}
        old = int(time.time()) - COMPLETION_WINDOW_S - 1
        await store.put(Record("batch", "batch_old", "", old, meta, b""),
                        events=[output_line("r0", 200, "req_0", {"answered": True})])
        runner.poke()
        done = await wait_status(client, "batch_old", ("expired",))
        assert done.expired_at and done.request_counts.model_dump() == {
            "total": 4, "completed": 1, "failed": 3}
        answered = await read_lines(client, done.output_file_id)
        assert answered["r0"]["response"]["body"] == {"answered": True}
        unrun = await read_lines(client, done.error_file_id)
        assert sorted(unrun) == ["r1", "r2", "r3"]
        assert {line["error"]["code"] for line in unrun.values()} == {"batch_expired"}
        assert runner.statistics().lines_done == 0


def store_args(store_options: dict) -> tuple[StateConfig, tuple[str, ...]]:
    """A store_options' store, and the command line options that serve from it."""
    if "state_dir" in store_options:
        return (StateConfig(directory=store_options["state_dir"]),
                ("--state-dir", store_options["state_dir"]))
    return StateConfig(url=store_options["state_url"]), ("--state-url",
                                                          store_options["state_url"])


async def test_a_batch_survives_a_sigkill_of_its_server(store_options):
    """Lines finished before the kill are kept (the same output line, not run again), the
    rest run after the restart on the same store, and each custom_id is in the output
    exactly once."""
    state, args = store_args(store_options)
    body = {**CHAT, "max_tokens": 40, "ignore_eos": True}
    n = 120
    async with cli_server(*args) as srv:
        client = client_of(srv.url)
        file = await upload(client, requests("/v1/chat/completions", n, body))
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        with trio.fail_after(60):
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 10:
                await trio.sleep(0.05)
        srv.proc.send_signal(signal.SIGKILL)
        await srv.proc.wait()
    store = await open_state_store(state)
    try:
        before = {json.loads(e)["custom_id"]: json.loads(e)["id"]
                  for e in await store.read_events("batch", "", batch.id)}
        record = await store.get("batch", "", batch.id)
    finally:
        await store.aclose()
    assert record is not None and record.meta["status"] == "in_progress"
    assert 10 <= len(before) < n, "the kill did not land in the middle of the batch"
    async with cli_server(*args) as srv:
        client = client_of(srv.url)
        done = await wait_status(client, batch.id)
        assert done.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
        outputs = await read_lines(client, done.output_file_id)  # (each custom_id once)
        assert sorted(outputs) == sorted(f"r{i}" for i in range(n))
        for custom_id, line_id in before.items():
            assert outputs[custom_id]["id"] == line_id, f"{custom_id} ran again"
        srv.proc.send_signal(signal.SIGTERM)
        assert await srv.wait_exit(60) == 0, srv.output()
    store = await open_state_store(state)
    try:  # every line ran once after the restart: no finished custom_id again
        ran = [json.loads(e)["custom_id"] for e in await store.read_events("batch", "", batch.id)]
    finally:
        await store.aclose()
    assert sorted(ran) == sorted(f"r{i}" for i in range(n))


async def test_no_line_starts_while_an_interactive_request_holds_the_capacity():
    """With room for one request, a batch waits while an interactive stream runs (no line
    in flight, none refused), then runs every line once the stream ends."""
    async with running_server(max_concurrent_requests=1) as url:
        client = client_of(url)
        runner = url.app.batches
        file = await upload(client, requests("/v1/chat/completions", 4))
        long = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", url + "/v1/chat/completions", json=long) as stream:
                chunks = stream.aiter_bytes()
                await anext(chunks)
                batch = await client.batches.create(input_file_id=file.id,
                                                    endpoint="/v1/chat/completions",
                                                    completion_window="24h")
                await wait_status(client, batch.id, ("in_progress",))
                for _ in range(20):  # (the runner's gate polls every 20 ms)
                    await trio.sleep(0.02)
                    assert runner.statistics().lines_in_flight == 0
        done = await wait_status(client, batch.id)
        assert done.request_counts.completed == 4
        assert runner.statistics().lines_done == 4


async def test_batch_concurrency_bounds_the_lines_in_flight():
    async with running_server(batch_concurrency=2) as url:
        client = client_of(url)
        runner = url.app.batches
        body = {**CHAT, "max_tokens": 100, "ignore_eos": True}
        file = await upload(client, requests("/v1/chat/completions", 12, body))
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        most = 0
        with trio.fail_after(60):
            while runner.statistics().lines_done < 12:
                most = max(most, runner.statistics().lines_in_flight)
                await trio.sleep(0.005)
        assert most == 2
        assert (await wait_status(client, batch.id)).request_counts.completed == 12



def test_a_batch_lines_priority_lies_after_every_usual_one():
    assert batch_priority(0) == BATCH_PRIORITY and batch_priority(3) == BATCH_PRIORITY + 3
    assert batch_priority(-(2**63)) == 1 and batch_priority(2**63 - 1) == 2**63 - 1


async def test_batch_lines_go_below_interactive_requests_in_a_priority_scheduler():
    """A worker whose HELLO lists ``priority`` (here the sim under the priority policy, as
    vLLM's --scheduling-policy priority) is sent each batch line at batch_priority of the
    line's own, and interactive requests at theirs. A worker without it (the sim's fcfs,
    which refuses a priority not 0 as vLLM's does) is sent none: its lines complete."""
    def line(prompt: str, **extra) -> dict:
        return {"custom_id": prompt, "method": "POST", "url": "/v1/completions",
                "body": {"model": "sim", "prompt": prompt, "max_tokens": 2, **extra}}

    async def run(client, lines: list[dict]) -> None:
        file = await upload(client, lines)
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/completions",
                                            completion_window="24h")
        assert (await wait_status(client, batch.id)).request_counts.completed == len(lines)

    async with running_server() as url:  # (fcfs)
        await run(client_of(url), [line("fcfs line")])
    priority = EngineConfig(engine_options={**FAST_SIM, "scheduling_policy": "priority"})
    async with running_server(priority) as url:
        client = client_of(url)
        (worker,) = url.app.models.pools[0].engine.workers
        sent: dict[str, object] = {}
        submit = worker.submit_nowait

        def recording(choices, frames):  # (what the worker is sent, then sent it)
            for frame in frames:
                [(_, _, prompt, params, *_)] = wire.FrameDecoder().feed(frame)
                sent[prompt] = params.get("priority")
            submit(choices, frames)

        worker.submit_nowait = recording
        await run(client, [line("line"), line("line at 3", priority=3)])
        await client.completions.create(model="sim", prompt="asked", max_tokens=2)
        await client.completions.create(model="sim", prompt="asked at 5", max_tokens=2,
                                        extra_body={"priority": 5})
        assert sent == {"line": BATCH_PRIORITY, "line at 3": BATCH_PRIORITY + 3,
                        "asked": None, "asked at 5": 5}


async def test_a_server_that_stops_gives_its_batch_back_for_the_next_to_finish(tmp_path):
    """A SIGTERM's drain first aborts the lines in flight (nothing of them recorded) and
    releases the lease (no wait for it to expire); the next server runs the rest, each
    line once, none answered by the drain (a 503 or a cut-short answer)."""
    state = str(tmp_path / "state")
    n = 40
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True}  # (about 1 s a line)
    async with cli_server("--state-dir", state, "--shutdown-timeout", "0") as srv:
        client = client_of(srv.url)
        file = await upload(client, requests("/v1/chat/completions", n, body))
        batch = await client.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        with trio.fail_after(60):
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 1:
                await trio.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        assert await srv.wait_exit(60) == 0, srv.output()
    store = await open_state_store(StateConfig(directory=state))
    try:
        record = await store.get("batch", "", batch.id)
    finally:
        await store.aclose()
    assert record is not None and record.meta["status"] == "in_progress"
    assert record.meta["holder"] is None and record.meta["lease_until_ms"] is None
    async with cli_server("--state-dir", state) as srv:
        client = client_of(srv.url)
        done = await wait_status(client, batch.id)
        errors = await read_lines(client, done.error_file_id)
        assert not errors, next(iter(errors.values()))
        assert done.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
        outputs = await read_lines(client, done.output_file_id)
        for line in outputs.values():
            choice = line["response"]["body"]["choices"][0]
            assert choice["finish_reason"] == "length", line
