"""Simon Willison's ``llm``: our server as an extra OpenAI model
(``extra-openai-models.yaml`` in the user directory, ``LLM_USER_PATH``): the CLI's default
prompt (no options: no ``max_tokens``, issue 41) and the Python API's ``schema=`` (a
``json_schema`` response format), parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ASK, ENGINES, MODEL, in_thread, served
from tests.client_models import Booking

llm = pytest.importorskip("llm")


def drive(url: str, user_dir) -> None:
    (user_dir / "extra-openai-models.yaml").write_text(
        f"- model_id: tiny\n  model_name: {MODEL}\n  api_base: {url}/v1\n"
        "  supports_schema: true\n")
    env = {**os.environ, "LLM_USER_PATH": str(user_dir)}
    said = subprocess.run([sys.executable, "-m", "llm", "-m", "tiny", ASK], env=env,
                          capture_output=True, text=True, timeout=300)
    assert said.returncode == 0, said.stderr
    response = llm.get_model("tiny").prompt(ASK, schema=Booking)
    Booking.model_validate(json.loads(response.text()))


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("engine", ENGINES)
async def test_llm(request, engine, user_dir):
    async with served(request, engine) as url:
        await in_thread(drive, url, user_dir)
