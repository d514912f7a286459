"""The Files API (/v1/files, server/http/files.py): a batch input file's lines checked at
upload (server/openai/batch_input.py), the list's query, and the openai SDK end to end
through a real server on the sim: upload, list, retrieve, content, delete; the size limit;
the form's refusals; another key's files."""

from __future__ import annotations

import json

import pytest

from server.errors import ClientError
from server.openai.batch_input import batch_lines, check_batch_file
from server.openai.files import parse_list_query, upload_purpose


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
                        ({"limit": ["x"]}, "limit"), ({"order": ["up"]}, "order"),
                        ({"before": ["file-x"]}, "before"), ({"limit": ["1", "2"]}, "limit")]:
        with pytest.raises(ClientError) as info:
            parse_list_query(args)
        assert info.value.param == param
