"""``--api-key-file`` re-read while the server runs (server/http/key_files.py), through real
servers over HTTP: a rotated key in force without a restart, the removed key refused, a
removed key's stored file found again when the key comes back; a broken file keeping the
keys in force (counted, warned of by file and line, never by key); a Kubernetes secret's
symlink swap noticed even where time and size stay the same; and, on the watch alone, a
rewrite in place within one time stamp tick, which only a re-read of a recent file sees,
and a file read half written, whose cut keys are never in force (a change is taken once
two looks read the same keys)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import trio

from server.http.key_files import KeyFiles
from tests.remote import parse_samples
from tests.test_files_api import batch_file
from tests.test_shutdown import cli_server

#: A small period, so that a change is seen at once (the default is 10 s).
FAST = ("--api-key-file-interval", "0.05")


def write_keys(path: Path, text: str) -> None:
    """Replace the file whole (a new inode), as a careful operator or tool does."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


async def status(http: httpx.AsyncClient, key: str) -> int:
    r = await http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    return r.status_code


async def reloads(http: httpx.AsyncClient) -> dict[str, float]:
    """``trio_llm:api_key_file_reloads_total`` by outcome (``/metrics`` needs no key)."""
    samples = parse_samples((await http.get("/metrics")).text)
    return {dict(labels)["outcome"]: value for (name, labels), value in samples.items()
            if name == "trio_llm:api_key_file_reloads_total"}


async def wait_for_reloads(http: httpx.AsyncClient, **wanted: float) -> None:
    """Until the reload counts are ``wanted`` (a hang guard, not a time bound)."""
    with trio.fail_after(60):
        while (counts := await reloads(http)) != {"ok": 0.0, "refused": 0.0, **wanted}:
            await trio.sleep(0.05)
    assert counts  # (the family is there from the start, at zero)


async def test_a_rotated_key_file_takes_effect_without_a_restart(tmp_path):
    path = tmp_path / "keys"
    write_keys(path, "key-old\n")
    async with cli_server("--api-key-file", str(path), *FAST) as srv, \
            httpx.AsyncClient(base_url=srv.url) as http:
        assert await reloads(http) == {"ok": 0.0, "refused": 0.0}
        old = {"Authorization": "Bearer key-old"}
        r = await http.post("/v1/files", headers=old, data={"purpose": "batch"},
                            files={"file": ("a.jsonl", batch_file(1))})
        assert r.status_code == 200, r.text
        stored = r.json()["id"]

        write_keys(path, "key-new\n")
        await wait_for_reloads(http, ok=1)
        assert await status(http, "key-new") == 200
        assert await status(http, "key-old") == 401
        r = await http.get(f"/v1/files/{stored}", headers={"Authorization": "Bearer key-new"})
        assert r.status_code == 404  # (the old key's, not the new key's)

        write_keys(path, "key-new\nkey-old\n")  # (the old key comes back: its file too)
        await wait_for_reloads(http, ok=2)
        r = await http.get(f"/v1/files/{stored}", headers=old)
        assert r.status_code == 200 and r.json()["id"] == stored, r.text
        log = srv.output()
    assert "--api-key-file changed: 1 key(s) in force (1 before)" in log, log
    assert "key-old" not in log and "key-new" not in log, log


async def test_a_broken_key_file_keeps_the_keys_in_force(tmp_path):
    path = tmp_path / "keys"
    write_keys(path, "key-one\n")
    async with cli_server("--api-key-file", str(path), *FAST) as srv, \
            httpx.AsyncClient(base_url=srv.url) as http:
        write_keys(path, "key-two\nkey three\n")  # (a bad line: nothing of it is taken)
        await wait_for_reloads(http, refused=1)
        assert await status(http, "key-one") == 200
        assert await status(http, "key-two") == 401
        path.unlink()  # (missing: the same)
        await wait_for_reloads(http, refused=2)
        assert await status(http, "key-one") == 200
        write_keys(path, "")  # (no key: refused, else every client would be let in)
        await wait_for_reloads(http, refused=3)
        assert await status(http, "key-one") == 200
        write_keys(path, "key-two\n")  # (fixed: taken at once)
        await wait_for_reloads(http, ok=1, refused=3)
        assert await status(http, "key-two") == 200
        assert await status(http, "key-one") == 401
        log = srv.output()
    refusals = [line for line in log.splitlines() if "the keys in force stay" in line]
    assert len(refusals) == 3, log  # (once per change, not once per look)
    assert f"--api-key-file {path}: line 2: a key holds no whitespace" in refusals[0], log
    assert f"--api-key-file {path}: No such file" in refusals[1], log
    assert f"--api-key-file {path}: no key in it" in refusals[2], log
    assert not any(k in log for k in ("key-one", "key-two", "key three")), log


async def test_a_kubernetes_symlink_swap_is_noticed(tmp_path):
    """A secret volume: ``keys -> ..data/keys``, ``..data -> ..<time>`` swapped by a
    rename. The new file has the old one's time and size: only its inode tells."""
    volume = tmp_path / "secret"
    first = volume / "..2026_12_04_01"
    first.mkdir(parents=True)
    (first / "keys").write_text("key-aaa\n")
    (volume / "..data").symlink_to(first.name)
    (volume / "keys").symlink_to("..data/keys")
    async with cli_server("--api-key-file", str(volume / "keys"), *FAST) as srv, \
            httpx.AsyncClient(base_url=srv.url) as http:
        assert await status(http, "key-aaa") == 200
        second = volume / "..2026_12_04_02"
        second.mkdir()
        (second / "keys").write_text("key-bbb\n")
        old = os.stat(first / "keys")
        os.utime(second / "keys", ns=(old.st_atime_ns, old.st_mtime_ns))
        (volume / "..data_tmp").symlink_to(second.name)
        os.replace(volume / "..data_tmp", volume / "..data")
        await wait_for_reloads(http, ok=1)
        assert await status(http, "key-bbb") == 200
        assert await status(http, "key-aaa") == 401
        assert "key-aaa" not in srv.output()


async def test_a_rewrite_within_one_time_stamp_tick_is_read(tmp_path):
    """A file rewritten in place (same inode) at the same size, within its file system's
    time stamp tick (here: its old time put back), keeps its signature. It changed
    recently, so the watch reads it again anyway; doing so as it was counts nothing."""
    path = tmp_path / "keys"
    write_keys(path, "key-aaa\n")
    keys = KeyFiles((), (str(path),), 0.01)
    assert keys.keys == ("key-aaa",)
    async with trio.open_nursery() as nursery:
        await nursery.start(keys.run)
        before = os.stat(path)
        path.write_text("key-bbb\n")  # (in place: O_TRUNC, the same inode)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(path).st_ino == before.st_ino
        with trio.fail_after(30):
            while keys.keys != ("key-bbb",):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert keys.reloads == {"ok": 1, "refused": 0}


async def test_a_file_read_half_written_is_not_taken(tmp_path):
    """A file written in place, read while its writer is between two writes: its cut
    (``key-c``, a shorter key than the one being written) is not in force, nor is the whole
    file until a second look finds it the same. One look at a time: :meth:`KeyFiles.look`."""
    path = tmp_path / "keys"
    write_keys(path, "key-aaa\n")
    keys = KeyFiles(("fixed",), (str(path),), 10.0)
    assert keys.keys == ("fixed", "key-aaa")  # (the first read: at once)
    with path.open("w") as writer:  # (in place: truncated, the same inode)
        writer.write("key-bbb\nkey-c")
        writer.flush()
        await keys.look()
        assert keys.keys == ("fixed", "key-aaa")
        writer.write("cc-long\n")
    await keys.look()  # (the whole file, changed since the last look: not yet)
    assert keys.keys == ("fixed", "key-aaa") and not keys.api_keys.verify(b"Bearer key-c")
    await keys.look()  # (the same again: taken)
    assert keys.keys == ("fixed", "key-bbb", "key-ccc-long")
    await keys.look()
    assert keys.reloads == {"ok": 1, "refused": 0}
    # The same keys at two looks are taken, though the file was rewritten between them (a
    # tool that rewrites it more often than the interval is heard).
    write_keys(path, "key-ddd\n")
    await keys.look()
    write_keys(path, "key-ddd\n")  # (a new inode: another signature)
    await keys.look()
    assert keys.keys == ("fixed", "key-ddd")
    assert keys.reloads == {"ok": 2, "refused": 0}
