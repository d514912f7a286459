"""GET /metrics: scraped and parsed with prometheus-client's parser after known requests."""

from __future__ import annotations

import httpx
import pytest
import trio
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from server.config import EngineConfig, ServerConfig
from server.http.app import create_app
from server.observability.metrics import Histogram
from tests.conftest import FAST_SIM, assert_engine_idle, running_server
from tests.test_http_cancellation import open_request, read_until


class Scrape:
    """One parsed scrape: ``value(name, **labels)`` sums the samples whose labels match."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        found = [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert found, f"no sample {name} {labels}"
        return sum(found)

    def bucket(self, name: str, le: str) -> float:
        return self.value(name + "_bucket", le=le)


async def scrape(url: str, until=None, timeout: float = 5.0) -> Scrape:
    """Scrape ``url``; with ``until``, again until ``until(scrape)`` is true (a request is
    recorded just after its last byte is sent, so a client may see the end first)."""
    async with httpx.AsyncClient() as http:
        with trio.fail_after(timeout):
            while True:
                r = await http.get(url + "/metrics")
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/plain")
                m = Scrape(r.text)
                if until is None or until(m):
                    return m
                await trio.sleep(0.01)


def finished(m: Scrape) -> float:
    return m.value("trio_llm:request_success_total")


def fault_config(**kw) -> EngineConfig:
    return EngineConfig(engine_options={**FAST_SIM, "faults": True}, drain_timeout=0.5, **kw)


async def test_metrics_after_a_known_sequence_of_requests():
    async with running_server(fault_config()) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            # 1. Finishes normally, not streamed: 3 prompt tokens, 5 generated.
            r = await http.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 5})
            assert r.json()["choices"][0]["finish_reason"] == "length"
            # 2. Finishes normally, streamed: 2 prompt tokens, 4 generated.
            body = {"prompt": "d e", "max_tokens": 4, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
            assert raw.endswith(b"data: [DONE]\n\n")
            # 3. Failed by the engine after 2 tokens: 1 prompt token.
            body = {"prompt": "p", "max_tokens": 20, "stream": True,
                    "fault": {"kind": "error", "after": 2}}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
            assert b'"engine_error"' in raw
            # Rejected before the engine: not a finished request.
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
            assert r.status_code == 400
        # 4. Aborted by a client disconnect: 1 prompt token, some tokens generated.
        sock = await open_request(url, "/v1/completions",
                                  {"prompt": "go", "max_tokens": 5000, "stream": True})
        seen = await read_until(sock, b"data: ", 10)
        await sock.aclose()
        await assert_engine_idle(url.engine)
        await url.engine.ping_all()  # fresh (running, waiting) counts for the gauges

        m = await scrape(url, until=lambda m: finished(m) == 4)
        assert m.value("trio_llm:request_success_total", finished_reason="length") == 2
        assert m.value("trio_llm:request_success_total", finished_reason="error") == 1
        assert m.value("trio_llm:request_success_total", finished_reason="abort") == 1
        assert m.value("trio_llm:request_success_total", finished_reason="stop") == 0
        assert m.value("trio_llm:request_aborts_total", cause="client_disconnect") == 1
        for cause in ("timeout", "shutdown", "worker_failure"):
            assert m.value("trio_llm:request_aborts_total", cause=cause) == 0
        assert m.value("trio_llm:client_disconnects_total") == 1
        assert m.value("trio_llm:request_rejections_total", status="400") == 1

        assert m.value("trio_llm:prompt_tokens_total") == 3 + 2 + 1 + 1
        generated = m.value("trio_llm:generation_tokens_total")
        assert generated >= 5 + 4 + 2 + seen.count(b"data: ") - 1
        hist = "trio_llm:request_generation_tokens"
        assert m.value(hist + "_count") == 4
        assert m.value(hist + "_sum") == generated
        assert m.bucket(hist, "2.0") == 1 and m.bucket(hist, "5.0") == 3
        assert m.value("trio_llm:request_prompt_tokens_sum") == 7
        assert m.bucket("trio_llm:request_prompt_tokens", "1.0") == 2
        # The requests' own parameters, as vLLM's request_params_*.
        assert m.value("trio_llm:request_params_n_count") == 4
        assert m.value("trio_llm:request_params_n_sum") == 4
        assert m.value("trio_llm:request_params_max_tokens_sum") == 5 + 4 + 20 + 5000
        assert m.bucket("trio_llm:request_params_max_tokens", "5.0") == 2

        # Every request that ran got a first token, was accepted, and ended.
        for name in ("time_to_first_token_seconds", "request_queue_time_seconds",
                     "e2e_request_latency_seconds"):
            assert m.value(f"trio_llm:{name}_count") == 4, name
            assert m.bucket(f"trio_llm:{name}", "+Inf") == 4, name
        # TTFT >= the sim's 5 ms, and e2e > TTFT.
        assert m.value("trio_llm:time_to_first_token_seconds_sum") >= 4 * 0.005
        assert (m.value("trio_llm:e2e_request_latency_seconds_sum")
                > m.value("trio_llm:time_to_first_token_seconds_sum"))
        # Inter-token latency: only the streamed ones, at most one gap per token after the
        # first (tokens that arrive together are written together).
        itl = m.value("trio_llm:inter_token_latency_seconds_count")
        assert 1 <= itl <= 3 + 1 + (generated - 11)
        assert m.value("trio_llm:inter_token_latency_seconds_sum") > 0

        assert m.value("trio_llm:num_requests_running", worker="0") == 0
        assert m.value("trio_llm:num_requests_waiting", worker="0") == 0
        assert m.value("trio_llm:num_requests_in_flight") == 0
        assert m.value("trio_llm:workers_alive") == 1
        assert m.value("trio_llm:worker_restarts_total", worker="0") == 0
        # Every family carries the served model's name, as vLLM's do.
        assert {s.labels.get("model_name") for s in m.samples
                if s.name.startswith("trio_llm:")} == {"sim"}


async def test_running_and_waiting_gauges_per_worker():
    config = EngineConfig(workers=2, engine_options={**FAST_SIM, "max_batch": 1})
    async with running_server(config) as url:
        with trio.fail_after(30):  # /health is ok with one worker up; this needs both
            while url.engine.statistics().workers_alive < 2:
                await trio.sleep(0.02)
        socks = []
        for _ in range(3):  # least loaded first: worker 0, worker 1, then worker 0 again
            socks.append(await open_request(
                url, "/v1/completions", {"prompt": "p", "max_tokens": 5000, "stream": True}))
            with trio.fail_after(30):
                while url.engine.statistics().open_streams < len(socks):
                    await trio.sleep(0.01)
        await read_until(socks[0], b"data: ", 2)
        await url.engine.ping_all()
        m = await scrape(url)
        assert m.value("trio_llm:num_requests_running", worker="0") == 1
        assert m.value("trio_llm:num_requests_waiting", worker="0") == 1
        assert m.value("trio_llm:num_requests_running", worker="1") == 1
        assert m.value("trio_llm:num_requests_waiting", worker="1") == 0
        assert m.value("trio_llm:num_requests_running") == 2  # the total, summed over workers
        assert m.value("trio_llm:num_requests_in_flight") == 3
        assert m.value("trio_llm:workers_alive") == 2
        for s in socks:
            await s.aclose()
        await assert_engine_idle(url.engine)
        await url.engine.ping_all()
        m = await scrape(url, until=lambda m: finished(m) == 3)
        assert m.value("trio_llm:num_requests_running") == 0
        assert m.value("trio_llm:num_requests_waiting") == 0
        assert m.value("trio_llm:request_aborts_total", cause="client_disconnect") == 3


async def test_worker_crash_counts_a_restart_and_a_worker_failure():
    async with running_server(fault_config()) as url:
        body = {"prompt": "p", "max_tokens": 50, "stream": True,
                "fault": {"kind": "crash", "after": 3}}
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
            assert b"worker_died" in raw
            with trio.fail_after(30):
                while not url.engine.statistics().workers[0].alive:
                    await trio.sleep(0.02)
        m = await scrape(url, until=lambda m: finished(m) == 1)
        assert m.value("trio_llm:worker_restarts_total", worker="0") == 1
        assert m.value("trio_llm:request_aborts_total", cause="worker_failure") == 1
        assert m.value("trio_llm:request_success_total", finished_reason="error") == 1
        assert m.value("trio_llm:workers_alive") == 1


async def test_request_timeout_is_an_abort_with_cause_timeout():
    async with running_server(request_timeout=0.3) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            body = {"prompt": "p", "max_tokens": 5000, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                raw = b"".join([part async for part in r.aiter_raw()])
            assert b'"finish_reason":"abort"' in raw
            r = await http.post("/v1/completions", json={"prompt": "p", "max_tokens": 5000})
            assert r.status_code == 504
        m = await scrape(url, until=lambda m: finished(m) == 2)
        assert m.value("trio_llm:request_aborts_total", cause="timeout") == 2
        assert m.value("trio_llm:request_success_total", finished_reason="abort") == 2
        assert m.value("trio_llm:client_disconnects_total") == 0
        assert m.value("trio_llm:e2e_request_latency_seconds_sum") >= 2 * 0.3


async def test_each_app_has_its_own_registry():
    a = create_app(ServerConfig())
    b = create_app(ServerConfig())
    assert a.metrics.registry is not b.metrics.registry
    a.metrics.prompt_tokens_total = 7
    text_b, _ = b.metrics.exposition()
    assert Scrape(text_b.decode()).value("trio_llm:prompt_tokens_total") == 0
    text_a, content_type = a.metrics.exposition()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert Scrape(text_a.decode()).value("trio_llm:prompt_tokens_total") == 7
    # Nothing went into prometheus-client's process-wide registry.
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("trio_llm")]
    # Without an engine (starting, stopped) the engine gauges are zero, not an error.
    m = Scrape(text_a.decode())
    assert m.value("trio_llm:workers_alive") == 0
    assert m.families["trio_llm:num_requests_running"].samples == []


def test_gc_metrics_only_when_asked():
    import gc

    callbacks = list(gc.callbacks)
    app = create_app(ServerConfig())
    assert gc.callbacks == callbacks  # create_app changes nothing process-wide
    text, _ = app.metrics.exposition()
    assert "python_gc_collections" not in Scrape(text.decode()).families
    app.metrics.watch_gc()  # as serve(gc_metrics=True) and the CLI do
    app.metrics.watch_gc()  # (once)
    gc.collect()
    m = Scrape(app.metrics.exposition()[0].decode())
    assert m.value("python_gc_collections_total", generation="2") >= 1


async def test_openmetrics_when_asked():
    app = create_app(ServerConfig())
    body, content_type = app.metrics.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_histogram_buckets_are_upper_bounds():
    h = Histogram([0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.buckets() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert h.count == 5 and h.sum == pytest.approx(4.65)


def test_engine_reported_families_follow_the_workers_reports():
    """What a worker's engine reports of itself (the vllm engine: HELLO's cache config, each
    PONG's map, each request's times note) as families; nothing from an engine that
    reports nothing, and no gauges from a worker that is down."""
    from prometheus_client import generate_latest

    from server.observability.engine_metrics import EngineReport, engine_families
    from server.observability.merge import Families
    from server.worker_protocol.wire import ITERATION_TOKEN_BUCKETS

    def families(*reports: EngineReport) -> Scrape:
        return Scrape(generate_latest(Families(
            engine_families(("m", i, r) for i, r in enumerate(reports)))).decode())

    silent = EngineReport()
    silent.hello({"engine": "sim"})
    silent.pong(3, None)
    assert families(silent).samples == []

    vllm = EngineReport()
    vllm.hello({"engine": "vllm", "cache_config": {"block_size": "16",
                                                   "kv_cache_size_tokens": "4096"}})
    steps = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    steps[0], steps[3] = 4, 1  # four steps of 1 token, one of 17 to 32
    vllm.pong(5, {"kv_cache_usage": 0.25, "deferred": 2, "preemptions": 7,
                  "iteration_tokens": [*steps, 4 + 30]})
    vllm.finished({"queue": 0.002, "prefill": 0.2, "decode": 1.0, "inference": 1.2})
    m = families(silent, vllm)
    assert m.value("trio_llm:kv_cache_usage_perc", worker="1") == 0.25
    assert m.value("trio_llm:num_requests_waiting_by_reason", worker="1", reason="capacity") == 3
    assert m.value("trio_llm:num_requests_waiting_by_reason", worker="1", reason="deferred") == 2
    assert m.value("trio_llm:num_preemptions_total", worker="1") == 7
    assert m.bucket("trio_llm:iteration_tokens_total", "1.0") == 4
    assert m.bucket("trio_llm:iteration_tokens_total", "16.0") == 4
    assert m.bucket("trio_llm:iteration_tokens_total", "32.0") == 5
    assert m.value("trio_llm:iteration_tokens_total_sum") == 34
    assert m.value("trio_llm:cache_config_info", worker="1", block_size="16",
                   kv_cache_size_tokens="4096") == 1
    assert m.value("trio_llm:request_prefill_time_seconds_count", worker="1") == 1
    assert m.value("trio_llm:request_decode_time_seconds_sum", worker="1") == 1.0
    assert m.value("trio_llm:request_engine_queue_time_seconds_count") == 1
    assert m.value("trio_llm:request_inference_time_seconds_count", worker="0") == 0
    assert "trio_llm:kv_cache_usage_perc" not in {s.name for s in m.samples
                                                 if s.labels.get("worker") == "0"}

    vllm.down()  # its session ended: no gauge, the histograms keep their counts
    m = families(silent, vllm)
    assert "trio_llm:kv_cache_usage_perc" not in m.families
    assert m.value("trio_llm:request_prefill_time_seconds_count") == 1
