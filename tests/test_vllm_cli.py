"""Issue 29 item 10: a vLLM user's command line. The model named as ``vllm serve`` names it
(a Hugging Face hub id, resolved offline in a pre-filled cache as
/work/shared/vllm-suite/make_fake_hub.py fills one; or a directory), and vLLM's engine flags
under their own names (the parse tests are in test_engine_options.py)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

# The transformers engine serves the hub id here (and builds the tiny model).
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import httpx  # noqa: E402
import openai  # noqa: E402
import trio  # noqa: E402

from server.engines.transformers.engine import TransformersEngine  # noqa: E402
from tests.remote import stop  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

HUB_ID = "TinyOrg/Tiny-Llama-Instruct"
COMMIT = "0" * 40
LIMIT = 60  # seconds for a server process (it imports torch)


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """An ``HF_HOME`` whose hub cache holds the tiny model as ``HUB_ID``'s snapshot."""
    home = tmp_path_factory.mktemp("hf-home")
    model = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    repo = home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in model.iterdir():
        (snapshot / f.name).symlink_to(f)
    return home


@pytest.fixture
def offline(hub_home, monkeypatch) -> dict:
    env = {"HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return env


def test_a_hub_id_names_its_cached_snapshot(offline):
    engine = TransformersEngine(model_path=HUB_ID, max_batch=2)
    assert engine.info["model"] == HUB_ID  # served under the hub id, as vLLM does
    engine = TransformersEngine(model_path=HUB_ID, revision=COMMIT, max_batch=2)
    assert engine.info["model"] == HUB_ID
    with pytest.raises(FileNotFoundError, match="at revision v9 is neither a local"):
        TransformersEngine(model_path=HUB_ID, revision="v9")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        TransformersEngine(model_path="TinyOrg/Missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TransformersEngine(model_path="./TinyOrg/Missing")


async def _server(tmp_path: Path, *argv: str) -> tuple[trio.Process, Path]:
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "server", "--port", "0", "--shutdown-timeout", "0", *argv],
            stdout=out, stderr=out, env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
    return proc, log


async def test_vllm_serve_arguments_start_a_server_on_a_hub_id(offline, tmp_path):
    proc, log = await _server(
        tmp_path, "--engine", "transformers", HUB_ID, "--served-model-name", "tiny",
        "--max-num-seqs", "2", "--max-model-len", "64", "--dtype", "float32",
        "--num-threads", "1", "--revision", "main",
    )
    try:
        with trio.fail_after(LIMIT):
            while not (found := re.search(r"serving on (\S+)", log.read_text())):
                assert proc.poll() is None, log.read_text()
                await trio.sleep(0.1)
            url = found.group(1)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                while (await http.get("/ready")).status_code != 200:
                    assert proc.poll() is None, log.read_text()
                    await trio.sleep(0.1)
                models = (await http.get("/v1/models")).json()["data"]
                assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 64)]
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
            answer = await client.completions.create(
                model="tiny", prompt="hello", max_tokens=3, temperature=0, n=2
            )
            await client.close()
            assert answer.usage.completion_tokens == 6
    finally:
        with trio.CancelScope(shield=True):
            await stop(proc)
    assert proc.returncode == 0, log.read_text()


async def test_a_hub_id_missing_offline_is_one_line_and_exit_1(offline, tmp_path):
    proc, log = await _server(tmp_path, "--engine", "transformers", "TinyOrg/Missing",
                              "--max-restarts", "0", "--num-threads", "1")
    try:
        with trio.fail_after(LIMIT):
            await proc.wait()
    finally:
        with trio.CancelScope(shield=True):
            await stop(proc)
    text = log.read_text()
    assert proc.returncode == 1, text
    assert "TinyOrg/Missing is neither a local directory nor in the Hugging Face cache" in text
    assert "Traceback" not in text
