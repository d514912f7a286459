"""``--model-config``: several models from a YAML or JSON file, checked as the command line
is (each error names the file, the model and its key); the model table that resolves a
request's ``model`` to its pool. Sans-IO: no worker is started."""

from __future__ import annotations

import json

import pytest

from server.cli import build_parser, config_from_args
from server.config import EngineConfig, ModelConfig, ServerConfig
from server.errors import ClientError, NotFound
from server.http.models import ModelTable, requested_model

YAML = """
models:
  - name: small
    engine: sim
    sim-itl-ms: 4
    engine_workers: 2
    max-concurrent-requests: 3
  - name: large
    engine: vllm
    model: /models/large
    max-batch: 8
    enforce-eager: true
    enable-prefix-caching: false
    engine-arg: {kv_cache_memory_bytes: 1073741824, quantization: fp8}
    routing: round-robin
  - name: remote
    worker-address: [127.0.0.1:9000, "unix:/tmp/w.sock"]
"""


def config(tmp_path, text: str, *argv: str) -> ServerConfig:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return config_from_args(build_parser().parse_args(["--model-config", str(path), *argv]))


def refused(tmp_path, text: str, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        config(tmp_path, text, *argv)
    return str(exc.value)


def test_each_model_is_a_pool_with_its_own_options(tmp_path):
    c = config(tmp_path, YAML, "--max-restarts", "2", "--max-concurrent-sequences", "40")
    small, large, remote = c.pools()
    assert [m.engine.model for m in c.pools()] == ["small", "large", "remote"]
    assert c.engine == EngineConfig()
    assert small.engine.workers == 2 and small.engine.engine_options["itl_ms"] == 4.0
    assert small.engine.worker_argument()["options"]["model"] == "small"
    assert (small.max_concurrent_requests, small.max_concurrent_sequences) == (3, 40)
    assert large.engine.engine == "vllm" and large.engine.routing == "round-robin"
    assert large.engine.engine_options == {
        "model_path": "/models/large", "model": "large", "max_batch": 8,
        "enable_prefix_caching": False,
        "engine_args": {"kv_cache_memory_bytes": 1073741824, "quantization": "fp8",
                        "enforce_eager": True},
    }
    assert (large.max_concurrent_requests, large.max_concurrent_sequences) == (None, 40)
    assert [str(a) for a in remote.engine.worker_addresses] == [
        "127.0.0.1:9000", "unix:/tmp/w.sock"]
    assert remote.engine.engine_options == {}
    # the command line's pool options are every model's default; the entries' their own
    assert {m.engine.max_restarts for m in (small, large)} == {2}
    assert small.engine.routing == "prefix"


def test_json_is_read_too(tmp_path):
    text = json.dumps({"models": [{"name": "a"}, {"name": "b", "sim-faults": True}]})
    c = config(tmp_path, text)
    assert [m.engine.model for m in c.models] == ["a", "b"]
    assert c.limits.allow_faults  # the fault field reaches a model that honours it


@pytest.mark.parametrize("text, words", [
    ("models: [{name: a, foo: 1}]", "models[0].foo: not an option of a model"),
    ("models: [{name: a}, {engine: sim}]", "models[1].name: each model needs its name"),
    ("models: [{name: a}, {name: a}]", "models[1].name: 'a' is served twice"),
    ("models: [{name: a, sim-itl-ms: fast}]", "models[0] (a): argument --sim-itl-ms: expected a number"),
    ("models: [{name: a, engine: nope}]", "models[0] (a): argument --engine: invalid choice"),
    ("models: [{name: a, max-batch: [1, 2]}]", "models[0].max-batch: a string or a number"),
    ("models: [{name: a, max-batch: }]", "models[0].max-batch: a string or a number"),
    ("models: [{name: a, enforce-eager: 1}]", "models[0].enforce-eager: true or false"),
    ("models: [{name: a, served-model-name: b}]", "models[0].served-model-name: not an"),
    ("models: [{name: a, api-key: k}]", "models[0].api-key: not an option of a model"),
    ("models: [{name: a, enforce-eager: true}]", "models[0] (a): --enforce-eager is an "
     "option of the vllm engine"),
    ("models: [{name: a, engine: vllm}]", "models[0] (a): --engine vllm needs a model"),
    ("models: [{name: a, worker-address: 'h:1', max-batch: 2}]",
     "models[0] (a): --max-batch: not with --worker-address"),
    ("models: [{name: a, routing-balance: -1}]",
     "argument --routing-balance: expected an integer of at least 0"),
    ("models: []", "'models' must be a list of one model or more"),
    ("models: [{name: a}]\nport: 1", "a mapping with one key, 'models'"),
    ("[a, b]", "a mapping with one key, 'models'"),
    ("models: [a]", "models[0]: a model is a mapping"),
    ("models: [{name: a", "not YAML or JSON"),
])
def test_a_bad_file_is_refused_naming_the_field(tmp_path, text, words):
    message = refused(tmp_path, text)
    assert message.startswith(f"trio-llm-server: {tmp_path / 'models.yaml'}: "), message
    assert words in message, message


@pytest.mark.parametrize("argv, words", [
    (["--engine", "vllm"], "--engine: not with --model-config"),
    (["--sim-itl-ms", "3"], "--sim-itl-ms: not with --model-config"),
    (["--served-model-name", "x"], "--served-model-name: not with --model-config"),
    (["m"], "MODEL: not with --model-config"),
    (["--worker-address", "h:1"], "--worker-address: not with --model-config"),
    (["--api-servers", "2"], "--model-config: not with --api-servers"),
])
def test_a_models_option_on_the_command_line_is_refused(tmp_path, argv, words):
    assert words in refused(tmp_path, "models: [{name: a}]", *argv)


def test_the_queue_time_limit_is_each_models_own(tmp_path):
    text = YAML.replace("    max-concurrent-requests: 3\n",
                        "    max-concurrent-requests: 3\n    max-queue-time: 2.5\n")
    c = config(tmp_path, text, "--max-queue-time", "30")
    small, large, _ = c.pools()
    assert (small.max_queue_time, large.max_queue_time) == (2.5, 30.0)
    table = ModelTable(config(tmp_path, text.replace("2.5", "0"), "--max-queue-time", "30"))
    assert [p.max_queue_time for p in table.pools] == [None, 30.0, 30.0]  # (0: no limit)
    assert ModelTable(config(tmp_path, YAML)).default.max_queue_time is None
    assert "max-queue-time" in refused(tmp_path, text.replace("2.5", "-1"))
    assert "small" in refused(tmp_path, text.replace("2.5", "soon"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-queue-time", "nan"])


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="No such file"):
        config_from_args(build_parser().parse_args(
            ["--model-config", str(tmp_path / "none.yaml")]))


def two(**kw) -> ServerConfig:
    return ServerConfig(models=(ModelConfig(EngineConfig(model="a")),
                                ModelConfig(EngineConfig(model="b"), **kw)),
                        max_concurrent_requests=5)


def test_server_config_checks_its_models():
    with pytest.raises(ValueError, match="needs its name"):
        ServerConfig(models=(ModelConfig(EngineConfig()),))
    with pytest.raises(ValueError, match="served twice"):
        ServerConfig(models=(ModelConfig(EngineConfig(model="a")),) * 2)
    with pytest.raises(ValueError, match="'engine' and 'models'"):
        ServerConfig(engine=EngineConfig(workers=2), models=two().models)
    a, b = two(max_concurrent_requests=1).pools()
    assert (a.max_concurrent_requests, b.max_concurrent_requests) == (5, 1)
    (one,) = ServerConfig(max_concurrent_sequences=0).pools()
    assert one.engine == EngineConfig() and one.max_concurrent_sequences == 0


def test_the_table_resolves_a_bodys_model():
    table = ModelTable(two())
    a, b = table.pools
    assert table.for_body(b'{"model": "b", "prompt": "x"}') is b
    assert table.for_body(b'{"prompt": "x"}') is a  # none: the first
    assert table.for_body(b'{"x": [1, {"model": "b"}], "model": "a"}') is a
    assert table.for_body(b"not json") is a  # (its parser says what is wrong)
    with pytest.raises(NotFound) as exc:
        table.for_body(b'{"model": "c"}')
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    with pytest.raises(ClientError, match="'model' must be a string"):
        table.for_body(b'{"model": ["a"]}')
    assert requested_model(b'[1]') is None


def test_one_model_is_checked_by_the_parser_as_before():
    table = ModelTable(ServerConfig(engine=EngineConfig(model="m")))
    assert not table.several
    assert table.for_body(b'{"model": "other"}') is table.default  # parse_* say 404
    assert table.resolve("m") is table.default
    with pytest.raises(NotFound):
        table.resolve("other")


def test_the_example_of_docs_cli_md(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    text = doc.split("## Several models", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    small, qwen, shared = config(tmp_path, text).pools()
    assert small.max_concurrent_requests == 64 and small.engine.workers == 2
    assert qwen.engine.engine_options["max_batch"] == 32  # (--max-num-seqs)
    assert qwen.engine.engine_options["engine_args"] == {"enforce_eager": True}
    assert len(shared.engine.worker_addresses) == 2


async def test_pool_for_resolves_a_big_body_as_a_small_one():
    from server.http.post import BIG_BODY

    table = ModelTable(two())
    big = json.dumps({"prompt": "w " * BIG_BODY, "model": "b"}).encode()
    assert await table.pool_for(big) is table.pools[1]
    with pytest.raises(NotFound):
        await table.pool_for(big.replace(b'"b"', b'"c"'))
    assert await table.pool_for(b'{"model": "a"}') is table.pools[0]
