"""The vllm engine with vLLM's engine core in a process of its own (``--engine-core process``),
on vLLM's CPU build, with the tiny model of tests/test_vllm_engine.py.

One server for the module (``python -m server`` as a real process, one worker whose engine
core is its child process ``VLLM::EngineCore``), driven over HTTP with the openai SDK and
raw sockets. The same requests as in-process must behave the same (streams, the abort, the
context refusal, vLLM's metrics, priorities, LoRA adapters at start-up and loaded at run
time: vLLM's LoRA calls cross to the core process); then the two ways a process dies: the engine
core SIGKILLed (the worker notices, its streams end with an error and ``[DONE]``, it is
replaced, ``/health`` says so meanwhile), and the worker SIGKILLed (its engine core does not
outlive it); the server, SIGTERMed once that worker's replacement is up, exits cleanly.
Three model loads. Last, a listening worker started on its own (no frontend kills its
process group), SIGKILLed as its engine core starts: the core dies with it.

Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import trio

if importlib.util.find_spec("vllm") is None:  # (not imported here: see vllm_reference.py)
    pytest.skip("vLLM is not installed", allow_module_level=True)

import httpx  # noqa: E402
import openai  # noqa: E402

from tests.conftest import children_of, pid_exists  # noqa: E402
from tests.remote import ROOT, worker_env  # noqa: E402
from tests.test_vllm_engine import (  # noqa: E402
    CONTEXT, MODEL, SHAPE, STARTUP, Server, _open_stream, _prompts, _rest_of_stream, _totals,
    assert_sigterm_stops_cleanly)
from tests.tiny_lora import build_tiny_lora  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)


#: Seconds for a model load: two vLLM processes start (more than test_vllm_engine.py's
#: STARTUP on a loaded 2-core machine). None compiles: LoRA turns that off on a CPU.
STARTUP_HERE = 3 * STARTUP


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / MODEL, **SHAPE)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("loras")
    build_tiny_lora(model_dir, root / "a", seed=1)
    build_tiny_lora(model_dir, root / "b", seed=2)
    return root


@pytest.fixture(scope="module")
def server(model_dir, lora_dir):
    s = Server(model_dir, "--engine-core", "process", "--scheduling-policy", "priority",
               "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
               "--lora-modules", f"ad-a={lora_dir / 'a'}", "--allow-runtime-lora",
               "--lora-dir", str(lora_dir), startup=STARTUP_HERE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _core_of(worker: int) -> int:
    """The worker's vLLM engine core process (its child named ``VLLM::EngineCore``)."""
    core = _named_core_of(worker)
    assert core is not None, f"worker {worker} has no engine core process"
    return core


def _named_core_of(worker: int) -> int | None:
    """The worker's child named ``VLLM::EngineCore``, if any: vLLM names its core process
    so as it starts, after the tie to the worker took effect (``private_api.tying``)."""
    for pid in children_of(worker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"VLLM::EngineCore"):
                    return pid
        except OSError:
            continue
    return None


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_requests_behave_as_with_the_core_in_the_worker(server, client):
    (worker,) = server.workers()
    _core_of(worker)  # the engine core runs beside the worker
    prompts = _prompts(6, seed=21)
    whole = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                       extra_body={"priority": i % 3})
             for i, p in enumerate(prompts)]
    for p, r in zip(prompts, whole):  # a stream says what the whole response says
        stream = client.completions.create(model=MODEL, prompt=p, max_tokens=24,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
        assert r.usage.completion_tokens == 24
    # LoRA adapters: the one loaded at start-up, one loaded now (vLLM's add_lora, a call
    # into the core process); each changes the text, the same on every call
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "ad-b",
                                                               "lora_path": "b"}, timeout=120)
    assert r.status_code == 200, r.text
    texts = {model: [client.completions.create(model=model, prompt=prompts[0], max_tokens=16,
                                               temperature=0).choices[0].text
                     for _ in range(2)] for model in (MODEL, "ad-a", "ad-b")}
    assert all(a == b for a, b in texts.values()), texts
    assert len({a for a, _ in texts.values()}) == 3, texts
    # vLLM's own statistics reach the metrics (through the stat logger, in the worker)
    totals = _totals(httpx.get(server.url + "/metrics").text)
    assert totals["trio_llm:iteration_tokens_total_count"] > 0
    # a prompt over the context: a 400 before any byte
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=CONTEXT + 1)
    # aborted streams leave nothing in vLLM: not running, not in its KV cache
    socks = [_open_stream(server.url, CONTEXT - 10) for _ in range(3)]
    for sock in socks:
        data = b""
        while data.count(b"data: ") < 3:
            data += sock.recv(65536)
    _until(lambda: server.gauges()["kv_cache_usage_perc"] > 0, 60, server.gauges())
    for sock in socks:
        sock.close()
    server.wait_idle(timeout=60)


def test_a_killed_engine_core_ends_its_streams_and_the_worker_is_replaced(server, client):
    (worker,) = server.workers()
    core = _core_of(worker)
    sock = _open_stream(server.url, CONTEXT - 10)
    data = b""
    while data.count(b"data: ") < 2:
        data += sock.recv(65536)
    os.kill(core, signal.SIGKILL)
    events = _rest_of_stream(sock, data)
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "vLLM failed: its engine core process died", error
    # the worker exits (vLLM's state is not trusted) and the frontend starts another
    _until(lambda: worker not in server.workers(), 120, "the worker did not exit")
    _until(lambda: httpx.get(server.url + "/health").status_code == 503, 120,
           "/health did not report the worker down")
    server.wait_ready(STARTUP_HERE)
    assert httpx.get(server.url + "/health").status_code == 200
    (replacement,) = server.workers()
    assert replacement != worker and not pid_exists(core) and _core_of(replacement) != core
    r = client.completions.create(model=MODEL, prompt="again", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_a_killed_worker_leaves_no_engine_core(server):
    (worker,) = server.workers()
    core = _core_of(worker)
    os.kill(worker, signal.SIGKILL)
    # the frontend kills what is left of the worker's process group: the core
    _until(lambda: not pid_exists(core), 120, "the engine core outlived its worker")
    # the frontend saw it die (until then /ready still says ready); its replacement, still
    # loading, serves the next test
    _until(lambda: worker not in server.workers(), 120, "the worker was not reaped")
    _until(lambda: httpx.get(server.url + "/health").status_code == 503, 120,
           "/health did not report the worker down")


def test_sigterm_with_nothing_in_flight_exits_cleanly_and_leaves_no_process(server):
    """As with the core in the worker (tests/test_vllm_engine.py's
    ``assert_sigterm_stops_cleanly``), on the module's server once the worker that replaced
    the one killed above is up (one model load fewer than a server of its own): exit 0, no
    traceback, no process left, and the frontend's log says how each worker ended."""
    server.wait_ready(STARTUP_HERE)
    assert_sigterm_stops_cleanly(server, whole_log=False)  # (the kills above logged errors)


async def test_a_killed_listening_worker_leaves_no_engine_core(model_dir, tmp_path):
    """SIGKILLed as soon as its engine core is named (the tie took effect): the core dies
    with it, its model's load not waited for (no frontend: nothing connects to it)."""
    cmd = [sys.executable, "-m", "server.workers", "--listen", f"unix:{tmp_path / 'w.sock'}",
           "--engine", "vllm", "--model-path", str(model_dir), "--engine-core", "process",
           "--max-model-len", str(CONTEXT), "--dtype", "float32",
           "--engine-arg", "kv_cache_memory_bytes=67108864"]
    log = tmp_path / "worker.log"
    with log.open("wb") as err:  # noqa: ASYNC230 (a local file, before the process exists)
        worker = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            env=worker_env(None), cwd=ROOT)
    core = None
    try:
        with trio.fail_after(STARTUP_HERE):
            while core is None:
                assert worker.poll() is None, log.read_text(errors="replace")
                core = _named_core_of(worker.pid)
                await trio.sleep(0.05)
        worker.kill()  # SIGKILL: no cleanup of its own, no parent to kill its group
        await worker.wait()
        with trio.fail_after(120):  # the kernel's parent-death signal: at once
            while pid_exists(core):
                await trio.sleep(0.1)
    finally:
        if worker.returncode is None:
            worker.kill()
            with trio.CancelScope(shield=True):
                await worker.wait()
        if core is not None and pid_exists(core):  # (the failure is not left running)
            os.kill(core, signal.SIGKILL)
