"""Several models behind one server: each its own worker pool, chosen by a request's
``model``; listed, routed, refused in OpenAI's shape, admitted per pool, and isolated from
each other's failures. Real sim worker processes behind hypercorn on port 0, the openai SDK
as the client; real time, each ``fail_after`` a guard against a hang, never the property.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import httpx
import openai
import trio

from server.config import EngineConfig, ModelConfig
from tests.conftest import FAST_SIM, pid_exists, running_server
from tests.sse_record import SSE, stream_into
from tests.test_logging_and_ids import by_request, captured_log, json_lines, wait_for_line
from tests.test_metrics import scrape

#: Tokens of a stream that must outlive the other pool's worker's death (about 6 s at the
#: sim's 2 ms a token, more on a busy machine).
LONG = 3000


def model(name: str, *, limit: int | None = None, **engine) -> ModelConfig:
    options = {**FAST_SIM, **engine.pop("engine_options", {})}
    engine.setdefault("shutdown_grace", 0.3)
    return ModelConfig(EngineConfig(model=name, engine_options=options, **engine),
                       max_concurrent_requests=limit)


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def pool(url, name: str):
    return url.app.models.resolve(name)


def routed(url, name: str) -> int:
    return sum(pool(url, name).engine.statistics().routing.routed)


async def test_two_models_listed_routed_and_an_unknown_one_is_a_404():
    models = (model("small", engine_options={"max_model_len": 1000}),
              model("large", engine_options={"max_model_len": 2000}, workers=2))
    async with running_server(models=models) as url:
        sdk = client(url)
        listed = (await sdk.models.list()).data
        assert [(m.id, m.max_model_len) for m in listed] == [("small", 1000), ("large", 2000)]
        card = (await sdk.models.retrieve("large")).model_dump()
        assert card["id"] == "large"
        # vLLM's card fields (clients that read vLLM's cards expect them; issue 41)
        assert card["root"] == "large" and card["parent"] is None
        (permission,) = card["permission"]
        assert permission["object"] == "model_permission" and permission["allow_sampling"]

        r = await sdk.completions.create(model="small", prompt="x", max_tokens=3)
        assert r.model == "small" and r.usage.completion_tokens == 3
        assert (routed(url, "small"), routed(url, "large")) == (1, 0)
        c = await sdk.chat.completions.create(
            model="large", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert c.model == "large" and c.choices[0].finish_reason == "length"
        assert (routed(url, "small"), routed(url, "large")) == (1, 1)
        # each pool's own engine checks the request: 1500 tokens fit only the large one
        words = " ".join(["w"] * 1500)
        r = await sdk.completions.create(model="large", prompt=words, max_tokens=1)
        assert r.usage.prompt_tokens >= 1500
        try:
            await sdk.completions.create(model="small", prompt=words, max_tokens=1)
            raise AssertionError("the small model took a prompt beyond its context")
        except openai.BadRequestError:
            pass

        for call in (
            sdk.completions.create(model="medium", prompt="x", max_tokens=1),
            sdk.chat.completions.create(model="medium", messages=[], max_tokens=1),
            sdk.embeddings.create(model="medium", input="x"),
            sdk.models.retrieve("medium"),
        ):
            try:
                await call
                raise AssertionError("an unknown model was served")
            except openai.NotFoundError as exc:
                error = exc.response.json()["error"]
                assert error["code"] == "model_not_found" and error["param"] == "model"
                assert error["type"] == "invalid_request_error"
                assert "'medium'" in error["message"]
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/tokenize", json={"model": "medium", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await http.post("/v1/completions", json={"model": 7, "prompt": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            # no model: the first one, as vLLM serves its first name
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "small"
            for path, status in (("/health", "ok"), ("/ready", "ready")):
                r = await http.get(path)
                assert r.status_code == 200
                assert r.json() == {"status": status,
                                    "models": {"small": status, "large": status}}

        m = await scrape(url, until=lambda m: m.value(
            "trio_llm:request_success_total", model_name="small") == 2)
        assert m.value("trio_llm:request_success_total", model_name="large") == 2
        assert m.value("trio_llm:workers_alive", model_name="small") == 1
        assert m.value("trio_llm:workers_alive", model_name="large") == 2
        assert m.value("trio_llm:request_rejections_total", status="400") == 2
        assert m.value("trio_llm:request_rejections_total", status="404") == 2
        assert m.value("trio_llm:routed_requests_total", model_name="large") == 2


async def test_one_pools_worker_sigkilled_while_the_other_streams_on():
    """Pool A's worker dies mid-stream and restarts; pool B's stream, running meanwhile,
    gets every token with no error event, and its text is the same as a second run's."""
    models = (model("a"), model("b"))
    async with running_server(models=models) as url:
        a, b = pool(url, "a").engine, pool(url, "b").engine
        victim = a.statistics().workers[0].pid
        sdk = client(url)
        got: list[str] = []
        usage = []
        finish = []
        a_stream = SSE()
        b_started, killed = trio.Event(), trio.Event()
        after_kill = 0

        async def stream_b():
            nonlocal after_kill
            stream = await sdk.completions.create(
                model="b", prompt="p", max_tokens=LONG, temperature=0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:  # (the SDK raises at an error event)
                if chunk.choices:
                    got.append(chunk.choices[0].text)
                    if chunk.choices[0].finish_reason:
                        finish.append(chunk.choices[0].finish_reason)
                    b_started.set()
                    after_kill += killed.is_set()
                if chunk.usage:
                    usage.append(chunk.usage)

        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_into, http,
                                   {"model": "a", "prompt": "p", "max_tokens": LONG}, a_stream)
                nursery.start_soon(stream_b)
                with trio.fail_after(20):
                    await a_stream.started.wait()
                    await b_started.wait()
                os.kill(victim, signal.SIGKILL)
                killed.set()
                with trio.fail_after(30):
                    await a_stream.finished.wait()
                    while not (a.statistics().workers[0].alive
                               and a.statistics().workers[0].restarts == 1):
                        await trio.sleep(0.05)
                b_then = len(got)
                # A serves again (its new worker) while B still streams
                r = await sdk.completions.create(model="a", prompt="q", max_tokens=2)
                assert r.usage.completion_tokens == 2
        assert a_stream.error()["code"] == "worker_died"
        assert not pid_exists(victim)
        assert b_then < LONG and after_kill > 0  # B was streaming across A's death
        assert finish == ["length"] and usage[-1].completion_tokens == LONG
        assert b.statistics().workers[0].restarts == 0
        again = await sdk.completions.create(model="b", prompt="p", max_tokens=LONG,
                                             temperature=0)
        assert "".join(got) == again.choices[0].text


async def test_health_says_which_pool_is_down_and_the_other_serves():
    # over its budget at its first death: restarted only after the capped backoff, 600 s
    models = (model("a", max_restarts=0, restart_backoff_max=600.0), model("b"))
    async with running_server(models=models) as url:
        a = pool(url, "a").engine
        os.kill(a.statistics().workers[0].pid, signal.SIGKILL)
        with trio.fail_after(20):
            while not a.workers[0].over_budget:
                await trio.sleep(0.05)
        async with httpx.AsyncClient(base_url=url) as http:
            health, ready = await http.get("/health"), await http.get("/ready")
            assert health.status_code == ready.status_code == 503
            assert health.json() == {"status": "unavailable",
                                     "models": {"a": "unavailable", "b": "ok"}}
            assert ready.json() == {"status": "unavailable",
                                    "models": {"a": "unavailable", "b": "ready"}}
            r = await http.post("/v1/completions", json={"model": "a", "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
            with captured_log("json") as log:
                r = await http.post("/v1/completions",
                                    json={"model": "b", "prompt": "x", "max_tokens": 2},
                                    headers={"X-Request-Id": "to-b"})
                assert r.status_code == 200 and r.json()["model"] == "b"
                await wait_for_line(log, "to-b")
            assert by_request(json_lines(log), "to-b")[-1]["model"] == "b"
        m = await scrape(url)
        assert m.value("trio_llm:workers_alive", model_name="a") == 0
        assert m.value("trio_llm:workers_alive", model_name="b") == 1


async def test_each_pool_admits_by_its_own_limit():
    models = (model("a", limit=1), model("b", limit=1))
    async with running_server(models=models) as url:
        held = SSE()
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_into, http,
                                   {"model": "a", "prompt": "p", "max_tokens": LONG}, held)
                with trio.fail_after(20):
                    await held.started.wait()
                r = await http.post("/v1/completions",
                                    json={"model": "a", "prompt": "x", "max_tokens": 1})
                assert r.status_code == 503
                assert r.json()["error"]["code"] == "server_overloaded"
                r = await http.post("/v1/completions",
                                    json={"model": "b", "prompt": "x", "max_tokens": 1})
                assert r.status_code == 200
                r = await http.get("/ready")  # one pool full: still ready for the other
                assert r.status_code == 200
                assert r.json()["models"] == {"a": "saturated", "b": "ready"}
                nursery.cancel_scope.cancel()  # (the client goes away: the stream aborts)


async def test_an_embedder_serves_its_own_engines_as_models(autojump_clock):
    """``create_app(engines=[...])``: engines the program runs, each its config's model."""
    import server
    from server.testing import open_in_memory_engine, sim_engine_config
    from server.testing.asgi import open_asgi_client

    def named(name: str, length: int) -> EngineConfig:
        return dataclasses.replace(sim_engine_config(max_model_len=length), model=name)

    async with open_in_memory_engine(named("a", 100)) as a:
        async with open_in_memory_engine(named("b", 200)) as b:
            app = server.create_app(server.ServerConfig(), engines=[a, b])
            async with open_asgi_client(app) as http:
                r = await http.get("/v1/models")
                assert [(m["id"], m["max_model_len"]) for m in r.json()["data"]] == [
                    ("a", 100), ("b", 200)]
                r = await http.post("/v1/completions",
                                    json={"model": "b", "prompt": "x", "max_tokens": 2})
                assert r.status == 200 and r.json()["model"] == "b"
                assert (a.statistics().routing.routed, b.statistics().routing.routed) == (
                    [0], [1])
                r = await http.post("/v1/completions", json={"model": "c", "prompt": "x"})
                assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
            assert a.accepting and b.accepting  # the app neither started nor stopped them


async def test_a_drain_ends_every_pools_streams():
    from server.http.serve import drain

    async with running_server(models=(model("a"), model("b"))) as url:
        streams = {"a": SSE(), "b": SSE()}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                for name, rec in streams.items():
                    nursery.start_soon(stream_into, http,
                                       {"model": name, "prompt": "p", "max_tokens": LONG}, rec)
                with trio.fail_after(20):
                    for rec in streams.values():
                        await rec.started.wait()
                await drain(url.app, 0)
        for rec in streams.values():
            assert rec.done and rec.finish_reasons() == ["abort"], rec.body[-300:]
        async with httpx.AsyncClient(base_url=url) as http:
            for name in ("a", "b"):
                r = await http.post("/v1/completions", json={"model": name, "prompt": "x"})
                assert r.status_code == 503  # both stopped accepting
