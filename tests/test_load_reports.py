"""Load as vLLM reports it: ``GET /load`` (requests in flight) and ORCA's
``endpoint-load-metrics`` response header, on the in-memory engine in virtual time."""

from __future__ import annotations

import json

import trio

import server
from server.testing import open_in_memory_engine
from server.testing.asgi import open_asgi_client

BODY = {"prompt": "a b", "max_tokens": 5}


async def test_load_counts_the_requests_in_flight(autojump_clock):
    async with open_in_memory_engine(itl_ms=100) as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            assert (await client.get("/load")).json() == {"server_load": 0}
            answers = []
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(
                        lambda: client.post("/v1/completions", json={**BODY, "max_tokens": 50})
                    )
                    nursery.start_soon(
                        lambda: client.post("/v1/completions", json={**BODY, "max_tokens": 20})
                    )
                await trio.sleep(1)  # 10 of the 20 and 50 tokens each
                answers.append((await client.get("/load")).json())
                await trio.sleep(2)  # the 20-token requests are done
                answers.append((await client.get("/load")).json())
            answers.append((await client.get("/load")).json())
    assert answers == [{"server_load": 4}, {"server_load": 2}, {"server_load": 0}]


async def test_an_orca_report_when_asked_for_one(autojump_clock):
    async with open_in_memory_engine() as engine:
        async with open_asgi_client(server.create_app(engine=engine)) as client:
            r = await client.post("/v1/completions", json=BODY)
            assert r.status == 200 and r.header("endpoint-load-metrics") is None
            text = await client.post("/v1/completions", json=BODY,
                                     headers=[("endpoint-load-metrics-format", "TEXT")])
            chat = {"messages": [{"role": "user", "content": "a"}], "stream": True}
            js = await client.post("/v1/chat/completions", json=chat,
                                   headers=[("endpoint-load-metrics-format", "json")])
            bad = await client.post("/v1/completions", json=BODY,
                                    headers=[("endpoint-load-metrics-format", "yaml")])
    assert text.status == 200, text.body
    kind, _, pairs = text.header("endpoint-load-metrics").partition(" ")
    assert kind == "TEXT"
    report = dict(pair.split("=") for pair in pairs.split(", "))
    assert {float(v) for v in report.values()} >= {0.0}
    assert "named_metrics.num_requests_waiting" in report
    assert js.status == 200 and js.sse()[-1] == "[DONE]"
    kind, _, data = js.header("endpoint-load-metrics").partition(" ")
    assert kind == "JSON" and "num_requests_waiting" in json.loads(data)["named_metrics"]
    assert bad.status == 400
    assert bad.json()["error"]["param"] == "endpoint-load-metrics-format"
