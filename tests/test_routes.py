"""The route table (server/http/routes.py) is what the app serves: each row, raw or Quart,
is reached at its path, a row off in a configuration is a 404, and a path in no row is the
app's JSON 404. In-memory sim workers, the app called directly (server.testing.asgi)."""

from __future__ import annotations

import re

import pytest

import server
from server.http.routes import TABLE
from server.testing import open_in_memory_engine
from server.testing.asgi import open_asgi_client


def _concrete(path: str) -> str:
    """A request path for a row's rule (``<path:model_id>``: the served model)."""
    return re.sub(r"<[^>]+>", "sim", path)


@pytest.mark.parametrize("tokenizer_info", [False, True])
async def test_every_row_of_the_table_is_served_at_its_path(tokenizer_info):
    # (real time: the state store's reads run in a thread, and a virtual clock jumps to its
    # next deadline while one runs, past the in-memory engine's 600 s limit)
    config = server.ServerConfig(enable_tokenizer_info=tokenizer_info)
    async with open_in_memory_engine() as engine:
        app = server.create_app(config, engine=engine)
        async with open_asgi_client(app) as http:
            for route in TABLE:
                path = _concrete(route.path)
                if route.raw and "GET" not in route.methods:
                    # every raw route refuses a GET itself (server.http.post)
                    r = await http.get(path)
                    assert (r.status, r.header("allow")) == (405, "POST"), path
                    continue
                r = await http.request(route.methods[0], path)
                if "<file_id>" in route.path:  # (its 404 is the file's, not the route's)
                    assert r.status == 404, path
                    assert r.json()["error"]["message"] == "No such File object: sim", path
                    continue
                if "<batch_id>" in route.path:  # (the batch's 404, not the route's)
                    assert r.status == 404, path
                    assert r.json()["error"]["message"] == "No such Batch object: sim", path
                    continue
                if "<response_id>" in route.path:  # (the response's 404, not the route's)
                    assert r.status == 404, path
                    assert r.json()["error"]["message"] == "No response with id 'sim' was found."
                    continue
                if route.on(config):  # (the sim has no tokenizer: its 400, not a 404)
                    assert r.status in (200, 400), (path, r.status, r.body)
                    assert r.status == 200 or path == "/tokenizer_info", path
                else:
                    assert r.status == 404, path
            r = await http.post("/v1/not_a_route", json={})
            assert r.status == 404 and r.json()["error"]["message"] == "Not found."


#: What the app served before the table existed (de8ca7b's hand dispatch and Quart routes),
#: written out rather than read from the table, so that a row dropped from it fails here.
SERVED = {
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions/batch"), ("POST", "/v1/responses"),
    ("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/invocations"), ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"),
    ("GET", "/tokenizer_info"), ("GET", "/load"), ("GET", "/version"), ("GET", "/v1/models"),
    ("GET", "/v1/models/<path:model_id>"),
    # and since: the Files API (server.http.files)
    ("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/files/<file_id>"),
    ("GET", "/v1/files/<file_id>/content"), ("DELETE", "/v1/files/<file_id>"),
    # the Batch API (server.http.batches)
    ("GET", "/v1/batches"), ("POST", "/v1/batches"), ("GET", "/v1/batches/<batch_id>"),
    ("POST", "/v1/batches/<batch_id>/cancel"),
    # stored responses (server.http.responses_read)
    ("GET", "/v1/responses/<response_id>"), ("GET", "/v1/responses/<response_id>/input_items"),
    ("DELETE", "/v1/responses/<response_id>"), ("POST", "/v1/responses/<response_id>/cancel"),
}


def test_the_table_holds_every_endpoint_served_before_it():
    rows = {(method, route.path) for route in TABLE for method in route.methods}
    assert rows == SERVED
