"""The Files API (/v1/files, server/http/files.py): a batch input file's lines checked at
upload (server/openai/batch_input.py), the list's query, and the openai SDK end to end
through a real server on the sim: upload, list, retrieve, content, delete; the size limit;
the form's refusals; another key's files. The end-to-end and ownership tests on SQLite and
PostgreSQL."""

from __future__ import annotations

import json

import h11
import httpx
import openai
import pytest
import trio

from server.errors import ClientError
from server.http.upload import FORM_OVERHEAD
from server.openai.batch_input import batch_lines, check_batch_file
from server.openai.files import parse_list_query, upload_purpose
from tests.conftest import running_server
from tests.postgres_server import STORES, state_options
from tests.test_connection import header, read_response
from tests.test_hostile import addr, raw_exchange, split_response


def line(custom_id="r1", **changes) -> bytes:
    data = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}}
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not None}).encode()


def batch_file(n: int) -> bytes:
    return b"".join(line(f"r{i}") + b"\n" for i in range(n))


def refusal(content: bytes) -> ClientError:
    with pytest.raises(ClientError) as info:
        check_batch_file(content)
    assert info.value.status == 400 and info.value.param == "file"
    return info.value


# -- the batch input file's lines (sans-IO) ------------------------------------------------


def test_a_good_file_counts_its_requests_with_or_without_a_final_newline():
    assert check_batch_file(batch_file(3)) == 3
    assert check_batch_file(batch_file(3).rstrip(b"\n")) == 3
    assert check_batch_file(batch_file(2).replace(b"\n", b"\r\n")) == 2
    urls = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
    content = b"\n".join(line(f"r{i}", url=url) for i, url in enumerate(urls))
    assert [x.url for x in batch_lines(content)] == list(urls)
    assert check_batch_file(content) == 4


@pytest.mark.parametrize("bad, code, words", [
    (b"{not json", "invalid_json_line", "not valid JSON"),
    (b"[1, 2]", "invalid_json_line", "not a JSON object"),
    (b"", "invalid_json_line", "an empty line"),
    (b"   ", "invalid_json_line", "an empty line"),
    (line(custom_id=None), "missing_required_parameter", "'custom_id' is missing"),
    (line(body=None), "missing_required_parameter", "'body' is missing"),
    (line(custom_id=""), "invalid_custom_id", "non-empty string"),
    (line(custom_id=7), "invalid_custom_id", "non-empty string"),
    (line(method="GET"), "invalid_method", "'method' must be 'POST'"),
    (line(url="/v1/files"), "invalid_url", "'url' must be one of"),
    (line(body=[1]), "invalid_body", "'body' must be a JSON object"),
    (line(extra=1), "unsupported_parameter", "unknown key 'extra'"),
    (line("r0"), "duplicate_custom_id", "'custom_id' 'r0' repeats line 1's"),
])
def test_the_first_bad_line_is_named(bad, code, words):
    # line 3 is bad (and, the second time, line 5 too): the 400 names line 3
    lines = [line("r0"), line("r1"), bad, line("r3"), line("r4")]
    for content in (lines, [*lines[:4], b"{", *lines[4:]]):
        error = refusal(b"\n".join(content) + b"\n")
        assert error.code == code, error.message
        assert error.message.startswith("Line 3 of the file: ") and words in error.message


def test_a_file_without_requests_is_refused():
    assert refusal(b"").code == "empty_file"
    assert refusal(b"\n").message.startswith("Line 1 of the file: an empty line")


# -- the form's fields and the list's query (sans-IO) --------------------------------------


def test_purposes_other_than_batch_are_refused_by_name():
    assert upload_purpose({"purpose": "batch"}) == "batch"
    for purpose in ("assistants", "user_data", "fine-tune", "vision", "evals",
                    "batch_output", "nonsense"):
        with pytest.raises(ClientError) as info:
            upload_purpose({"purpose": purpose})
        assert info.value.param == "purpose" and f"'{purpose}'" in info.value.message
    for fields, param in [({}, "purpose"), ({"purpose": "batch", "x": "1"}, "x"),
                          ({"purpose": "batch", "expires_after[anchor]": "created_at"},
                           "expires_after")]:
        with pytest.raises(ClientError) as info:
            upload_purpose(fields)
        assert info.value.param == param


def test_the_list_query():
    query = parse_list_query({})
    assert (query.purpose, query.limit, query.after, query.newest_first) == (
        None, 10_000, None, True)
    query = parse_list_query({"purpose": ["batch"], "limit": ["2"], "after": ["file-x"],
                              "order": ["asc"]})
    assert (query.purpose, query.limit, query.after, query.newest_first) == (
        "batch", 2, "file-x", False)
    for args, param in [({"limit": ["0"]}, "limit"), ({"limit": ["10001"]}, "limit"),
                        ({"limit": ["x"]}, "limit"), ({"limit": ["\u00b2"]}, "limit"),
                        ({"limit": ["9" * 5000]}, "limit"), ({"order": ["up"]}, "order"),
                        ({"before": ["file-x"]}, "before"), ({"limit": ["1", "2"]}, "limit")]:
        with pytest.raises(ClientError) as info:
            parse_list_query(args)
        assert info.value.param == param


@pytest.fixture(params=STORES)
def store_options(request, tmp_path) -> dict:
    """Where a test's server keeps its state: SQLite, or PostgreSQL (tests/postgres_server.py)."""
    return state_options(request, tmp_path, "f")


# -- the openai SDK end to end, on the sim -------------------------------------------------


BOUNDARY = "a-boundary"
FORM = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def form(parts) -> bytes:
    """A multipart/form-data body of ``(name, filename or None, content)`` parts."""
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (
            f'; filename="{filename}"' if filename is not None else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += content + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def client_of(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def test_upload_list_retrieve_content_delete_with_the_sdk(store_options):
    async with running_server(**store_options) as url:
        client = client_of(url)
        first = await client.files.create(file=("a.jsonl", batch_file(3)), purpose="batch")
        content = batch_file(200)
        second = await client.files.create(file=("b.jsonl", content), purpose="batch")
        assert first.id.startswith("file-") and first.id != second.id
        assert (second.object, second.bytes, second.filename, second.purpose,
                second.status) == ("file", len(content), "b.jsonl", "batch", "processed")
        assert second.created_at >= first.created_at
        # the list: newest first by default, in pages (the SDK follows has_more)
        page = await client.files.list()
        assert [f.id for f in page.data] == [second.id, first.id] and not page.has_more
        page = await client.files.list(limit=1)
        assert [f.id for f in page.data] == [second.id] and page.has_more
        assert [f.id async for f in await client.files.list(limit=1)] == [second.id, first.id]
        page = await client.files.list(order="asc", purpose="batch")
        assert [f.id for f in page.data] == [first.id, second.id]
        page = await client.files.list(purpose="batch_output")
        assert page.data == [] and not page.has_more
        # retrieve, content, delete
        assert await client.files.retrieve(second.id) == second
        assert (await client.files.content(second.id)).content == content
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.get(f"/v1/files/{first.id}/content")
        assert r.headers["content-type"] == "application/octet-stream"
        assert r.content == batch_file(3)
        deleted = await client.files.delete(first.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (first.id, "file", True)
        for call in (client.files.retrieve, client.files.content, client.files.delete):
            with pytest.raises(openai.NotFoundError) as info:
                await call(first.id)
            assert first.id in info.value.message
        assert [f.id for f in (await client.files.list()).data] == [second.id]


async def test_bad_uploads_are_refused_naming_what_is_wrong():
    async with running_server() as url:
        client = client_of(url)
        bad = batch_file(2) + line("r5", method="GET") + b"\n" + b"{\n"
        with pytest.raises(openai.BadRequestError) as info:
            await client.files.create(file=("a.jsonl", bad), purpose="batch")
        error = info.value.body
        assert (error["param"], error["code"]) == ("file", "invalid_method")
        assert error["message"].startswith("Line 3 of the file: ")
        with pytest.raises(openai.BadRequestError) as info:
            await client.files.create(file=("a.jsonl", batch_file(1)), purpose="assistants")
        assert info.value.body["param"] == "purpose"
        assert "'assistants' is not supported" in info.value.body["message"]
        async with httpx.AsyncClient(base_url=url) as http:
            for parts, param in [
                ([("file", "a.jsonl", batch_file(1))], "purpose"),
                ([("purpose", None, b"batch")], "file"),
                ([("purpose", None, b"batch"), ("file", None, batch_file(1))], "file"),
                ([("purpose", None, b"batch"), ("x", None, b"1")], "x"),
                ([("purpose", None, b"batch"), ("purpose", None, b"batch")], "purpose"),
            ]:
                r = await http.post("/v1/files", content=form(parts), headers=FORM)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, parts
            # not a form: 415 naming the content type
            r = await http.post("/v1/files", json={"purpose": "batch"})
            assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
            r = await http.put("/v1/files", content=b"")
            assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
        # nothing of these was stored
        assert (await client.files.list()).data == []


async def test_an_upload_over_the_limit_is_a_413_before_its_end_and_the_server_goes_on():
    limit = 64 * 1024
    async with running_server(max_file_bytes=limit, max_body_bytes=1000) as url:
        client = client_of(url)
        big = batch_file(limit // len(line("r0")) + 100)
        assert len(big) > limit
        with pytest.raises(openai.APIStatusError) as info:
            await client.files.create(file=("big.jsonl", big), purpose="batch")
        assert info.value.status_code == 413
        assert (info.value.body["param"], info.value.body["code"]) == ("file",
                                                                        "payload_too_large")
        # within the limit (and past --max-body-bytes, which is not an upload's limit)
        small = batch_file(100)
        assert 1000 < len(small) < limit
        stored = await client.files.create(file=("small.jsonl", small), purpose="batch")
        assert (await client.files.content(stored.id)).content == small
        # a chunked body, with no length to refuse at once: the 413 comes at the first
        # byte over, while the client has not sent the rest
        sock = await trio.open_tcp_stream(*addr(url))
        conn = h11.Connection(h11.CLIENT)
        start = form([("purpose", None, b"batch")]).removesuffix(f"--{BOUNDARY}--\r\n".encode())
        start += (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
                  f'filename="big.jsonl"\r\n\r\n').encode()
        await sock.send_all(conn.send(h11.Request(
            method="POST", target="/v1/files",
            headers=[("Host", "t"), ("Transfer-Encoding", "chunked"), *FORM.items()])))
        await sock.send_all(conn.send(h11.Data(data=start)))
        for _ in range(limit // 4096 + 1):
            await sock.send_all(conn.send(h11.Data(data=big[:4096])))
        with trio.fail_after(60):  # (a hang guard: the answer comes at once)
            response, raw, _ = await read_response(sock, conn)
        assert response.status_code == 413 and header(response, b"connection") == b"close"
        assert json.loads(raw)["error"]["param"] == "file"
        await sock.aclose()
        # Expect: 100-continue: over the file limit a 413 from the head, at once; within
        # it (past --max-body-bytes) a 100 Continue
        head = (f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: {FORM['Content-Type']}"
                "\r\nConnection: close\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n")
        raw = await raw_exchange(url, (head % (2 * limit + FORM_OVERHEAD)).encode())
        assert split_response(raw)[0] == 413, raw[:200]
        async with await trio.open_tcp_stream(*addr(url)) as stream:
            await stream.send_all((head % (limit // 2)).encode())
            raw = b""
            with trio.fail_after(60):
                while b"\r\n\r\n" not in raw:
                    raw += await stream.receive_some(65536)
        assert raw.startswith(b"HTTP/1.1 100 "), raw[:200]
        assert [f.id for f in (await client.files.list()).data] == [stored.id]


async def test_another_keys_files_are_not_found_and_a_full_quota_is_a_413(store_options):
    quota = 40_000
    async with running_server(api_keys=("key-a", "key-b"), state_max_bytes_per_key=quota,
                              **store_options) as url:
        a, b = client_of(url, "key-a"), client_of(url, "key-b")
        mine = await a.files.create(file=("a.jsonl", batch_file(2)), purpose="batch")
        theirs = await b.files.create(file=("b.jsonl", batch_file(1)), purpose="batch")
        for call in (b.files.retrieve, b.files.content, b.files.delete):
            with pytest.raises(openai.NotFoundError):  # (not 403: no existence oracle)
                await call(mine.id)
        assert [f.id for f in (await a.files.list()).data] == [mine.id]
        assert [f.id for f in (await b.files.list()).data] == [theirs.id]
        assert (await a.files.content(mine.id)).content == batch_file(2)
        with pytest.raises(openai.AuthenticationError):
            await client_of(url, "key-c").files.list()
        # a key's quota: what does not fit is a 413 naming it; the other key's room stays
        half = batch_file(quota // 2 // len(line("r00")))
        await a.files.create(file=("c.jsonl", half), purpose="batch")
        with pytest.raises(openai.APIStatusError) as info:
            await a.files.create(file=("d.jsonl", half), purpose="batch")
        assert (info.value.status_code, info.value.body["code"]) == (413,
                                                                      "storage_quota_exceeded")
        assert len((await a.files.list()).data) == 2
        await b.files.create(file=("d.jsonl", half), purpose="batch")
        async with httpx.AsyncClient(base_url=url) as http:
            for r in (await http.get(f"/v1/files/{mine.id}"),
                      await http.post("/v1/files", content=form([]), headers=FORM)):
                assert r.status_code == 401
