"""Request ids (X-Request-Id round trip) and the request log lines, in JSON and text."""

from __future__ import annotations

import io
import json
import logging
import re
from contextlib import contextmanager

import httpx
import openai
import pytest
import trio

from server.cli import build_parser
from server.config import EngineConfig
from server.openai import schema
from server.observability import log_handler, request_id_from_header
from tests.conftest import FAST_SIM, running_server

HEX32 = re.compile(r"[0-9a-f]{32}")


@contextmanager
def captured_log(fmt: str):
    """Every log line (INFO and up) written while the block runs, in format ``fmt``."""
    buffer = io.StringIO()
    handler = log_handler(fmt, buffer)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def wait_for_line(buffer: io.StringIO, marker: str) -> str:
    """The first line with ``marker``: the request line is written just after the response's
    last byte, so the client may get there first."""
    with trio.fail_after(30):
        while True:
            for line in buffer.getvalue().splitlines():
                if marker in line:
                    return line
            await trio.sleep(0.01)


def json_lines(buffer: io.StringIO) -> list[dict]:
    """Parse every line; each must be one JSON object with the base keys."""
    lines = buffer.getvalue().splitlines()
    assert lines
    records = [json.loads(line) for line in lines]
    for r in records:
        assert {"time", "level", "logger", "message"} <= r.keys()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["time"])
    return records


def by_request(records: list[dict], request_id: str) -> list[dict]:
    return [r for r in records if r.get("request_id") == request_id]


async def test_request_id_given_by_the_client_is_used_and_echoed(server_url):
    async with httpx.AsyncClient(base_url=server_url) as http:
        rid = "trace-1.a_b:C"
        r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2},
                            headers={"X-Request-Id": rid})
        assert r.headers["x-request-id"] == rid
        assert r.json()["id"] == "cmpl-" + rid
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"X-Request-Id": rid}) as r:
            assert r.headers["x-request-id"] == rid
            events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        assert {json.loads(e[6:])["id"] for e in events} == {"chatcmpl-" + rid}
        # Errors carry it too: a 400 from the raw route, a 404 from Quart.
        r = await http.post("/v1/completions", json={"prompt": 3}, headers={"X-Request-Id": rid})
        assert r.status_code == 400 and r.headers["x-request-id"] == rid
        r = await http.get("/nope", headers={"X-Request-Id": rid})
        assert r.status_code == 404 and r.headers["x-request-id"] == rid
    # ... and so does the openai SDK's view of a response.
    c = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0)
    raw = await c.completions.with_raw_response.create(
        model="sim", prompt="a", max_tokens=1, extra_headers={"X-Request-Id": "sdk-7"}
    )
    assert raw.headers["x-request-id"] == "sdk-7"
    assert raw.parse().id == "cmpl-sdk-7"


async def test_request_id_is_generated_when_absent_or_invalid(server_url):
    async with httpx.AsyncClient(base_url=server_url) as http:
        r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        rid = r.headers["x-request-id"]
        assert HEX32.fullmatch(rid) and r.json()["id"] == "cmpl-" + rid
        r2 = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r2.headers["x-request-id"] != rid
        for bad in ("x" * 129, "has space", "quote\"", "semi;colon", "<script>", ""):
            r = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1},
                                headers={"X-Request-Id": bad})
            assert r.status_code == 200, bad
            assert HEX32.fullmatch(r.headers["x-request-id"]), bad
        r = await http.get("/health", headers={"X-Request-Id": "x" * 128})
        assert r.headers["x-request-id"] == "x" * 128


def test_request_id_validation():
    assert request_id_from_header(b"abc-1") == ("abc-1", True)
    assert request_id_from_header(b"A" * 128) == ("A" * 128, True)
    for bad in (None, b"", b"A" * 129, b"caf\xc3\xa9", b"a/b", b"a\tb"):
        rid, given = request_id_from_header(bad)
        assert not given and HEX32.fullmatch(rid)


async def test_json_log_lines_one_per_request_with_the_lifecycle(monkeypatch):
    config = EngineConfig(engine_options={**FAST_SIM, "faults": True})
    original_parse = schema.parse_completion

    def parse_and_log(body, *args):
        logging.getLogger("server.test").info("parsing %d bytes", len(body))
        return original_parse(body, *args)

    monkeypatch.setattr(schema, "parse_completion", parse_and_log)
    with captured_log("json") as buffer:
        async with running_server(config) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4},
                                    headers={"X-Request-Id": "ok-1"})
                assert r.status_code == 200
                body = {"prompt": "p", "max_tokens": 20, "stream": True,
                        "fault": {"kind": "error", "after": 2}}
                async with http.stream("POST", "/v1/completions", json=body,
                                       headers={"X-Request-Id": "fails-1"}) as r:
                    await r.aread()
                r = await http.post("/v1/completions", json={"prompt": "a", "n": 99},
                                    headers={"X-Request-Id": "bad-1"})
                assert r.status_code == 400
    records = json_lines(buffer)

    ok = by_request(records, "ok-1")
    # Every line about the request has its id: ours from inside the request, and the end.
    assert [r["logger"] for r in ok] == ["server.test", "server.request"]
    line = ok[-1]
    assert line["level"] == "INFO" and line["message"] == "request finished"
    assert line["status"] == 200 and line["stream"] is False
    assert line["finish_reason"] == "length" and line["finish_reasons"] == ["length"]
    assert line["prompt_tokens"] == 3 and line["completion_tokens"] == 4
    assert line["model"] == "sim"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["arrival"])
    times = [line[k] for k in ("dispatch_ms", "accepted_ms", "first_token_ms", "finish_ms")]
    assert all(isinstance(t, float) for t in times)
    assert 0 <= times[0] <= times[1] <= times[2] <= times[3]
    assert times[2] >= 5.0  # the sim's time to first token

    failed = by_request(records, "fails-1")[-1]
    assert failed["level"] == "WARNING" and failed["message"] == "request failed"
    assert failed["finish_reason"] == "error" and failed["completion_tokens"] == 2
    assert failed["error_type"] == "engine_error"
    assert failed["error"] == "injected engine failure"

    bad = by_request(records, "bad-1")[-1]
    assert bad["message"] == "request rejected" and bad["status"] == 400
    assert bad["dispatch_ms"] is None and bad["error_type"] == "invalid_request_error"
    assert bad["model"] == "sim"  # (refused by the parser, after its model was known)
    assert "'n'" in bad["error"]
    # Lines that are about no request have no request id.
    assert any(r["logger"] == "server.worker" and "request_id" not in r for r in records)


async def test_internal_error_is_logged_with_its_traceback_never_sent(monkeypatch):
    def broken(*args):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(schema, "parse_completion", broken)
    with captured_log("json") as buffer:
        async with running_server() as url:
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"prompt": "a"},
                                    headers={"X-Request-Id": "boom-1"})
    assert r.status_code == 500
    assert "secret" not in r.text and "Traceback" not in r.text
    assert r.json()["error"]["message"] == "Internal server error."
    lines = by_request(json_lines(buffer), "boom-1")
    error = next(r for r in lines if r["level"] == "ERROR")
    assert "Traceback" in error["exc"] and "secret internals" in error["exc"]
    end = lines[-1]
    assert end["message"] == "request failed" and end["status"] == 500


async def test_text_log_line_has_the_request_id_and_fields(server_url):
    with captured_log("text") as buffer:
        async with httpx.AsyncClient(base_url=server_url) as http:
            await http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 3},
                            headers={"X-Request-Id": "text-1"})
        line = await wait_for_line(buffer, "server.request")
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO server\.request \[text-1\]: "
                    r"request finished ", line)
    fields = dict(kv.split("=", 1) for kv in line.split(": ", 1)[1].split()[2:])
    assert fields["status"] == "200" and fields["finish_reason"] == "length"
    assert fields["prompt_tokens"] == "2" and fields["completion_tokens"] == "3"
    assert {"arrival", "dispatch_ms", "accepted_ms", "first_token_ms", "finish_ms"} <= fields.keys()


def test_json_formatter_keeps_a_traceback_on_one_line():
    buffer = io.StringIO()
    logger = logging.getLogger("server.test.formatter")
    logger.addHandler(log_handler("json", buffer))
    logger.propagate = False
    try:
        try:
            raise ValueError("line one\nline two")
        except ValueError:
            logger.exception("it broke: %s", "badly")
    finally:
        logger.handlers.clear()
        logger.propagate = True
    (line,) = buffer.getvalue().splitlines()
    record = json.loads(line)
    assert record["message"] == "it broke: badly" and record["level"] == "ERROR"
    assert "ValueError: line one\nline two" in record["exc"]


def test_log_times_are_of_the_second_each_line_was_made_in():
    # The part of a line's time up to the second is formatted once a second and kept:
    # lines of other seconds, and of a second again after another, still get their own.
    import time

    from server.observability.record import iso_utc

    lines = {"text": io.StringIO(), "json": io.StringIO()}
    handlers = [log_handler(fmt, buffer) for fmt, buffer in lines.items()]
    moments = [1733362000.25, 1733362001.5, 1733362000.75, 1733365601.0, 1733362001.999]
    for created in moments:
        record = logging.LogRecord("server.test.times", logging.INFO, __file__, 1, "m", None,
                                   None)
        record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
        for handler in handlers:
            handler.handle(record)
        assert iso_utc(created) == (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(created)))
            + ".%03dZ" % int((created - int(created)) * 1000))
    reference = logging.Formatter()
    texts = lines["text"].getvalue().splitlines()
    stamps = [json.loads(line)["time"] for line in lines["json"].getvalue().splitlines()]
    for created, text, stamp in zip(moments, texts, stamps, strict=True):
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
        assert text.startswith(reference.formatTime(record) + " INFO server.test.times: m")
        assert stamp == iso_utc(created)


def test_cli_log_options():
    args = build_parser().parse_args(["--log-format", "json", "--log-level", "warning"])
    assert args.log_format == "json" and args.log_level == "warning"
    assert not args.disable_log_requests
    assert build_parser().parse_args(["--disable-log-requests"]).disable_log_requests
    assert build_parser().parse_args([]).log_format == "text"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-format", "xml"])
    with pytest.raises(ValueError):
        log_handler("xml")


def test_configure_logging_changes_only_its_own_handler():
    from server.observability import configure_logging

    root = logging.getLogger()
    other = logging.NullHandler()
    root.addHandler(other)
    level, srcfile = root.level, logging._srcfile
    stream = io.StringIO()
    added = []
    try:
        added.append(configure_logging("info", "text", stream))
        added.append(configure_logging("warning", "json", stream))
        assert other in root.handlers  # a handler of someone else's stays
        assert added[0] not in root.handlers and added[1] in root.handlers  # ours: replaced
        assert logging._srcfile == srcfile  # the logging module's settings too
        logging.getLogger("server.test").warning("one line")
        assert [json.loads(line)["message"] for line in stream.getvalue().splitlines()] == [
            "one line"
        ]
    finally:
        for handler in (other, *added):
            root.removeHandler(handler)
        root.setLevel(level)
