"""A worker that joins by DNS discovery gets the LoRA adapters loaded and unloaded at run
time, as a restarted or reconnecting one does (issue 45). Real listening sim workers with
simulated adapters (server.engines.sim.lora), the real DNS server of
tests/test_dns_discovery.py, a real frontend over HTTP."""

from __future__ import annotations

from contextlib import AsyncExitStack

import httpx
import trio

from server.engines.sim.lora import tag
from tests.conftest import running_server
from tests.remote import free_port, listening_worker, wait_until
from tests.test_dns_discovery import LIMIT, NAME, dns_config, dns_server, members


async def test_a_worker_that_joins_by_dns_gets_the_adapters_loaded_and_unloaded_meanwhile(
        tmp_path):
    """One worker is found at first; an adapter is loaded there at run time and a start-up
    one unloaded. A second worker joins by DNS and the first leaves (then is killed), so
    every request runs on the newcomer: the loaded adapter answers there, with its tag, and the
    unloaded name is free there for a new load (the worker still holding it would
    refuse that load: "already been loaded")."""
    loras = tmp_path / "loras"
    for name in ("a", "s", "b"):
        (loras / name).mkdir(parents=True)
    lora_args = ("--enable-lora", "--max-loras", "2", "--lora-modules", f"s={loras / 's'}",
                 "--allow-runtime-lora", "--lora-dir", str(loras))
    port = free_port()
    first, second = "127.0.0.2", "127.0.0.3"
    with dns_server() as records, trio.fail_after(LIMIT):
        records.set(NAME, first)
        async with AsyncExitStack() as stack:
            workers = {host: await stack.enter_async_context(listening_worker(
                tmp_path, f"{host}:{port}", *lora_args, name=host)) for host in (first, second)}
            config = dns_config(f"dns:{NAME}:{port}", records, dns_drain_grace=0.3)
            async with running_server(config) as url, httpx.AsyncClient(
                    base_url=url, timeout=LIMIT) as client:
                engine = url.app.engine
                await wait_until(lambda: members(engine) == {f"{first}:{port}"}, LIMIT)
                r = await client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "a", "lora_path": "a"})
                assert r.status_code == 200, r.text
                r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "s"})
                assert r.status_code == 200, r.text

                records.set(NAME, first, second)
                await wait_until(lambda: f"{second}:{port}" in members(engine), LIMIT)
                records.set(NAME, second)  # the first drains and leaves: all goes to the second
                await wait_until(lambda: members(engine) == {f"{second}:{port}"}, LIMIT)
                workers[first].proc.kill()  # (and could answer nothing)
                await workers[first].proc.wait()

                async def text(model: str) -> str:
                    r = await client.post("/v1/completions", json={
                        "model": model, "prompt": "the joining worker", "max_tokens": 6,
                        "temperature": 0})
                    assert r.status_code == 200, r.text
                    assert r.json()["model"] == model
                    return r.json()["choices"][0]["text"]

                base = await text("sim")
                assert await text("a") == tag("a") + base
                models = (await client.get("/v1/models")).json()["data"]
                assert [(m["id"], m.get("parent")) for m in models] == [
                    ("sim", None), ("a", "sim")]
                r = await client.post("/v1/load_lora_adapter",
                                      json={"lora_name": "s", "lora_path": "b"})
                assert r.status_code == 200, r.text
                assert await text("s") == tag("s") + base
