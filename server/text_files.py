"""A small configuration file's text (a key file, a ``--model-config``), read with bounds.

Why bounds: a FIFO would hang the reader until a writer came, a device such as /dev/zero
would never end, and a huge file would be read whole. So only a regular file is read, at
most ``limit`` bytes, as UTF-8. The check is made on the descriptor opened, not on the
name before, so a file swapped in between is the one checked.
"""

from __future__ import annotations

import os
import stat

__all__ = ["read_text_file"]


def read_text_file(path: str, limit: int) -> str:
    """The text of the file at ``path``. ValueError with one short reason otherwise (the
    caller names the file): the OS's words, not a regular file, over ``limit`` bytes, or
    not UTF-8 (with the byte)."""
    try:
        # (O_NONBLOCK: opening a FIFO waits for a writer otherwise)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
