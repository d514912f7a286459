"""Issue 18, item 2: with API keys, every spelling of a protected route needs a key.

The key check once tested the raw path's prefix while the router merges slashes and takes
absolute-form targets: ``GET //v1/models`` answered 200 without a key. Now every path but
the exact open ones (``/health``, ``/ready``, ``/metrics``) needs a key.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import running_server
from tests.test_hostile import raw_exchange, split_response

SPELLINGS = [
    "/v1/models",
    "//v1/models",
    "///v1/models",
    "//v1/models/sim",
    "/v1//models",
    "/v1/models/",
    "/v1/./models",
    "/v1/../v1/models",
    "/v1/models?x=1",
    "/%2Fv1/models",
    "/v1/models%2F",
    "/V1/models",
    "http://x/v1/models",
    "http://x//v1/models",
    "/health/../v1/models",
    "//health",
    "/metrics/../v1/models",
    "/v1/completions",
    "//v1/completions",
    "/tokenize",
    "/detokenize",
    "*",
]


def get(target: str, headers: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%b\r\n" % (target.encode(), headers)


async def test_no_spelling_of_a_route_is_served_without_the_key():
    async with running_server(api_keys=("k1",)) as url:
        for target in SPELLINGS:
            raw = await raw_exchange(url, get(target), wait=1.0)
            status, headers, body = split_response(raw)
            # 401 (or a 400 for what is not a path at all), never a 2xx or 404 without key
            assert status in (400, 401), (target, raw[:300])
            assert json.loads(body)["error"]["message"], target
        # With the key the same spellings are served (or are an honest 404/405).
        for target in ("/v1/models", "//v1/models", "http://x/v1/models"):
            raw = await raw_exchange(url, get(target, b"Authorization: Bearer k1\r\n"), wait=1.0)
            assert split_response(raw)[0] == 200, (target, raw[:300])


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
async def test_the_probes_stay_open(path):
    async with running_server(api_keys=("k1",)) as url:
        raw = await raw_exchange(url, get(path), wait=1.0)
        assert split_response(raw)[0] == 200, raw[:300]
