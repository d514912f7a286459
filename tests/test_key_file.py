"""``--api-key-file`` (server/key_file.py, server/cli.py): the file's format, its refusals at
start through the real command line (one line naming the file and the line, never a key),
the union with ``--api-key`` and the environment, then real servers: one process accepting
a key of the file and refusing another (with one warning of the file's loose mode, no key
logged), and ``--api-servers 2``, whose frontends get the file's path and ``--api-key``'s
keys in their environment, never on their command lines, and each reload the file. The
reloads of one server: tests/test_key_file_reload.py; a frontend restarted while the file
is broken: tests/test_key_file_restarts.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import trio

from server.cli import API_KEY_ENV, build_parser, config_from_args, main
from server.cli_options import FRONTEND_KEYS_ENV
from server.key_file import loose_permissions, parse_key_file
from tests.remote import local_metrics, supervised
from tests.test_key_file_reload import write_keys
from tests.test_shutdown import REPO, cli_server

GOOD = "\ufeff# team a\r\n\n  key-one  \r\n\t# key-zero, retired\nkey-two\nkey-one\n"


def key_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def proc_words(pid: int, name: str) -> list[bytes]:
    """/proc/PID/NAME (cmdline, environ): its NUL-separated words."""
    return Path(f"/proc/{pid}/{name}").read_bytes().split(b"\0")


def test_a_key_file_is_its_keys_less_blanks_and_comments():
    assert parse_key_file(GOOD) == ("key-one", "key-two")  # (stripped; once each)
    assert parse_key_file("k#1\n") == ("k#1",)  # (a # inside a key is the key's)


@pytest.mark.parametrize("mode, loose", [(0o100600, False), (0o100400, False),
                                         (0o100640, False), (0o100644, True),
                                         (0o100660, True), (0o100602, True)])
def test_loose_permissions_are_others_reading_or_anyone_else_writing(mode, loose):
    assert loose_permissions(mode) is loose


@pytest.mark.parametrize("text, message", [
    ("", "no key in it"),
    ("# only\n\n   \n", "no key in it"),
    ("good\nsecret-key # note\n", "line 2: a key holds no whitespace"),
    ("good\n\nsecret\tkey\n", "line 3: a key holds no whitespace"),
    ("secret-k\u00e9y\n", "line 1: a key is printable ASCII"),
    ("secret-\x07key\n", "line 1: a key is printable ASCII"),
])
def test_a_bad_key_file_is_refused_at_start_in_one_line(tmp_path, text, message):
    path = key_file(tmp_path, text)
    with pytest.raises(SystemExit) as info:
        main(["--api-key-file", path])
    line = str(info.value.code)
    assert line.startswith(f"trio-llm-server: --api-key-file {path}: {message}")
    assert "\n" not in line and "secret" not in line  # (a key is never shown)


def test_an_unreadable_key_file_is_refused_at_start(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # (would wait for a writer: refused, not read)
    for path, why in ((tmp_path / "missing", "No such file"), (tmp_path, "Is a directory"),
                      (tmp_path / "fifo", "not a regular file")):
        with pytest.raises(SystemExit, match=f"--api-key-file {path}: {why}"):
            main(["--api-key-file", str(path)])


def test_a_refusal_is_one_line_without_a_traceback(tmp_path):
    """The real program: exit status 1, one line on stderr."""
    path = key_file(tmp_path, "a b\n")
    done = subprocess.run([sys.executable, "-m", "server", "--api-key-file", path],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"trio-llm-server: --api-key-file {path}: line 1: a key holds no whitespace (a "
        "comment is a line of its own, starting with #)"]


def test_the_keys_are_the_files_and_the_options_or_the_variables(tmp_path, monkeypatch):
    from server.http.app import create_app

    def accepted(argv: list[str]) -> tuple[str, ...]:
        return create_app(config_from_args(build_parser().parse_args(argv))).accepted_keys

    one = key_file(tmp_path, GOOD)
    other = tmp_path / "more"
    other.write_text("key-three\n")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert accepted(["--api-key-file", one]) == ("key-one", "key-two")
    config = config_from_args(build_parser().parse_args(
        ["--api-key", "cli,key-two", "--api-key-file", one, "--api-key-file", str(other)]))
    assert config.api_keys == ("cli", "key-two")  # (the files' are the app's to read)
    assert config.api_key_files == (one, str(other))
    assert create_app(config).accepted_keys == ("cli", "key-two", "key-one", "key-three")
    monkeypatch.setenv(API_KEY_ENV, "env")
    assert accepted(["--api-key-file", one]) == ("env", "key-one", "key-two")
    assert accepted(["--api-key", "cli", "--api-key-file", one]) \
        == ("cli", "key-one", "key-two")  # (--api-key wins over the variable, as alone)


async def test_a_server_takes_the_files_keys_and_refuses_others(tmp_path):
    path = key_file(tmp_path, GOOD, mode=0o644)
    async with cli_server("--api-key-file", path, "--api-key", "cli-key") as srv:
        for key in ("key-one", "key-two", "cli-key"):
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
            assert [m.id async for m in client.models.list()] == ["sim"]
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="key-zero",
                                    max_retries=0)  # (a comment of the file)
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
        log = srv.output()
    warnings = [line for line in log.splitlines() if "--api-key-file" in line]
    assert len(warnings) == 1 and "other users may read or change it (mode 0644)" \
        in warnings[0], log
    assert not any(key in log for key in ("key-one", "key-two", "cli-key")), log


async def test_the_frontends_of_api_servers_each_read_and_reload_the_key_file(tmp_path):
    """The supervisor hands ``--api-key``'s keys to its frontends in their environment (on
    no command line) and the key file as its path: each frontend reads it, and re-reads
    it when it changes, on its own (each counts its reload)."""
    path = key_file(tmp_path, GOOD)
    async with supervised(tmp_path, "--api-key", "cli-key", "--api-key-file", path,
                          "--api-key-file-interval", "0.05") as sup:
        frontends, _ = sup.children()
        assert len(frontends) == 2
        for pid in frontends.values():
            argv, environ = proc_words(pid, "cmdline"), proc_words(pid, "environ")
            assert b"cli-key" not in b" ".join(argv) and b"--api-key" not in argv
            assert argv[argv.index(b"--api-key-file") + 1] == path.encode()
            assert f"{FRONTEND_KEYS_ENV}=cli-key".encode() in environ
        write_keys(Path(path), "key-one\nkey-three\n")
        with trio.fail_after(60):
            for index in frontends:
                while (await local_metrics(sup.directory(), index)).get(
                        ("trio_llm:api_key_file_reloads_total",
                         frozenset({("model_name", "sim"), ("outcome", "ok")}))) != 1.0:
                    await trio.sleep(0.05)
        limits = httpx.Limits(max_keepalive_connections=0)  # (a connection per request:
        async with httpx.AsyncClient(base_url=sup.url, limits=limits) as http:  # both)
            for key, code in (("key-one", 200), ("key-three", 200), ("cli-key", 200),
                              ("key-two", 401), ("other", 401)) * 4:
                r = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == code, (key, r.text)
        assert "other users may read" not in sup.text()  # (mode 0600: no warning)


def test_a_broken_key_file_is_an_error_of_create_app(tmp_path):
    """The app reads the files itself (a frontend, or a library): refused, it is not made."""
    from server.config import ServerConfig
    from server.http.app import create_app
    from server.http.key_files import KeyFileError

    path = key_file(tmp_path, "key-one\n\nkey two\n")
    with pytest.raises(KeyFileError, match=f"--api-key-file {path}: line 3: "):
        create_app(ServerConfig(api_key_files=(path,)))
