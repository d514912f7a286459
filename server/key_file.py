"""The API keys of ``--api-key-file``: one key per line. Sans-IO: the text in, the keys
out (server.cli reads the file, and says which file a refusal is about).

Why a file: a key on the command line (``--api-key``) is visible to every user of the host
in ``ps``, and an environment variable holds one comma-separated line. A file holds many
keys (one per client, each its own owner of what it stores: docs/state.md), can be a
mounted secret, and is readable by its owner alone.

The format: a key per line, surrounding whitespace stripped; blank lines and lines whose
first character (after the whitespace) is ``#`` are ignored. A key is printable ASCII
without whitespace, since clients send it in an HTTP header: ``key # note`` is refused, not
read as ``key``. A file with no key is refused too (a server meant to need keys would
otherwise need none). A refusal names the line, never the key (keys are secrets).

The file is read when the server starts, and again whenever it changes
(server.http.key_files): a key removed from it is refused from then on, without a restart.
"""

from __future__ import annotations

__all__ = ["LOOSE_MODE", "MAX_BYTES", "loose_permissions", "parse_key_file"]

#: The largest key file read (a key per client is a few KiB for thousands of clients).
MAX_BYTES = 1 << 20

#: Permission bits that let someone other than the file's owner read it, or other than its
#: owner change it (add a key of their own): others' read and write, the group's write.
LOOSE_MODE = 0o026


def _refusal(key: str) -> str | None:
    """Why ``key`` (a stripped, non-empty line) is not a key, or None."""
    if any(c.isspace() for c in key):
        return "a key holds no whitespace (a comment is a line of its own, starting with #)"
    if not all("\x21" <= c <= "\x7e" for c in key):
        return "a key is printable ASCII (clients send it in an HTTP header)"
    return None


def parse_key_file(text: str) -> tuple[str, ...]:
    """The keys of a key file's ``text``, in order, each once. ValueError naming the line
    (``line 3: ...``) of the first that is not a key, or saying that there is none."""
    keys: dict[str, None] = {}
    for number, line in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        why = _refusal(key)
        if why is not None:
            raise ValueError(f"line {number}: {why}")
        keys[key] = None
    if not keys:
        raise ValueError("no key in it (one per line; # starts a comment)")
    return tuple(keys)


def loose_permissions(mode: int) -> bool:
    """Whether a file of ``mode`` (``st_mode``) may be read by other users, or changed by
    anyone but its owner: then the server warns, as ssh does of a private key."""
    return bool(mode & LOOSE_MODE)
