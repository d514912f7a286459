"""Keys of ``--api-key-file`` under the per-key bounds (``--max-batches-per-key``,
``--state-max-bytes-per-key``), through a real server over HTTP: a file key is an owner
as an ``--api-key`` key is, its batch lines run with it, a key removed from the file and
put back is the same owner (its objects and its quotas' counts are still its own), and a
renamed key is a new owner."""

from __future__ import annotations

import openai
import pytest
import trio

from server.config import EngineConfig
from tests.conftest import FAST_SIM, running_server
from tests.test_batches import CHAT, client_of, requests, upload, wait_status
from tests.test_files_api import batch_file, line
from tests.test_key_file_reload import write_keys

QUOTA = 40_000
#: Tokens of a line that runs until the test cancels it (27 minutes at 50 ms a token): no
#: line of that batch ends and stores its answer meanwhile.
LONG = 32_768
SLOW_SIM = EngineConfig(engine_options={**FAST_SIM, "itl_ms": 50.0, "max_model_len": 1 << 16})


async def _reloaded(app, ok: int) -> None:
    """Until the key files' ``ok`` reloads are ``ok`` (a hang guard, not a time bound)."""
    with trio.fail_after(60):
        while app.key_files.reloads["ok"] != ok:
            await trio.sleep(0.02)


async def _quick_batch(client) -> object:
    """A one-line batch of ``client``'s key, created (not waited for)."""
    file = await upload(client, requests("/v1/embeddings", 1))
    return await client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                                       completion_window="24h")


async def test_a_file_key_is_an_owner_under_every_per_key_bound(tmp_path):
    path = tmp_path / "keys"
    write_keys(path, "key-file\n")
    half = batch_file(QUOTA // 2 // len(line("r00")))
    async with running_server(SLOW_SIM, api_keys=("key-fixed",), api_key_files=(str(path),),
                              api_key_file_interval=0.05, max_batches_per_key=1,
                              state_max_bytes_per_key=QUOTA) as url:
        app = url.app
        mine, fixed = client_of(url, "key-file"), client_of(url, "key-fixed")
        endless = {**CHAT, "max_tokens": LONG, "ignore_eos": True}  # (cancelled below)
        file = await upload(mine, requests("/v1/chat/completions", 2, endless))
        running = await mine.batches.create(input_file_id=file.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        with pytest.raises(openai.RateLimitError):  # (the file key's one batch)
            await _quick_batch(mine)
        await mine.files.create(file=("a.jsonl", half), purpose="batch")
        with pytest.raises(openai.APIStatusError) as full:  # (the file key's bytes)
            await mine.files.create(file=("b.jsonl", half), purpose="batch")
        assert full.value.body["code"] == "storage_quota_exceeded"
        theirs = await _quick_batch(fixed)  # (the fixed key's own quotas)
        await fixed.files.create(file=("a.jsonl", half), purpose="batch")
        assert (await wait_status(fixed, theirs.id)).request_counts.completed == 1
        held = sorted(f.id for f in (await mine.files.list()).data)

        write_keys(path, "key-other\n")  # removed ...
        await _reloaded(app, 1)
        with pytest.raises(openai.AuthenticationError):
            await mine.files.list()
        write_keys(path, "key-other\nkey-file\n")  # ... and put back: the same owner
        await _reloaded(app, 2)
        assert sorted(f.id for f in (await mine.files.list()).data) == held
        with pytest.raises(openai.RateLimitError):
            await _quick_batch(mine)
        with pytest.raises(openai.APIStatusError) as full:
            await mine.files.create(file=("b.jsonl", half), purpose="batch")
        assert full.value.body["code"] == "storage_quota_exceeded"
        await mine.batches.cancel(running.id)
        await wait_status(mine, running.id, ("cancelled",))

        write_keys(path, "key-renamed\n")  # renamed: a new owner, with quotas of its own
        await _reloaded(app, 3)
        renamed = client_of(url, "key-renamed")
        assert (await renamed.files.list()).data == []
        await renamed.files.create(file=("a.jsonl", half), purpose="batch")
        batch = await _quick_batch(renamed)  # (its line runs with the renamed key)
        assert (await wait_status(renamed, batch.id)).request_counts.completed == 1
