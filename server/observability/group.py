"""The frontends of one server (``--api-servers N``) as one ``/metrics``.

Theory of operation
-------------------
The supervisor gives every frontend the same private directory (mode 0700) and a number.
Frontend ``I`` listens on ``DIR/frontend-I.sock`` (:func:`serve_peer_scrapes`): whoever
connects gets this process's own metrics in the text format, and the connection closes;
nothing is read. A ``GET /metrics`` on the shared port reaches one frontend, chosen by the
kernel; that one connects to every other ``frontend-*.sock`` in the directory at once
(:func:`group_exposition`), each bounded by :data:`SCRAPE_TIMEOUT`, and merges what came
back with its own (:mod:`server.observability.merge`). A peer that does not answer (dead,
restarting) is left out; ``trio_llm:api_servers_scraped`` says how many answered.

No HTTP on the private socket: it serves one thing, to processes of the same user.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from .merge import Families, merge_expositions
from .metrics import PREFIX

__all__ = ["SCRAPE_TIMEOUT", "group_exposition", "peer_socket", "serve_peer_scrapes"]

log = logging.getLogger("server")

#: Seconds a scrape waits for each peer frontend.
SCRAPE_TIMEOUT = 2.0
#: The largest exposition read from a peer.
_MAX_EXPOSITION = 16 << 20


def peer_socket(directory: str, index: int) -> Path:
    """Where frontend ``index`` of the group in ``directory`` answers scrapes."""
    return Path(directory) / f"frontend-{index}.sock"


async def serve_peer_scrapes(
    path: Path, exposition: Callable[[], bytes], *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Answer every connection to the unix socket ``path`` with ``exposition()`` (this
    process's metrics, text format), then close it. ``started()`` once listening; a stale
    socket file (a predecessor's) is replaced, and the file is removed at the end."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(os.fspath(path))
        sock.listen(16)
        listener = trio.SocketListener(sock)
    except BaseException:
        sock.close()
        raise
    try:
        task_status.started()
        while True:
            stream = await listener.accept()
            # One at a time: scrapes are rare, and each is bounded.
            with trio.move_on_after(SCRAPE_TIMEOUT):
                try:
                    await stream.send_all(exposition())
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the peer went away (or only checked that we listen)
            with trio.CancelScope(shield=True):
                await stream.aclose()
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()
        try:
            os.unlink(path)
        except OSError:
            pass


async def _scrape(path: Path, texts: dict[str, str], name: str) -> None:
    with trio.move_on_after(SCRAPE_TIMEOUT):
        try:
            stream = await trio.open_unix_socket(os.fspath(path))
        except OSError:
            return  # not listening: dead, or restarting
        async with stream:
            chunks: list[bytes] = []
            size = 0
            try:
                while chunk := await stream.receive_some(1 << 16):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > _MAX_EXPOSITION:
                        log.warning("metrics of frontend %s: too large, left out", name)
                        return
            except trio.BrokenResourceError:
                return
            texts[name] = b"".join(chunks).decode("utf-8", "replace")


async def group_exposition(
    directory: str, index: int, own: bytes, accept: str | None
) -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` answered for the whole group: ``own``
    (this frontend's text exposition) merged with those of the peers that answer."""
    texts = {str(index): own.decode()}
    peers: dict[str, Path] = {}
    for entry in os.listdir(directory):  # (a private directory of a few entries)
        if entry.startswith("frontend-") and entry.endswith(".sock"):
            name = entry[len("frontend-"):-len(".sock")]
            if name != str(index):
                peers[name] = Path(directory, entry)
    async with trio.open_nursery() as nursery:
        for name, path in peers.items():
            nursery.start_soon(_scrape, path, texts, name)
    ordered = {name: texts[name] for name in sorted(texts, key=_number)}
    try:
        families = merge_expositions(ordered)
    except ValueError:  # a truncated text (a peer killed mid-answer): ours only
        log.warning("metrics of a frontend could not be parsed; left out")
        families = merge_expositions({str(index): texts[str(index)]})
        ordered = {str(index): texts[str(index)]}
    scraped = GaugeMetricFamily(
        PREFIX + "api_servers_scraped",
        "Frontend processes whose metrics this scrape merged (--api-servers).",
    )
    scraped.add_metric([], len(ordered))
    families.append(scraped)
    encoder, content_type = choose_encoder(accept or "")
    return encoder(Families(families)), content_type  # type: ignore[arg-type]


def _number(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() else (1 << 30, name)
