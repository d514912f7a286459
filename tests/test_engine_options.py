"""Engine options as the command line and the API read them, without any engine: the vllm
engine's options and --engine-arg pairs, options refused for the wrong engine, devices per
worker, the sampling fields an engine declares, and the STEP frame's notes."""

from __future__ import annotations

import json

import pytest

from server.cli import build_parser, config_from_args
from server.config import EngineConfig, Limits
from server.errors import ClientError
from server.openai import schema
from server.worker_protocol import wire
from server.workers.main import step_message
from server.engines.vllm.args import parse_engine_args

VLLM_INFO = {"engine": "vllm", "model": "m", "sampling": ["top_k", "min_p", "logit_bias",
                                                          "stop_token_ids", "min_tokens"]}
SIM_INFO = {"engine": "sim", "model": "m"}


def config(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_engine_arg_pairs():
    assert parse_engine_args(
        ["enforce-eager=true", "kv_cache_memory_bytes=1073741824", "quantization=fp8",
         "override_generation_config={\"temperature\": 0.5}", "note=a=b"]
    ) == {
        "enforce_eager": True, "kv_cache_memory_bytes": 1073741824, "quantization": "fp8",
        "override_generation_config": {"temperature": 0.5}, "note": "a=b",
    }
    for bad in (["enforce_eager"], ["=1"]):
        with pytest.raises(ValueError):
            parse_engine_args(bad)
    # a key given twice: the last wins, as a repeated flag does on vLLM's command line
    assert parse_engine_args(["seed=1", "seed=2"]) == {"seed": 2}


def test_vllm_options_from_the_command_line():
    cfg = config(
        "--engine", "vllm", "--model-path", "/models/m", "--max-batch", "64",
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8",
        "--no-enable-prefix-caching", "--dtype", "bfloat16", "--max-model-len", "4096",
        "--engine-arg", "enforce_eager=true", "--grammar-max-bytes", "1000",
    )
    assert cfg.engine.engine == "vllm"
    assert cfg.engine.engine_options == {
        "model_path": "/models/m", "max_batch": 64, "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.8, "enable_prefix_caching": False, "dtype": "bfloat16",
        "max_model_len": 4096, "engine_args": {"enforce_eager": True},
        "grammar_max_bytes": 1000,
    }
    hf = config("--engine", "transformers", "--model-path", "/m", "--grammar-timeout", "2.5",
                "--grammar-max-bytes", "100").engine.engine_options
    assert (hf["grammar_timeout"], hf["grammar_max_bytes"]) == (2.5, 100)
    assert cfg.engine.startup_timeout == 1800.0
    assert config().engine.startup_timeout == 120.0
    assert config("--worker-startup-timeout", "30").engine.startup_timeout == 30.0


def test_vllm_serve_command_lines():
    # Issue 29 item 10: what follows 'vllm serve' works after 'trio-llm-server --engine vllm'.
    cfg = config(
        "--engine", "vllm", "Qwen/Qwen2.5-0.5B-Instruct", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--enforce-eager", "--seed", "0",
        "--enable-chunked-prefill", "--enable-prefix-caching", "--max-logprobs", "20",
        "--load-format", "dummy", "--served-model-name", "qwen", "--revision", "abc",
        "--api-server-count", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--engine-arg", "swap_space=1",
    )
    assert cfg.engine.model == "qwen"
    assert cfg.engine.engine_options == {
        "model_path": "Qwen/Qwen2.5-0.5B-Instruct", "model": "qwen", "revision": "abc",
        "max_batch": 8, "enable_prefix_caching": True,
        "engine_args": {"max_num_batched_tokens": 512, "enforce_eager": True, "seed": 0,
                        "enable_chunked_prefill": True, "max_logprobs": 20,
                        "load_format": "dummy", "swap_space": 1},
    }
    assert cfg.tool_call_parser == "hermes"
    # --model is the model, as vLLM's; the positional and --model-path are the same.
    for argv in (["--model", "/m/x"], ["/m/x"], ["--model-path", "/m/x"],
                 ["/m/x", "--model", "/m/x"]):
        options = config("--engine", "transformers", *argv).engine.engine_options
        assert options == {"model_path": "/m/x", "device": "cpu"}, argv
    # Before vLLM's spelling, --model was the served name: with --model-path, it still is.
    options = config("--engine", "vllm", "--model-path", "/d", "--model", "n").engine
    assert options.engine_options == {"model_path": "/d", "model": "n"}
    # The sim engine has no weights: its model is its served name.
    assert config("--engine", "sim", "--model", "m").engine.model == "m"
    assert config("--engine", "sim", "m").engine.worker_argument()["options"]["model"] == "m"
    assert config("--served-model-name", "s").engine.model == "s"
    # A listening worker reads them the same way.
    from server.workers.listen import build_parser as worker_parser
    from server.engine_args import engine_options

    args = worker_parser().parse_args(["--listen", "127.0.0.1:0", "--engine", "vllm", "m",
                                       "--max-num-seqs", "2", "--seed", "3"])
    assert engine_options(args, "w") == {"model_path": "m", "max_batch": 2,
                                         "engine_args": {"seed": 3}}


def test_a_named_model_is_served_by_a_real_engine_unless_one_is_given():
    # Issue 29 item 10: 'trio-llm-server MODEL' serves MODEL as 'vllm serve MODEL' does:
    # vLLM when installed, else transformers; sim only when no model is named.
    import importlib.util

    from server.engine_args import default_engine

    here = next((e for e in ("vllm", "transformers") if importlib.util.find_spec(e)), None)
    for argv in (["org/m"], ["--model", "org/m"], ["--model-path", "org/m"]):
        if here is None:  # the test extra alone: a named model is refused, not simulated
            with pytest.raises(SystemExit, match="neither vllm nor transformers is installed"):
                config(*argv)
            continue
        engine = config(*argv).engine
        assert (engine.engine, engine.engine_options["model_path"]) == (here, "org/m"), argv
    assert config().engine.engine == "sim"
    assert config("--served-model-name", "s").engine.engine == "sim"
    assert default_engine(True, lambda name: name == "transformers") == "transformers"
    assert default_engine(True, lambda name: True) == "vllm"
    assert default_engine(False, lambda name: True) == "sim"
    with pytest.raises(SystemExit, match="--engine sim serves simulated output"):
        default_engine(True, lambda name: False)


def test_the_supervisor_passes_the_model_on():
    from server.supervisor_plan import plan

    parser = build_parser()
    args = parser.parse_args(["--engine", "transformers", "org/m", "--served-model-name", "s",
                              "--api-server-count", "2", "--max-num-seqs", "4"])
    config_from_args(args)
    children = plan(parser, args)
    assert children.worker[3:] == ["--engine", "transformers", "--model-path", "org/m",
                                   "--served-model-name", "s", "--max-batch", "4"]
    assert "--served-model-name" in children.frontend and "org/m" not in children.frontend


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--engine", "vllm"], "--engine vllm needs a model"),
        (["--engine", "transformers", "m", "--seed", "0"],
         "--seed is an option of the vllm engine"),
        (["--engine", "transformers", "m", "--enforce-eager"],
         "--enforce-eager is an option of the vllm engine"),
        (["--engine", "vllm", "a", "--model", "b"], "MODEL and --model name different models"),
        (["--engine", "vllm", "--model", "a", "--model-path", "b", "--served-model-name", "c"],
         "--model and --model-path name different models"),
        (["--engine", "vllm", "m", "--served-model-name", "a", "b"], "takes one name"),
        (["--engine", "vllm", "m", "--seed", "1", "--engine-arg", "seed=2"], "both give it"),
        (["--engine", "sim", "m", "--served-model-name", "s"],
         "with --engine sim the model is only its served"),
        (["--engine", "vllm", "m", "--sim-itl-ms", "3"],
         "--sim-itl-ms is an option of the sim engine, not of --engine vllm"),
        (["--engine", "transformers", "m", "--sim-prefix-cache-tokens", "64"],
         "--sim-prefix-cache-tokens is an option of the sim engine"),
        (["--revision", "v1"], "--revision is an option of the transformers and vllm"),
        (["--tool-call-parser", "hermes", "--worker-address", "h:1", "--model-path", "m"],
         "--model-path: not with --worker-address"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size is an option of the vllm engine"),
        (["--engine-arg", "a=1"], "--engine-arg is an option of the vllm engine"),
        (["--engine", "transformers", "--model-path", "m", "--enable-prefix-caching"],
         "--enable-prefix-caching is an option of the vllm engine"),
        (["--engine", "vllm", "--model-path", "m", "--device", "cuda"],
         "--device is an option of the transformers engine"),
        (["--engine", "vllm", "--model-path", "m", "--num-threads", "2"],
         "--num-threads is an option of the transformers engine"),
        (["--engine", "vllm", "--model-path", "m", "--grammar-timeout", "2"],
         "--grammar-timeout is an option of the transformers engine"),
        (["--grammar-max-bytes", "9"],
         "--grammar-max-bytes is an option of the transformers and vllm engines"),
        (["--engine", "sim", "--model-path", "m"],
         "--model-path is an option of the transformers and vllm engines"),
        (["--engine", "vllm", "--model-path", "m", "--engine-arg", "x"], "needs KEY=VALUE"),
    ],
)
def test_options_are_refused_where_they_mean_nothing(argv, words):
    with pytest.raises(SystemExit) as info:
        config(*argv)
    assert words in str(info.value)


def test_devices_per_worker():
    cfg = EngineConfig(workers=3, devices_per_worker=2)
    assert [cfg.for_worker(i).visible_devices({}) for i in range(3)] == ["0,1", "2,3", "4,5"]
    inherited = {"CUDA_VISIBLE_DEVICES": "4, 5,6,7"}
    assert cfg.for_worker(1).visible_devices(inherited) == "6,7"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES lists 4"):
        cfg.for_worker(2).visible_devices(inherited)
    assert EngineConfig().visible_devices({}) is None
    assert "visible_devices" not in EngineConfig().worker_argument()


def test_devices_per_worker_on_the_command_line(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(SystemExit, match="CUDA_VISIBLE_DEVICES lists 3"):
        config("--engine-workers", "2", "--devices-per-worker", "2")
    cfg = config("--engine-workers", "3", "--devices-per-worker", "1")
    assert cfg.engine.for_worker(2).worker_argument()["visible_devices"] == "2"


def _parse(body: dict, info: dict):
    return schema.parse_completion(json.dumps(body).encode(), Limits(), "m", info)


def test_sampling_fields_an_engine_declares_reach_it():
    req = _parse({"prompt": "hi", "top_k": 5, "min_p": 0.1, "logit_bias": {"12": -100},
                  "stop_token_ids": [1, 2], "min_tokens": 3}, VLLM_INFO)
    wire_params = req.params.to_wire()
    assert {k: wire_params[k] for k in ("top_k", "min_p", "logit_bias", "stop_token_ids",
                                        "min_tokens")} == {
        "top_k": 5, "min_p": 0.1, "logit_bias": {"12": -100.0}, "stop_token_ids": [1, 2],
        "min_tokens": 3,
    }
    # A field the engine does not declare is refused, naming the engine; its neutral value
    # is fine.
    with pytest.raises(ClientError, match="not supported by the vllm engine") as info:
        _parse({"prompt": "hi", "presence_penalty": 1}, VLLM_INFO)
    assert info.value.param == "presence_penalty"
    with pytest.raises(ClientError, match="not supported by the sim engine"):
        _parse({"prompt": "hi", "top_k": 5}, SIM_INFO)
    assert "top_k" not in _parse({"prompt": "hi", "top_k": -1}, SIM_INFO).params.to_wire()


def test_every_bad_logit_bias_key_is_named():
    with pytest.raises(ClientError) as info:
        _parse({"prompt": "hi", "logit_bias": {"bad1": 1, "7": 2, "bad2": 3}}, VLLM_INFO)
    assert "'bad1'" in info.value.message and "'bad2'" in info.value.message


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", "five"), ("top_k", -2), ("min_p", 1.5), ("min_tokens", -1),
        ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}), ("logit_bias", [1]),
        ("logit_bias", {"1": True}), ("stop_token_ids", [1, "2"]), ("stop_token_ids", 3),
        # one bound for every token id: server.params.MAX_TOKEN_ID
        ("logit_bias", {str(2**31): 1}), ("stop_token_ids", [2**31]),
    ],
)
def test_declared_fields_are_validated(field, value):
    with pytest.raises(ClientError) as info:
        _parse({"prompt": "hi", field: value}, VLLM_INFO)
    assert info.value.param == field


class _Engine:
    def __init__(self, notes):
        self.notes = notes


def test_step_message_carries_notes_only_when_there_are_some():
    engine = _Engine([[3, {"cached_tokens": 128}]])
    assert step_message(engine, [], []) == [wire.STEP, [], [], [[3, {"cached_tokens": 128}]]]
    assert engine.notes == []
    assert step_message(engine, [[1, 2]], []) == [wire.STEP, [[1, 2]], []]
    assert step_message(object(), [], []) == [wire.STEP, [], []]


class _BrokenEngine:
    """An engine whose library fails inside a step (what VLLMEngine raises then)."""

    info = {"engine": "broken"}
    notes: list = []

    def __init__(self):
        self.held = set()

    def add(self, rid, prompt, params):
        self.held.add(rid)
        return 1

    def abort(self, rid):
        return False

    def next_deadline(self):
        return 0.0 if self.held else None

    def step(self, now):
        from server.worker_protocol.wire import OutputRow
        from server.workers.base import EngineBroken

        rows = [OutputRow(r, "", 0, "error", ["engine_error", "it broke"]) for r in self.held]
        raise EngineBroken("it broke", rows)

    def running(self):
        return len(self.held)

    def waiting(self):
        return 0


def test_a_broken_engine_sends_its_errors_then_the_loop_ends():
    import os

    from server.workers.base import EngineBroken
    from server.workers.main import serve

    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    os.write(down_w, wire.encode([wire.SUBMIT, 5, "hi", {}]))
    with pytest.raises(EngineBroken):
        serve(_BrokenEngine(), down_r, up_w)
    for fd in (down_w, up_w):
        os.close(fd)
    messages = wire.FrameDecoder().feed(os.read(up_r, 1 << 16))
    os.close(up_r)
    os.close(down_r)
    assert messages[0][0] == wire.HELLO
    assert messages[1] == [wire.STEP, [[5, 1]], [[5, "", 0, "error", ["engine_error", "it broke"]]]]


def _engine_info(engine: str) -> dict:
    """An engine's HELLO declarations, from the engine's own constants. The transformers
    engine's need torch (its extra): skipped without it."""
    from server.workers.base import MAX_LOGPROBS
    from server.engines.vllm.engine import VLLM_SAMPLING  # (imports vllm only when built)

    if engine == "sim":
        from server.engines.sim.engine import SimEngine

        return {"engine": "sim", "sampling": SimEngine().info["sampling"]}
    if engine == "transformers":
        pytest.importorskip("torch", reason="the transformers extra is not installed")
        from server.engines.transformers.logits import SAMPLING_FIELDS

        # (the transformers engine declares response_format when xgrammar is installed)
        return {"engine": "transformers",
                "sampling": [*SAMPLING_FIELDS, "response_format", "chat_template_kwargs",
                             "tools"],
                "logprobs": MAX_LOGPROBS}
    return {"engine": "vllm",
            "sampling": [*VLLM_SAMPLING, "response_format", "chat_template_kwargs", "tools"],
            "logprobs": MAX_LOGPROBS}


@pytest.mark.parametrize("engine", ["sim", "transformers", "vllm"])
def test_every_field_an_engine_does_not_honour_is_a_400_naming_it(engine):
    from server.openai.fields import UNSUPPORTED
    from server.openai.tools import TOOL_FIELDS

    info = _engine_info(engine)
    honoured = set(info.get("sampling", ())) | ({"top_logprobs"} if "logprobs" in info else set())
    if "tools" in honoured:  # tool_choice and parallel_tool_calls follow (server.openai.tools)
        honoured |= TOOL_FIELDS
    if "response_format" in honoured:  # vLLM's spelling follows (server.openai.structured)
        honoured.add("structured_outputs")
    refused = [name for name in UNSUPPORTED if name not in honoured]
    assert len(refused) >= 20
    routes = ((schema.parse_completion, {"prompt": "hi"}),
              (schema.parse_chat, {"messages": [{"role": "user", "content": "hi"}]}))
    if "chat_template_kwargs" in honoured:  # the template options: chat only
        for name in schema.TEMPLATE_OPTIONS:
            body = json.dumps({"prompt": "hi", name: {"not": "neutral"}}).encode()
            with pytest.raises(ClientError, match=f"by the {engine} engine"):
                schema.parse_completion(body, Limits(), "m", info)
        refused = [name for name in refused if name not in schema.TEMPLATE_OPTIONS]
    for name in refused:
        for parse, extra in routes:
            body = json.dumps({**extra, name: {"not": "neutral"}}).encode()
            with pytest.raises(ClientError) as info_:
                parse(body, Limits(), "m", info)
            assert info_.value.param == name, (engine, name)
            assert f"by the {engine} engine" in str(info_.value), (engine, name)


def test_response_format_shapes():
    info = {"engine": "transformers", "sampling": ["response_format"]}
    schema_ = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_, "strict": True}}
    assert _parse({"prompt": "hi", "response_format": fmt}, info).params.to_wire()[
        "response_format"] == {"type": "json_schema", "schema": schema_}
    assert _parse({"prompt": "hi", "response_format": {"type": "json_object"}}, info
                  ).params.to_wire()["response_format"] == {"type": "json_object"}
    assert "response_format" not in _parse(
        {"prompt": "hi", "response_format": {"type": "text"}}, info).params.to_wire()
    for bad in ({"type": "xml"}, "json", {"type": "json_schema"},
                {"type": "json_schema", "json_schema": {"schema": []}},
                {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}):
        with pytest.raises(ClientError) as info_:
            _parse({"prompt": "hi", "response_format": bad}, info)
        assert info_.value.param == "response_format"


GRAMMAR_INFO = {"engine": "vllm", "model": "m", "sampling": ["response_format"]}


@pytest.mark.parametrize("value, engine_value", [
    ({"choice": ["a", "b"]}, {"type": "choice", "choice": ["a", "b"]}),
    ({"regex": "[0-9]+"}, {"type": "regex", "regex": "[0-9]+"}),
    ({"grammar": 'root ::= "x"'}, {"type": "grammar", "grammar": 'root ::= "x"'}),
    ({"json": {"type": "object"}}, {"type": "json_schema", "schema": {"type": "object"}}),
    ({"json": '{"type": "integer"}'}, {"type": "json_schema", "schema": {"type": "integer"}}),
    ({"json_object": True, "regex": None}, {"type": "json_object"}),
])
def test_structured_outputs_become_the_engines_constraint(value, engine_value):
    for parse in (_parse, _parse_chat):
        req = parse({"prompt": "hi", "structured_outputs": value}, GRAMMAR_INFO)
        assert req.params.to_wire()["response_format"] == {
            **engine_value, "origin": "structured_outputs"}


@pytest.mark.parametrize("value", [
    "x", {}, {"choice": []}, {"choice": ["a", 1]}, {"regex": ""}, {"regex": "a", "choice": ["a"]},
    {"json": "not json"}, {"json_object": 1}, {"grammar": 'root ::= "x"', "whitespace_pattern": " "},
    {"json": {"$ref": "#/nowhere"}},
])
def test_bad_structured_outputs_are_refused_by_name(value):
    with pytest.raises(ClientError) as info:
        _parse({"prompt": "hi", "structured_outputs": value}, GRAMMAR_INFO)
    assert info.value.param == "structured_outputs"


def test_structured_outputs_need_an_engine_with_grammars_and_exclude_response_format():
    with pytest.raises(ClientError, match="not supported by the sim engine"):
        _parse({"prompt": "hi", "structured_outputs": {"regex": "a"}}, SIM_INFO)
    with pytest.raises(ClientError) as info:
        _parse_chat({"structured_outputs": {"regex": "a"},
                     "response_format": {"type": "json_object"}}, GRAMMAR_INFO)
    assert info.value.param == "structured_outputs"


def _parse_chat(body: dict, info: dict):
    body = {"messages": [{"role": "user", "content": "hi"}],
            **{k: v for k, v in body.items() if k != "prompt"}}
    return schema.parse_chat(json.dumps(body).encode(), Limits(), "m", info)


def test_every_field_of_vllms_requests_is_honoured_or_refused_by_name():
    # A field vLLM defines must not fall into "nobody defines" (logged and ignored here).
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from server.openai.fields import KNOWN

    for request in (ChatCompletionRequest, CompletionRequest):
        assert not set(request.model_fields) - KNOWN, request.__name__


TEMPLATE_INFO = {"engine": "transformers", "model": "m", "sampling": ["chat_template_kwargs"]}


def test_continue_final_message_and_add_generation_prompt_reach_the_template():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]

    def prompt(**fields):
        body = {"messages": fields.pop("messages", history), **fields}
        return schema.parse_chat(json.dumps(body).encode(), Limits(), "m", TEMPLATE_INFO
                                 ).prompts[0]

    assert prompt() == {"messages": history}
    assert prompt(continue_final_message=True, add_generation_prompt=False) == {
        "messages": history, "continue_final_message": True, "add_generation_prompt": False}
    assert prompt(continue_final_message=True)["add_generation_prompt"] is False
    assert prompt(add_generation_prompt=False) == {"messages": history,
                                                   "add_generation_prompt": False}
    for fields in ({"continue_final_message": True, "add_generation_prompt": True},
                   {"continue_final_message": True, "messages": history[:1]},
                   {"continue_final_message": "yes"}):
        with pytest.raises(ClientError):
            prompt(**fields)
    # an engine without chat templates (sim), and completions, refuse them by name
    with pytest.raises(ClientError, match="continue_final_message"):
        _parse_chat({"continue_final_message": True}, SIM_INFO)
    with pytest.raises(ClientError, match="add_generation_prompt"):
        _parse({"prompt": "hi", "add_generation_prompt": False}, TEMPLATE_INFO)


def test_priority_reaches_an_engine_with_priority_scheduling():
    info = {"engine": "vllm", "model": "m", "sampling": ["priority"]}
    assert _parse({"prompt": "hi", "priority": -5}, info).params.to_wire()["priority"] == -5
    with pytest.raises(ClientError) as bad:
        _parse({"prompt": "hi", "priority": "high"}, info)
    assert bad.value.param == "priority"
    # without --scheduling-policy priority (or on the sim engine) only 0 is accepted
    assert "priority" not in _parse({"prompt": "hi", "priority": 0}, VLLM_INFO).params.to_wire()
    with pytest.raises(ClientError, match="'priority' is not supported by the vllm engine"):
        _parse({"prompt": "hi", "priority": 1}, VLLM_INFO)
    assert config("--engine", "vllm", "--model-path", "/m", "--scheduling-policy", "priority"
                  ).engine.engine_options["engine_args"]["scheduling_policy"] == "priority"
