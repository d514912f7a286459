"""API keys on /v1/* (constant-time, OpenAI-style 401) and CORS, through the real server."""

from __future__ import annotations

import hashlib
import hmac

import httpx
import openai
import pytest

from server.cli import API_KEY_ENV, build_parser, config_from_args
from server.http.auth import APIKeys
from server.http.cors import CORSPolicy
from tests.conftest import running_server
from tests.test_metrics import Scrape

KEYS = ("key-one", "key-two", "key-three")


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


@pytest.fixture
def compare_calls(monkeypatch):
    """Every call of hmac.compare_digest, as (a, b) pairs."""
    calls = []
    real = hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    return calls


async def test_api_key_missing_wrong_right(compare_calls):
    async with running_server(api_keys=KEYS) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            body = {"prompt": "a", "max_tokens": 2}
            assert_401(await http.post("/v1/completions", json=body))
            assert_401(await http.post("/v1/completions", json=body, headers=bearer("key-on")))
            assert_401(await http.post("/v1/completions", json=body, headers=bearer("nope")))
            assert_401(await http.post("/v1/completions", json=body,
                                       headers={"Authorization": "Basic key-one"}))
            assert_401(await http.post("/v1/chat/completions", json=body))
            assert_401(await http.get("/v1/models"))
            assert_401(await http.get("/v1/models/sim", headers=bearer("wrong")))
            r = await http.post("/v1/completions", json=body, headers=bearer("key-two"))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            r = await http.get("/v1/models", headers={"authorization": "bearer key-three"})
            assert r.status_code == 200
            # A 401 still has the request id; a GET on a generation route is a 401 first.
            r = await http.get("/v1/completions", headers={"X-Request-Id": "who-1"})
            assert_401(r)
            assert r.headers["x-request-id"] == "who-1"
            # Open: the probe and the scraper carry no key.
            assert (await http.get("/health")).status_code == 200
            r = await http.get("/metrics")
            assert r.status_code == 200
            rejected = Scrape(r.text).value("trio_llm:request_rejections_total", status="401")
            assert rejected >= 5  # the sixth may be recorded just after this scrape

        # Through the SDK: the right key streams, a wrong one is AuthenticationError.
        good = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-one", max_retries=0)
        text = ""
        async for chunk in await good.completions.create(
            model="sim", prompt="x", max_tokens=3, stream=True
        ):
            text += chunk.choices[0].text
        assert len(text.split()) == 3
        bad = openai.AsyncOpenAI(base_url=url + "/v1", api_key="key-four", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.body["code"] == "invalid_api_key"

    # Constant time: each check compared the presented key with every key, without
    # stopping at the match (key-one matches first and still costs three comparisons).
    assert compare_calls and len(compare_calls) % len(KEYS) == 0
    for i in range(0, len(compare_calls), len(KEYS)):
        group = compare_calls[i : i + len(KEYS)]
        assert [a for a, _ in group] == [hashlib.sha256(k.encode()).digest() for k in KEYS]
        assert len({b for _, b in group}) == 1
    presented = {b for _, b in compare_calls}
    assert hashlib.sha256(b"key-two").digest() in presented
    assert hashlib.sha256(b"key-four").digest() in presented


def test_api_keys_unit(compare_calls):
    keys = APIKeys(["a-key", "", "b-key"])  # empty keys are ignored
    assert len(keys) == 2
    assert keys.verify(b"Bearer b-key") and keys.verify(b"BEARER  a-key ")
    assert not keys.verify(None) and not keys.verify(b"Bearer") and not keys.verify(b"b-key")
    assert not keys.verify(b"Token a-key") and not keys.verify(b"Bearer a-key2")
    assert len(compare_calls) == 2 * 7  # every check compares with both keys, match or not
    with pytest.raises(ValueError):
        APIKeys(["", ""])


def test_api_key_options_and_environment(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert config_from_args(parse([])).api_keys == ()
    config = config_from_args(parse(["--api-key", "a,b", "--api-key", "c"]))
    assert config.api_keys == ("a", "b", "c")
    monkeypatch.setenv(API_KEY_ENV, "e1, e2,")
    assert config_from_args(parse([])).api_keys == ("e1", "e2")
    assert config_from_args(parse(["--api-key", "cli"])).api_keys == ("cli",)  # the CLI wins
    config = config_from_args(parse(["--allowed-origins", "https://a.example,https://b.example",
                                      "--allowed-origins", "*"]))
    assert config.allowed_origins == ("https://a.example", "https://b.example", "*")
    assert config_from_args(parse([])).allowed_origins == ()


ORIGIN = "https://app.example.com"


def preflight_headers(origin: str = ORIGIN) -> dict:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }


async def test_cors_preflight_and_response_headers():
    async with running_server(allowed_origins=(ORIGIN,), api_keys=("k",)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            # The preflight carries no key and is answered before the key check.
            r = await http.options("/v1/chat/completions", headers=preflight_headers())
            assert r.status_code == 204
            assert r.headers["access-control-allow-origin"] == ORIGIN
            assert "POST" in r.headers["access-control-allow-methods"]
            allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
            assert {"authorization", "content-type"} <= allowed
            assert int(r.headers["access-control-max-age"]) > 0
            assert r.headers["vary"] == "Origin"
            r = await http.options("/v1/completions",
                                   headers=preflight_headers("https://evil.example"))
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers

            # A streaming answer (raw ASGI) gets the headers...
            headers = {"Origin": ORIGIN, **bearer("k")}
            body = {"prompt": "a", "max_tokens": 2, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                assert r.headers["access-control-allow-origin"] == ORIGIN
                assert r.headers["access-control-expose-headers"].lower() == "x-request-id"
                await r.aread()
            # ... and so do errors, Quart's routes, and the open routes.
            r = await http.post("/v1/completions", json={"prompt": 1}, headers=headers)
            assert r.status_code == 400 and r.headers["access-control-allow-origin"] == ORIGIN
            r = await http.post("/v1/completions", json={}, headers={"Origin": ORIGIN})
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
            r = await http.get("/v1/models", headers=headers)
            assert r.headers["access-control-allow-origin"] == ORIGIN
            r = await http.get("/health", headers={"Origin": ORIGIN})
            assert r.headers["access-control-allow-origin"] == ORIGIN
            # Another origin: no allow header (the browser blocks it), same answer otherwise.
            evil = {"Origin": "https://evil.example", **bearer("k")}
            r = await http.get("/v1/models", headers=evil)
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_cors_any_origin():
    async with running_server(allowed_origins=("*",)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.options("/v1/completions", headers=preflight_headers("http://x.test"))
            assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
            assert "vary" not in r.headers
            r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1},
                                headers={"Origin": "http://y.test"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


async def test_cors_is_off_by_default(server_url):
    async with httpx.AsyncClient(base_url=server_url) as http:
        r = await http.options("/v1/completions", headers=preflight_headers())
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1},
                            headers={"Origin": ORIGIN})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_policy_unit():
    policy = CORSPolicy(["https://a.example/", " https://b.example "])
    assert policy.allow_origin(b"https://a.example") == b"https://a.example"
    assert policy.allow_origin(b"https://b.example") == b"https://b.example"
    assert policy.allow_origin(b"https://c.example") is None
    assert policy.allow_origin(None) is None
    assert policy.preflight_headers(b"https://c.example", None) is None
    with pytest.raises(ValueError):
        CORSPolicy([" "])
