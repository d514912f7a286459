"""The private directory of an ``--api-servers`` supervisor (its workers' and frontends'
unix sockets), and the removal of the ones that killed supervisors left behind. Linux.

A supervisor removes its directory when it ends, but not when it is SIGKILLed (the OOM
killer, ``kubectl delete --force``): each such death left a ``trio-llm-*`` directory in
the temporary directory. So the supervisor holds an exclusive ``flock`` on ``DIR/.lock``
as long as it lives (the kernel releases it when the process dies, however it dies), and
at start removes every ``trio-llm-*`` directory of its user whose lock it can take: their
owners are dead. A directory without a lock file (an older server's, or one being made)
is left alone, and so is a locked one, whatever its owner's pid looks like from here
(another PID namespace may share the temporary directory).

The lock file is locked before it is given its name (``.lock.new``, renamed), so another
supervisor can never find it unlocked while its owner lives.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

__all__ = ["PREFIX", "make_private_directory", "remove_stale_directories"]

#: How every supervisor's directory is named (then mkdtemp's random part).
PREFIX = "trio-llm-"
_LOCK = ".lock"


def make_private_directory() -> tuple[str, int]:
    """A new directory (mode 0700) in the temporary directory, and the descriptor of its
    lock, held: close it after removing the directory (not inherited by children)."""
    directory = tempfile.mkdtemp(prefix=PREFIX)
    new = os.path.join(directory, _LOCK + ".new")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(new, os.path.join(directory, _LOCK))
    except BaseException:
        os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, fd


def remove_stale_directories(parent: str | None = None) -> list[str]:
    """Remove the directories of dead supervisors in ``parent`` (the temporary directory):
    the paths removed."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    uid = os.getuid()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        try:
            if (not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != uid):
                continue
            fd = os.open(os.path.join(entry.path, _LOCK),
                         os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock file: not ours to judge
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its supervisor lives
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed
