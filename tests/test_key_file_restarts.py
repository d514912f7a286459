"""``--api-key-file`` and a frontend of ``--api-servers`` restarted while the file is broken
(server/supervisor.py, server/http/key_files.py). The supervisor watches the files too and
hands the restarted frontend the files' keys in force, in its environment: the frontend
serves with them, not with fewer keys, and does not exit (a broken file and one crash
would end the supervisor). Real supervisors, frontends and clients; each answer is read
from the frontend meant, told by its own count of accepted connections."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import trio

from server.cli_options import FRONTEND_FILE_KEYS_ENV, FRONTEND_KEYS_ENV
from server.http.key_files import KeyFiles
from tests.remote import Supervised, local_metrics, supervised
from tests.test_key_file import key_file, proc_words
from tests.test_key_file_reload import FAST, write_keys

_SIM = ("model_name", "sim")


async def _metrics(sup: Supervised, index: int) -> dict[tuple, float]:
    return await local_metrics(sup.directory(), index)


def _reloads(samples: dict[tuple, float]) -> dict[str, float]:
    return {outcome: samples.get(("trio_llm:api_key_file_reloads_total",
                                  frozenset({_SIM, ("outcome", outcome)})), 0.0)
            for outcome in ("ok", "refused")}


async def _accepted(sup: Supervised, index: int) -> float:
    samples = await _metrics(sup, index)
    return samples[("trio_llm:connections_accepted_total", frozenset({_SIM}))]


async def _status(sup: Supervised, index: int, key: str) -> int:
    """The status frontend ``index`` answers ``key`` with. Requests go on new connections
    until one reaches it: the kernel spreads them, and its accepted count tells which."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=sup.url, limits=limits) as http:
        with trio.fail_after(60):
            while True:
                before = await _accepted(sup, index)
                r = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                if await _accepted(sup, index) > before:
                    return r.status_code


async def _statuses(sup: Supervised, index: int, *keys: str) -> list[int]:
    return [await _status(sup, index, key) for key in keys]


async def _wait_for_reloads(sup: Supervised, index: int, **wanted: float) -> None:
    with trio.fail_after(60):
        while _reloads(await _metrics(sup, index)) != {"ok": 0.0, "refused": 0.0, **wanted}:
            await trio.sleep(0.05)


async def _restarted(sup: Supervised, index: int, old: int) -> int:
    """The pid of frontend ``index``'s successor of ``old``, once it answers on its
    private socket; fails at once if the supervisor ended."""
    with trio.fail_after(120):
        while True:
            assert sup.proc.poll() is None, sup.text()
            pid = sup.children()[0].get(index)
            if pid not in (None, old):
                try:
                    await _metrics(sup, index)
                    return pid
                except OSError:
                    pass  # (not listening yet)
            await trio.sleep(0.05)


async def test_a_frontend_restarted_while_the_key_file_is_broken_serves_the_keys_in_force(
        tmp_path):
    """The file breaks, then frontend 0 is killed: its successor accepts the keys in force
    before the break (a key only in the broken file is refused), the supervisor and
    frontend 1 go on, and the next good file is taken by both."""
    path = key_file(tmp_path, "key-one\nkey-two\n")
    async with supervised(tmp_path, "--api-key-file", path, *FAST,
                          "--max-restarts", "2") as sup:
        frontends, _ = sup.children()
        write_keys(Path(path), "key-one\nkey-three\nkey four\n")
        await _wait_for_reloads(sup, 1, refused=1)  # (frontend 1 keeps the keys in force)
        os.kill(frontends[0], signal.SIGKILL)
        pid = await _restarted(sup, 0, frontends[0])
        environ = proc_words(pid, "environ")
        assert f"{FRONTEND_FILE_KEYS_ENV}=key-one\nkey-two".encode() in environ
        assert not any(w.startswith(f"{FRONTEND_KEYS_ENV}=".encode()) for w in environ)
        assert b"key-one" not in b" ".join(proc_words(pid, "cmdline"))
        assert _reloads(await _metrics(sup, 0)) == {"ok": 0.0, "refused": 1.0}
        for index in (0, 1):
            assert await _statuses(sup, index, "key-one", "key-two", "key-three") \
                == [200, 200, 401], index
        assert sup.children()[0][1] == frontends[1]  # (untouched)

        write_keys(Path(path), "key-three\nkey-five\n")
        for index in (0, 1):
            await _wait_for_reloads(sup, index, ok=1, refused=1)
        for index in (0, 1):
            assert await _statuses(sup, index, "key-one", "key-two", "key-three",
                                   "key-five") == [401, 401, 200, 200], index
        assert sup.proc.poll() is None
        log = sup.text()
    refusal = (f"--api-key-file {path}: line 3: a key holds no whitespace (a comment is a "
               "line of its own, starting with #); the 2 key(s) in force at the supervisor "
               "stay until it changes")
    assert log.count(refusal) == 1, log  # (the restarted frontend's start)
    assert "frontend 0 (pid" in log and "restarting in 0.1 s" in log, log
    assert not any(f"key-{k}" in log for k in ("one", "two", "three", "five")), log


async def test_a_key_removed_before_the_crash_stays_removed_on_the_restarted_frontend(
        tmp_path):
    """The supervisor hands the keys in force when the frontend restarts, not those of
    its own start: a key the file dropped, then back in a broken file, stays refused."""
    path = key_file(tmp_path, "key-one\nkey-two\n")
    async with supervised(tmp_path, "--api-key-file", path, *FAST) as sup:
        frontends, _ = sup.children()
        write_keys(Path(path), "key-one\n")
        with trio.fail_after(60):  # (the supervisor's watch took it)
            while "server.supervisor: --api-key-file changed: 1 key(s) in force (2 before)" \
                    not in sup.text():
                await trio.sleep(0.05)
        write_keys(Path(path), "key-one\nkey-two\nkey three\n")
        os.kill(frontends[0], signal.SIGKILL)
        await _restarted(sup, 0, frontends[0])
        assert _reloads(await _metrics(sup, 0)) == {"ok": 0.0, "refused": 1.0}
        assert await _statuses(sup, 0, "key-one", "key-two") == [200, 401]


async def test_handed_keys_stand_for_a_refused_file_until_a_good_one(tmp_path):
    """:class:`KeyFiles` alone: handed keys are the files' while the file is refused (a
    refused reload), beside the fixed ones, and the next good file confirmed replaces them.
    Without them the refusal is an error (tests/test_key_file.py)."""
    path = tmp_path / "keys"
    write_keys(path, "key-one\nkey two\n")
    keys = KeyFiles(("fixed",), (str(path),), 10.0, handed=("key-one", "key-old"))
    assert keys.keys == ("fixed", "key-one", "key-old")
    assert keys.file_keys == ("key-one", "key-old")
    assert keys.reloads == {"ok": 0, "refused": 1}
    await keys.look()  # (unchanged: nothing)
    assert keys.keys == ("fixed", "key-one", "key-old")
    write_keys(path, "key-new\n")
    await keys.look()
    await keys.look()  # (the same twice: taken)
    assert keys.keys == ("fixed", "key-new") and keys.file_keys == ("key-new",)
    assert keys.reloads == {"ok": 1, "refused": 1}
