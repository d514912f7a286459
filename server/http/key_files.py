"""The keys of ``--api-key-file`` kept current while the server runs: no restart, no signal.

Operators rotate keys by changing the file. A Kubernetes secret volume swaps a symlink
(``..data``) to a new directory; an editor rewrites the file. A task in the app's lifespan
nursery stats every file each ``--api-key-file-interval`` seconds. When one file's
``(st_mtime_ns, st_size, st_ino)`` changed, every file is read again. The stat follows
symlinks, so a swap changes the inode seen. The keys in force become the fixed ones
(``--api-key``, the variable) and the files'. Why a period rather than SIGHUP: a library
must not install a signal handler for its whole process. Why not inotify: a period needs
nothing of the platform, and a swap of a parent directory's symlink is seen all the same.

A changed file takes effect once two looks in a row read the same keys (or refusal) from
it. A file written in place can be read while half written, its last key perhaps cut
short: a shorter key would then be let in. A file still being written differs at the next
look, so its cut is never in force (a writer that stalls a whole interval mid-file is not
told apart: replace files whole). The cost is one more interval: a change is in force one
to two intervals after its last write. The first read, when the app is made, is in force
at once. The signatures need not match too: a tool that rewrites the same keys more often
than the interval would then never be heard. Two writes cut at the same byte at two
looks are no risk worth that.

A file that is then missing, unreadable or refused by
:func:`~server.key_file.parse_key_file` changes nothing: the keys in force stay. One
warning names the file and the line, never a key, and the file is read again when it
changes again. So a broken file neither locks every client out nor lets every client in.
Each reload counts as ``ok`` or ``refused`` (``trio_llm:api_key_file_reloads_total``). A
file refused when the app is made is an error (:class:`KeyFileError`): a server never
starts with fewer keys than it was given. A restarted frontend of ``--api-servers`` is
the exception. Its supervisor watches the files too, and hands it the files' keys in
force (``handed``). A refused file then counts as a refused reload, and the handed keys
stay in force until the file changes: the frontend serves as its peers do. One crash
while the file is broken must not end the supervisor, and every frontend with it.

A file changed in the last :data:`RECENT_NS` is read again at the next look, signature
or not. A file system stamps times in ticks (a few ms; 1 or 2 s on some). A file rewritten
in place within one tick, at the same size, keeps its signature: a rotated key would go
unseen until the next change. A re-read that finds what it found before counts nothing.

A removed key is refused from the next request on; a request already past its check
finishes. What a key stored stays its owner's (:func:`server.state.owner_of`, a digest of
the key): a key that comes back finds it again. With ``--api-servers`` each frontend
watches the files on its own, so the frontends agree again within two periods; the
supervisor watches them as well, for the keys it hands a restarted frontend.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass

import trio

from ..key_file import MAX_BYTES, loose_permissions, parse_key_file
from ..text_files import read_text_file
from .auth import APIKeys

__all__ = ["KeyFileError", "KeyFiles", "read_key_files"]

log = logging.getLogger("server")

#: What tells that a file changed: ``(st_mtime_ns, st_size, st_ino)``; None: no stat.
Signature = tuple[int, int, int] | None

#: How recent a change may still be followed by another with the same signature (2 s: the
#: coarsest time stamps, FAT's); such a file is read again at the next look.
RECENT_NS = 2_000_000_000


class KeyFileError(ValueError):
    """A key file refused when the app is made (``--api-key-file PATH: why``): the server
    must not start, since it would accept fewer keys than it was given, or none."""


def read_key_files(paths: tuple[str, ...]) -> tuple[str, ...]:
    """Every file's keys, in order, each once. ValueError ``PATH: why`` (the line, never
    a key) for the first file that cannot be read or holds no key."""
    keys: dict[str, None] = {}
    for path in paths:
        try:
            keys.update(dict.fromkeys(parse_key_file(read_text_file(path, MAX_BYTES))))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return tuple(keys)


@dataclass(frozen=True)
class _Look:
    """The files as one look found them: their signatures, and their keys or why not."""

    signatures: tuple[Signature, ...]
    keys: tuple[str, ...] = ()
    refusal: str | None = None
    #: The files others may read or change, with their modes.
    loose: tuple[tuple[str, int], ...] = ()
    #: Some file changed within RECENT_NS of the look: read it again at the next.
    recent: bool = False


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _look(paths: tuple[str, ...], seen: tuple[Signature, ...] | None,
          again: bool = False) -> _Look | None:
    """The files read again, or None when no signature differs from ``seen`` and not
    ``again``. Blocking: run in a thread. The stats come before the reads, so a change
    after them is seen by the next look."""
    now = time.time_ns()
    stats = [_stat(p) for p in paths]
    signatures = tuple(None if s is None else (s.st_mtime_ns, s.st_size, s.st_ino)
                       for s in stats)
    if signatures == seen and not again:
        return None
    recent = any(s is not None and s.st_mtime_ns > now - RECENT_NS for s in stats)
    try:
        keys = read_key_files(paths)
    except ValueError as exc:
        return _Look(signatures, refusal=str(exc), recent=recent)
    loose = tuple((p, stat.S_IMODE(s.st_mode)) for p, s in zip(paths, stats)
                  if s is not None and loose_permissions(s.st_mode))
    return _Look(signatures, keys=keys, loose=loose, recent=recent)


class KeyFiles:
    """The keys in force: ``fixed`` ones and those of the files at ``paths``, read now and
    again when they change (:meth:`run`). :attr:`api_keys` checks a request against them;
    :attr:`keys` are the keys themselves (the batch runner sends its batch owner's), and
    :attr:`file_keys` the files' alone (what a supervisor hands a restarted frontend).

    A file refused now is :class:`KeyFileError`, unless ``handed`` keys are given: then
    they are the files' keys in force, with one warning, until a good file replaces them.
    ``logger``: where the changes are told (the supervisor's own, in a supervisor)."""

    def __init__(self, fixed: tuple[str, ...], paths: tuple[str, ...], interval: float,
                 *, handed: tuple[str, ...] | None = None,
                 logger: logging.Logger = log) -> None:
        self.paths = paths
        self.interval = interval
        self._fixed = fixed
        self._log = logger
        #: Reloads since the start, by outcome: ``ok`` or ``refused`` (``/metrics``).
        self.reloads = {"ok": 0, "refused": 0}
        look = _look(paths, None)
        assert look is not None  # (nothing seen yet)
        if look.refusal is not None and handed is None:
            raise KeyFileError(f"--api-key-file {look.refusal}")
        self._signatures = look.signatures
        #: What the last read found (keys, refusal), and whether to read again regardless.
        self._found: tuple[tuple[str, ...], str | None] = (look.keys, look.refusal)
        self._again = look.recent
        #: The last look found a change, not in force until the next finds it the same.
        self._pending = False
        self.keys: tuple[str, ...] = ()
        self.file_keys: tuple[str, ...] = ()
        self.api_keys = APIKeys((), allow_none=True)
        if look.refusal is not None and handed is not None:
            self.reloads["refused"] += 1
            self._log.warning("--api-key-file %s; the %d key(s) in force at the supervisor "
                              "stay until it changes", look.refusal, len(handed))
            self._take(handed)
        else:
            self._take(look.keys)

    def _take(self, keys: tuple[str, ...]) -> None:
        self.file_keys = keys
        self.keys = tuple(dict.fromkeys(self._fixed + keys))
        self.api_keys = APIKeys(self.keys, allow_none=True)

    def _seen(self, look: _Look) -> None:
        """A look that read the files: a change waits for the next look; one that finds
        the files as the last did puts a waiting change in force (the new keys, or a
        warning and the old)."""
        same = (look.keys, look.refusal) == self._found
        self._signatures, self._found, self._again = \
            look.signatures, (look.keys, look.refusal), look.recent
        if not same:
            self._pending = True  # (perhaps still being written)
            return
        if not self._pending:  # (a recent file read again, as it was)
            return
        self._pending = False
        if look.refusal is not None:
            self.reloads["refused"] += 1
            self._log.warning("--api-key-file %s; the keys in force stay until it changes "
                              "again", look.refusal)
            return
        self.reloads["ok"] += 1
        before = len(self.keys)
        self._take(look.keys)
        self._log.info("--api-key-file changed: %d key(s) in force (%d before)",
                       len(self.keys), before)
        for path, mode in look.loose:
            self._log.warning("--api-key-file %s: other users may read or change it "
                              "(mode %04o); chmod 600 it", path, mode)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The watch, a service of the app's lifespan nursery (or the supervisor's):
        started at once, then :meth:`look` every ``interval`` seconds until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.look()

    async def look(self) -> None:
        """One look at the files: read them when they changed, or to confirm a change. In
        a thread (a stat of a network file system can block); cancelled, the thread is
        left to end alone."""
        look = await trio.to_thread.run_sync(_look, self.paths, self._signatures,
                                             self._again or self._pending,
                                             abandon_on_cancel=True)
        if look is not None:
            self._seen(look)
