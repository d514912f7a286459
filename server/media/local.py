"""``file://`` image URLs, read only under the operator's allowed directory.

The path is resolved (every symlink followed) before it is compared with the allowed
directory (resolved too), so a link inside it that points out is refused. The file is then
opened without following a last symlink, must be a regular file within the byte limit, and
is read in a worker thread. Its type is what its name says, and its magic must agree.
"""

from __future__ import annotations

import mimetypes
import os
import stat
from pathlib import Path

import trio

from .errors import MediaFetchFailed, MediaRefused, MediaTooLarge
from .image import FetchedImage, checked_image
from .policy import FileUrl, MediaPolicy

__all__ = ["read_local_image"]


async def read_local_image(source: FileUrl, policy: MediaPolicy) -> FetchedImage:
    """The image ``source`` names, if under ``policy.allowed_local_dir``."""
    data, path = await trio.to_thread.run_sync(_read, source, policy)
    return checked_image(source.url, data, mimetypes.guess_type(path)[0])


def _read(source: FileUrl, policy: MediaPolicy) -> tuple[bytes, str]:
    url = source.url
    assert policy.allowed_local_dir is not None
    if not source.path.startswith("/"):
        raise MediaRefused(url, "is a file: URL whose path is not absolute")
    root = Path(policy.allowed_local_dir).resolve()
    try:
        path = Path(source.path).resolve()
    except (OSError, RuntimeError, ValueError):  # (ValueError: a lone surrogate)
        raise MediaRefused(url, "names a path that does not resolve (a symlink loop, or "
                           "not a file name)") from None
    if root not in path.parents:
        raise MediaRefused(url, "names a file outside --allowed-local-media-path")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise MediaFetchFailed(url, f"could not be read ({exc.strerror})") from None
    except ValueError:  # (a name the file system cannot encode)
        raise MediaRefused(url, "names a path that is not a file name") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise MediaRefused(url, "names something that is not a regular file")
        if info.st_size > policy.max_bytes:
            raise MediaTooLarge(url, f"is {info.st_size} bytes, more than the limit of "
                                f"{policy.max_bytes}")
        data = file.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise MediaTooLarge(url, f"is more than the limit of {policy.max_bytes} bytes")
    return data, str(path)
