"""Issue 18, items 5, 6 and 7: amplification, admission by sequences, overload defaults.

* Item 5: a 4 MB ``model`` string is not echoed whole, neither in the 404 nor in the log.
* Item 6: an explicit admission limit counts sequences (prompts x n), not requests:
  requests that fill it leave a new one a quick 503 (not a wait with no bytes), and a
  request that could never fit is a 400.
* Item 7: the listen backlog is ours (2048 by default), ``/ready`` says "saturated" while
  ``/health`` stays 200, and a stream queued past ``queued_heartbeat`` starts with SSE
  comments so that proxies with read timeouts keep it; an engine failure after that is an
  error event + ``[DONE]``.

(By default there is no admission limit: issue 41 item 6, tests/test_queueing.py.)
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import shutil

import httpx
import openai
import pytest
import trio

from server.config import EngineConfig, Limits
from tests.conftest import FAST_SIM, running_server
from tests.sse_record import SSE, stream_into
from tests.test_hostile import addr


async def test_a_huge_model_name_is_not_echoed_whole(caplog):
    caplog.set_level(logging.INFO)
    model = "m" * 4_000_000
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/completions", json={"model": model, "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model"
            assert len(r.content) < 2000 and "4000000 characters" in r.text
            r = await http.get("/v1/models/" + "m" * 10_000)
            assert r.status_code == 404 and len(r.content) < 2000
    ours = [rec for rec in caplog.records if rec.name.startswith("server")]
    assert any("model_not_found" in rec.getMessage() for rec in ours)
    assert max(len(rec.getMessage()) for rec in ours) < 4000


SMALL = EngineConfig(engine_options={**FAST_SIM, "max_batch": 4})


async def test_admission_counts_sequences_and_a_full_engine_answers_at_once():
    async with running_server(SMALL, max_concurrent_sequences=8) as url:
        assert url.app.sequence_limit() == 8
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # 3 prompts x n=3 = 9 sequences, over the limit: it could never run.
            r = await http.post(
                "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}
            )
            assert r.status_code == 400 and "9 sequences" in r.json()["error"]["message"]
            assert (await http.get("/ready")).json() == {"status": "ready"}
            async with trio.open_nursery() as nursery:
                big = SSE()  # 2 prompts x n=4 = 8 sequences: the whole limit
                nursery.start_soon(
                    stream_into, http,
                    {"prompt": ["a", "b"], "n": 4, "max_tokens": 2000}, big,
                )
                with trio.fail_after(30):
                    await big.started.wait()
                with trio.fail_after(30):  # (a 503 now, not a 200 once `big` is done: not queued)
                    r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "server_overloaded"
                ready = await http.get("/ready")
                assert ready.status_code == 503 and ready.json() == {"status": "saturated"}
                assert (await http.get("/health")).status_code == 200  # alive, just full
                nursery.cancel_scope.cancel()
            with trio.fail_after(30):
                while url.engine.open_sequences:
                    await trio.sleep(0.02)
            assert (await http.get("/ready")).status_code == 200
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 200


async def test_a_request_larger_than_the_batch_runs_idle_or_queued():
    # Issue 29 item 8: n=2 x 2 prompts on a worker that runs 1 at once runs as vLLM runs
    # it, its sequences one after another; on a busy server (issue 41 item 6) it queues.
    one = EngineConfig(engine_options={**FAST_SIM, "max_batch": 1})
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 3}
    async with running_server(one) as url:
        assert url.app.sequence_limit() is None
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
            assert all(c["finish_reason"] == "length" for c in choices)
            async with trio.open_nursery() as nursery:
                await occupy(nursery, http, 1000)
                with trio.fail_after(120):  # (a hang guard)
                    r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
                nursery.cancel_scope.cancel()
    # An explicit --max-concurrent-sequences is a hard cap: larger is a 400 that says why.
    async with running_server(one, max_concurrent_sequences=2) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 400 and "4 sequences" in r.json()["error"]["message"]


async def test_no_sequence_limit_when_asked():
    async with running_server(SMALL, max_concurrent_sequences=0) as url:
        assert url.app.sequence_limit() is None
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            r = await http.post(
                "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 4, "max_tokens": 2}
            )
            assert r.status_code == 200 and len(r.json()["choices"]) == 12


def _somaxconn() -> int:
    return int(pathlib.Path("/proc/sys/net/core/somaxconn").read_text())


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read the backlog")
async def test_the_listen_backlog_is_ours():
    somaxconn = _somaxconn()
    for backlog in (2048, 300):
        options = {} if backlog == 2048 else {"backlog": backlog}
        async with running_server(**options) as url:
            port = addr(url)[1]
            ss = await trio.run_process(
                ["ss", "-Hltn", f"sport = :{port}"], capture_stdout=True
            )
            out = ss.stdout.decode().split()
            # State Recv-Q Send-Q ...: for a listening socket, Send-Q is its backlog.
            assert int(out[2]) == min(backlog, somaxconn), out


async def occupy(nursery: trio.Nursery, http: httpx.AsyncClient, max_tokens: int) -> SSE:
    """Start a stream that holds the engine's only slot; returns once it streams."""
    first = SSE()
    nursery.start_soon(stream_into, http, {"prompt": "a", "max_tokens": max_tokens}, first)
    with trio.fail_after(30):  # (a hang guard)
        await first.started.wait()
    return first


async def test_a_long_queued_stream_sends_comments_then_streams():
    one = EngineConfig(engine_options={**FAST_SIM, "max_batch": 1})
    async with running_server(one, queued_heartbeat=0.3) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                # the only slot, for 6 s at least (the sim's 2 ms a token): twenty heartbeat
                # periods, so the three comments asserted below need no prompt timer (a busy
                # frontend's come late; with a 2 s hold, a 1.4 s stall left fewer than three)
                first = await occupy(nursery, http, 3000)
                queued = SSE()
                nursery.start_soon(stream_into, http, {"prompt": "b", "max_tokens": 5}, queued, 1)
                with trio.fail_after(30):  # (a hang guard) the headers and a comment...
                    await queued.started.wait()
                # ... while the first still holds the slot: no token can have come yet
                assert queued.status == 200 and queued.events[0] == b": waiting for the engine"
                assert not first.finished.is_set()
            assert first.done and queued.done
            comments = [e for e in queued.events if e.startswith(b":")]
            assert len(comments) >= 3  # one per 0.3 s while the first request ran
            assert queued.tokens() == 5 and queued.finish_reasons() == ["length"]
            # The openai SDK reads such a stream as usual (SSE comments are skipped).
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
            async with trio.open_nursery() as nursery:
                await occupy(nursery, http, 1000)  # queued behind it: comments come first
                text = ""
                async for chunk in await client.completions.create(
                    model="sim", prompt="b", max_tokens=4, stream=True
                ):
                    text += chunk.choices[0].text
                assert len(text.split()) == 4
            await client.close()


async def test_an_engine_failure_after_the_heartbeat_is_an_error_event():
    one = EngineConfig(engine_options={**FAST_SIM, "max_batch": 1, "faults": True})
    async with running_server(one, queued_heartbeat=0.2, limits=Limits(allow_faults=True)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                await occupy(nursery, http, 400)
                failing = SSE()
                nursery.start_soon(
                    stream_into, http,
                    {"prompt": "b", "max_tokens": 5, "fault": {"kind": "error", "after": 0}},
                    failing, 1,
                )
            assert failing.status == 200 and failing.events[0].startswith(b":")
            assert failing.done and failing.error()["type"] == "engine_error"
            assert json.loads(failing.events[-2][6:])["error"]


async def test_a_bug_while_a_started_stream_waits_ends_it_as_a_stream(monkeypatch):
    # After the heartbeat started the response, an unexpected error (a test-only fault in
    # the wait) must end the stream with an error event and [DONE], not cut it mid-chunk.
    from server.manager.stream import RequestStream

    real = RequestStream.wait_started
    calls = 0

    async def faulty(self, timeout=math.inf):
        nonlocal calls
        if timeout != math.inf:
            calls += 1
            if calls == 3:  # the second wait after the response started
                raise RuntimeError("a bug while waiting")
        return await real(self, timeout)

    monkeypatch.setattr(RequestStream, "wait_started", faulty)
    one = EngineConfig(engine_options={**FAST_SIM, "max_batch": 1})
    async with running_server(one, queued_heartbeat=0.2) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                await occupy(nursery, http, 1000)
                waiting = SSE()
                nursery.start_soon(stream_into, http, {"prompt": "b", "max_tokens": 5}, waiting, 1)
            assert waiting.status == 200 and waiting.events[0].startswith(b":")
            assert waiting.done and waiting.error()["type"] == "engine_error"
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
