"""``POST /v1/embeddings``: request parsing (sans-IO), the sim engine end to end with the
openai SDK (float and base64), and the transformers engine on a tiny random embedding model
built here, against the same model run directly in transformers.

(Not to be confused with tests/test_embedding.py: the server embedded as a library.)
"""

from __future__ import annotations

import base64
import json
import math
import struct

import httpx
import openai
import pytest
import trio

from server.config import EngineConfig
from server.errors import ClientError, NotFound
from server.http.embeddings import parse_embeddings
from server.worker_protocol import wire
from server.workers.main import handle_message
from server.engines.sim.engine import SimEngine
from tests.conftest import JSON, running_server

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)

SIM_INFO = SimEngine().info
LIMIT = 240  # seconds for a test that starts processes that import torch (busy CI cores)


def parse(body: dict, info: dict | None = None) -> dict:
    return parse_embeddings(json.dumps(body).encode(), "m", info or SIM_INFO)[0]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / (norm(a) * norm(b))


def test_the_four_input_shapes():
    assert parse({"input": "a b"})["input"] == ["a b"]
    assert parse({"input": ["a", "b c"]})["input"] == ["a", "b c"]
    assert parse({"input": [1, 2, 3]})["input"] == [[1, 2, 3]]
    assert parse({"input": [[1], [2, 3]], "model": "m", "user": "u"})["input"] == [[1], [2, 3]]
    assert parse({"input": "a", "dimensions": 8})["dimensions"] == 8
    size = SIM_INFO["embedding"]["size"]
    assert parse({"input": "a", "dimensions": size})["dimensions"] is None  # nothing to cut
    assert parse({"input": "a", "add_special_tokens": True, "normalize": True})["op"] == "embed"


GENERATION_INFO = {"engine": "transformers", "model": "m", "max_model_len": 64}
FIXED_SIZE = {**SIM_INFO, "embedding": {"size": 16, "dimensions": False}}


@pytest.mark.parametrize(
    "body, info, param",
    [
        ({}, None, "input"),
        ({"input": ""}, None, "input[0]"),
        ({"input": []}, None, "input"),
        ({"input": ["a", ""]}, None, "input[1]"),
        ({"input": [[1], []]}, None, "input[1]"),
        ({"input": ["a", [1]]}, None, "input[1]"),
        ({"input": [[1, -1]]}, None, "input[0]"),
        ({"input": [1.5]}, None, "input[0]"),
        ({"input": [True]}, None, "input[0]"),
        ({"input": ["a"] * 2049}, None, "input"),
        ({"input": "a", "encoding_format": "int8"}, None, "encoding_format"),
        ({"input": "a", "dimensions": 0}, None, "dimensions"),
        ({"input": "a", "dimensions": 99999}, None, "dimensions"),
        ({"input": "a", "dimensions": 8}, FIXED_SIZE, "dimensions"),
        ({"input": "a", "user": 3}, None, "user"),
        ({"input": "a", "model": 3}, None, "model"),
        ({"input": "a", "surprise": 1}, None, "surprise"),
        ({"input": "a", "normalize": False}, None, "normalize"),
        ({"input": "a", "truncate_prompt_tokens": 3}, None, "truncate_prompt_tokens"),
        ({"input": "a"}, GENERATION_INFO, "model"),
        ({"input": "a"}, {**GENERATION_INFO, "engine": "vllm"}, "model"),
    ],
)
def test_bad_requests_name_the_field(body, info, param):
    with pytest.raises(ClientError) as caught:
        parse(body, info)
    assert caught.value.param == param and caught.value.status == 400
    if info is not None and info.get("engine") == "vllm":
        assert "runner=pooling" in caught.value.message


def test_another_model_is_not_found():
    with pytest.raises(NotFound):
        parse({"input": "a", "model": "other"})


def test_the_worker_checks_what_it_is_sent():
    """The worker does not trust its peer: a malformed embed request is an error answer."""
    engine = SimEngine()
    for request in ({"op": "embed", "input": []}, {"op": "embed", "input": "a"},
                    {"op": "embed", "input": [[1, "x"]]},
                    {"op": "embed", "input": ["a"], "dimensions": 10**6}):
        reply = handle_message(engine, [wire.CALL, 1, request], [], [])
        assert reply is not None and reply[2] is None and reply[3][0] == "invalid_request"
    assert engine.forwards == 0


def test_a_fault_reaches_only_the_sim_that_takes_faults():
    """The ``fault`` test hook is the sim's with --sim-faults: a worker whose engine does
    not take it refuses it by name, an embedding and a generation alike, before the
    engine is called (it used to be passed to every engine's embed, which ignored it)."""
    slow = {"kind": "slow_step", "seconds": 0.0}
    plain = SimEngine()  # (as any real engine: no faults)
    embed = [wire.CALL, 1, {"op": "embed", "input": ["a"], "fault": slow}]
    reply = handle_message(plain, embed, [], [])
    assert reply is not None and reply[2] is None
    assert reply[3][0] == "invalid_request" and "'fault'" in reply[3][1]
    assert plain.forwards == 0
    accepts: list = []
    outputs: list = []
    handle_message(plain, [wire.SUBMIT, 5, "a b", {"max_tokens": 3, "fault": slow}],
                   accepts, outputs)
    assert not accepts and plain.running() + plain.waiting() == 0
    assert [(o.rid, o.finish, o.error[0]) for o in outputs] == [(5, "error", "invalid_request")]
    assert "'fault'" in outputs[0].error[1]
    faulty = SimEngine(faults=True)
    reply = handle_message(faulty, embed, [], [])
    assert reply is not None and reply[3] is None and faulty.forwards == 1
    bad = [wire.CALL, 2, {"op": "embed", "input": ["a"], "fault": "slow"}]
    reply = handle_message(faulty, bad, [], [])
    assert reply is not None and reply[3] == ["invalid_request", "'fault' must be an object"]


def test_one_request_is_one_engine_batch():
    engine = SimEngine()
    reply = handle_message(
        engine, [wire.CALL, 1, {"op": "embed", "input": ["a b", "c", [1, 2, 3]]}], [], [])
    assert reply is not None and reply[3] is None
    assert len(reply[2]["data"]) == 3 and reply[2]["prompt_tokens"] == 6
    assert engine.forwards == 1


def floats(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))


async def test_sim_end_to_end_with_the_openai_sdk(server_url):
    sdk = client(server_url)
    texts = ["the quick brown fox", "the quick brown dog", "café 日本 🙂"]
    as_float = await sdk.embeddings.create(model="sim", input=texts, encoding_format="float")
    as_b64 = await sdk.embeddings.create(model="sim", input=texts, encoding_format="base64")
    default = await sdk.embeddings.create(model="sim", input=texts)  # the SDK asks base64
    assert [d.index for d in as_float.data] == [0, 1, 2]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == 11
    assert as_b64.usage.prompt_tokens == 11
    for f, b, d in zip(as_float.data, as_b64.data, default.data):
        assert len(f.embedding) == SIM_INFO["embedding"]["size"]
        assert abs(norm(f.embedding) - 1) < 1e-5
        assert f.embedding == d.embedding
        assert f.embedding == floats(base64.b64decode(b.embedding))  # type: ignore[arg-type]
    # Deterministic, and alike where the words are.
    again = await sdk.embeddings.create(model="sim", input=texts[0], encoding_format="float")
    assert again.data[0].embedding == as_float.data[0].embedding
    vectors = [d.embedding for d in as_float.data]
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    cut = await sdk.embeddings.create(model="sim", input=[[5, 6, 7]], dimensions=8,
                                      encoding_format="float")
    assert len(cut.data[0].embedding) == 8 and abs(norm(cut.data[0].embedding) - 1) < 1e-5
    assert cut.usage.prompt_tokens == 3
    async with httpx.AsyncClient(base_url=server_url, timeout=30) as http:
        r = await http.post("/v1/embeddings", json={"input": "a", "surprise": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "surprise"
        r = await http.post("/v1/embeddings", content=b'{"input": ""}', headers=JSON)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
        # A sim worker makes text too: the same server still generates.
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


# -- the transformers engine ----------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from server.engines.transformers.embed import TransformersEmbedder, pooling_of  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

torch.set_num_threads(1)  # two shared cores (see tests/test_transformers_engine.py)


def build_tiny_embedder(path, *, pooling: str | None = None, **shape):
    """The tiny Llama of tests/tiny_model.py without its head (a LlamaModel), with its
    tokenizer; with ``pooling``, as a sentence-transformers directory that names it."""
    source = build_tiny_model(path.parent / (path.name + "-lm"), **shape)
    lm = transformers.AutoModelForCausalLM.from_pretrained(source)
    lm.model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(path)
    if pooling is not None:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
        ]))
        (path / "1_Pooling").mkdir()
        flags = {"pooling_mode_mean_tokens": pooling == "mean",
                 "pooling_mode_lasttoken": pooling == "last",
                 "pooling_mode_cls_token": pooling == "cls"}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    return path


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    return build_tiny_embedder(tmp_path_factory.mktemp("emb") / "tiny-embed")


@pytest.fixture(scope="module")
def last_token_dir(tmp_path_factory):
    return build_tiny_embedder(tmp_path_factory.mktemp("emb") / "tiny-last", pooling="last")


def direct(path, text_or_ids, pooling: str) -> list[float]:
    """The model run directly in transformers, one input alone (no padding)."""
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = text_or_ids if isinstance(text_or_ids, list) else tokenizer.encode(text_or_ids)
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    vector = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=-1).tolist()


INPUTS = ["the quick brown fox jumps over the lazy dog", "café", "日本語 🚀 résumé model", [7, 8]]


@pytest.mark.parametrize("which, pooling", [("embedder_dir", "mean"),
                                            ("last_token_dir", "last")])
def test_vectors_match_the_model_run_directly(which, pooling, request):
    path = request.getfixturevalue(which)
    assert pooling_of(str(path)) == pooling
    engine = TransformersEmbedder(model_path=str(path))
    reply = handle_message(engine, [wire.CALL, 1, {"op": "embed", "input": INPUTS}], [], [])
    assert reply is not None and reply[3] is None
    assert engine.forwards == 1  # four inputs of different lengths, one padded forward
    for item, data in zip(INPUTS, reply[2]["data"]):
        assert cosine(floats(data), direct(path, item, pooling)) >= 0.9999
    # A request too big for one forward is refused (its forward would silence the worker).
    engine.max_embed_tokens = 8
    reply = handle_message(engine, [wire.CALL, 2, {"op": "embed", "input": INPUTS}], [], [])
    assert reply is not None and "send fewer inputs" in reply[3][1]
    assert engine.forwards == 1


async def test_transformers_embeddings_end_to_end(embedder_dir, tmp_path):
    config = EngineConfig(engine="transformers", drain_timeout=5.0,
                          engine_options={"model_path": str(embedder_dir), "num_threads": 1})
    with trio.fail_after(LIMIT):
        async with running_server(config) as url:
            sdk = client(url)
            for encoding in ("float", "base64"):
                answer = await sdk.embeddings.create(
                    model="tiny-embed", input=INPUTS[:2], encoding_format=encoding)  # type: ignore[arg-type]
                assert len(answer.data) == 2 and answer.usage.prompt_tokens > 2
                got = answer.data[0].embedding
                if encoding == "base64":
                    got = floats(base64.b64decode(got))  # type: ignore[arg-type]
                assert cosine(got, direct(embedder_dir, INPUTS[0], "mean")) >= 0.9999
            async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
                # The minimal body, as client libraries send it by default (issue 41).
                r = await http.post("/v1/embeddings", json={"model": "tiny-embed", "input": "hi"})
                assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
                bad = [
                    ({"input": "a", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
                    ({"input": [[1, 10**6]]}, "input[0]"),  # a token id out of the vocabulary
                ]
                for body, param in bad:
                    r = await http.post("/v1/embeddings", json=body)
                    assert r.status_code == 400, r.text
                    assert r.json()["error"]["param"] == param
                r = await http.post("/v1/embeddings", json={"input": [[1, 10**6]]})
                assert "token ids must be between 0 and" in r.json()["error"]["message"]
                r = await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
                r = await http.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "model"


async def test_a_generation_model_refuses_embeddings(transformers_server, transformers_url):
    with trio.fail_after(LIMIT):
        async with httpx.AsyncClient(base_url=transformers_url, timeout=LIMIT) as http:
            r = await http.post("/v1/embeddings", json={"input": "hi"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert "generation model" in r.json()["error"]["message"]
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
    # The worker refuses too, should a frontend send it anyway.
    from server.engines.transformers.engine import TransformersEngine

    path = transformers_server.model_dir
    reply = handle_message(TransformersEngine(model_path=str(path)),
                           [wire.CALL, 1, {"op": "embed", "input": ["hi"]}], [], [])
    assert reply is not None and "not an embedding model" in reply[3][1]



VLLM_SHAPE = {"hidden_size": 256, "heads": 4, "layers": 2, "vocab_size": 1000,
              "max_position_embeddings": 512}  # vLLM's CPU attention: head size >= 32


async def test_vllm_pooling_runner_end_to_end(tmp_path):
    """vLLM's pooling runner in a real worker (vLLM is never imported here: the reference
    is transformers, last-token pooling, vLLM's default for a headless decoder)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    path = build_tiny_embedder(tmp_path / "tiny-vllm-embed", **VLLM_SHAPE)
    engine_args = {"runner": "pooling", "dtype": "float32", "max_model_len": 512,
                   "kv_cache_memory_bytes": 64 << 20,
                   "enforce_eager": True}  # (no compilation: ~10 s of CPU a start-up)
    config = EngineConfig(engine="vllm", drain_timeout=5.0, startup_timeout=900,
                          engine_options={"model_path": str(path), "engine_args": engine_args})
    with trio.fail_after(1200):
        async with running_server(config) as url:
            sdk = client(url)
            for encoding in ("float", "base64"):
                answer = await sdk.embeddings.create(
                    model="tiny-vllm-embed", input=INPUTS[:3], encoding_format=encoding)  # type: ignore[arg-type]
                assert len(answer.data) == 3
                for item, got in zip(INPUTS, (d.embedding for d in answer.data)):
                    if encoding == "base64":
                        got = floats(base64.b64decode(got))  # type: ignore[arg-type]
                    assert cosine(got, direct(path, item, "last")) >= 0.9999
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                r = await http.post("/v1/embeddings",
                                    json={"model": "tiny-vllm-embed", "input": "hi"})
                assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
                r = await http.post("/v1/embeddings", json={"input": [[1, 10**6]]})
                assert r.status_code == 400
                r = await http.post("/v1/embeddings", json={"input": "a", "dimensions": 8})
                assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
                r = await http.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "model"


async def test_an_embeddings_request_too_big_for_one_computation_is_refused(caplog):
    """Issue 42 item 4: the sim computed a 4 MB request for 22 s (every stream on its worker
    waited); now it refuses one past its token cap, as the transformers engine does, and
    /v1/embeddings writes its request log line like a generation request."""
    import logging

    caplog.set_level(logging.INFO, logger="server.request")
    config = EngineConfig(engine_options={"itl_ms": 2.0, "ttft_ms": 5.0,
                                          "max_model_len": 4000, "max_embed_tokens": 5000})
    with trio.fail_after(LIMIT):
        async with running_server(config) as url:
            async with httpx.AsyncClient(base_url=url, timeout=LIMIT) as http:
                r = await http.post("/v1/embeddings", json={"input": ["w " * 3000] * 2})
                assert r.status_code == 400, r.text
                assert "send fewer inputs" in r.json()["error"]["message"]
                r = await http.post("/v1/embeddings", json={"input": ["w " * 3000]})
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3000
    lines = [r for r in caplog.records if r.name == "server.request"]
    fields = [line.msg.fields for line in lines]
    assert [(f["route"], f["status"], f["prompt_tokens"]) for f in fields] == [
        ("/v1/embeddings", 400, 0), ("/v1/embeddings", 200, 3000)], fields
    assert [line.getMessage().split(" ", 2)[:2] for line in lines] == [
        ["request", "rejected"], ["request", "finished"]]
