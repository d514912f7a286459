"""Connecting to a worker over a socket: addresses, the shared secret, and the
challenge-response that opens every connection. Sans-IO; no trio here.

Theory of operation
-------------------
A worker started with ``--listen`` speaks the wire protocol (:mod:`server.worker_protocol.wire`)
to each frontend connection, after this exchange::

    worker   -> frontend   [CHALLENGE, version, nonce, secret_required]
    frontend -> worker     [AUTH, cnonce, client_proof or nil]
    worker   -> frontend   [HELLO, info, worker_proof or nil]     (or [REFUSED, message])

``nonce`` and ``cnonce`` are 32 random bytes from each side. ``client_proof`` is
HMAC-SHA256(secret, "trio-llm worker auth v1\\0frontend\\0" + nonce + cnonce) and
``worker_proof`` the same with "worker": each side proves that it knows the secret without
sending it, a recorded exchange cannot be replayed (the other side's nonce is fresh), and
one side's proof is no use as the other's (the labels differ). Proofs are compared with
:func:`hmac.compare_digest`. A frontend that has a secret requires the worker's proof too,
so it never streams to a worker that does not know the secret.

The secret is not encryption: without TLS the prompts and outputs cross the network in
clear text. See docs/scaling.md.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from typing import NamedTuple

__all__ = [
    "SECRET_ENV",
    "VERSION",
    "WorkerAddress",
    "client_proof",
    "new_nonce",
    "parse_address",
    "read_secret",
    "verify",
    "worker_proof",
]

#: The environment variable both sides read the shared secret from.
SECRET_ENV = "TRIO_LLM_WORKER_SECRET"
#: The handshake's version (the CHALLENGE's second item).
VERSION = 1
#: The shortest secret accepted: a short one could be guessed by trying.
MIN_SECRET_LENGTH = 16

_LABEL = b"trio-llm worker auth v1\0"


class WorkerAddress(NamedTuple):
    """Where a worker listens: ``host`` and ``port``, or a unix socket ``path``. ``name``:
    the DNS name it was found by (server.discovery), which its TLS certificate names: a
    pod's address changes with each reschedule, its Service's name does not."""

    host: str | None
    port: int | None
    path: str | None
    name: str | None = None

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        if self.host is not None and ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        """A unix socket, or a loopback host: nothing outside this machine reaches it."""
        if self.path is not None:
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host or "").is_loopback
        except ValueError:
            return False


def parse_address(text: str) -> WorkerAddress:
    """``HOST:PORT``, ``[IPV6]:PORT`` or ``unix:/path``; raises ValueError naming the form.

    >>> parse_address("10.0.0.2:7100")
    WorkerAddress(host='10.0.0.2', port=7100, path=None, name=None)
    >>> str(parse_address("[::1]:7100")), parse_address("unix:/run/w.sock").path
    ('[::1]:7100', '/run/w.sock')
    """
    if text.startswith("unix:"):
        path = text[5:]
        if not path:
            raise ValueError(f"{text!r}: a unix socket address is unix:/path")
        return WorkerAddress(None, None, path)
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT, [IPV6]:PORT or unix:/path")
    return WorkerAddress(host, int(port), None)


def read_secret(path: str | None, env=None) -> bytes | None:
    """The shared secret: the file at ``path`` if given, else ``$TRIO_LLM_WORKER_SECRET``,
    else None; trailing line ends stripped from either (a Kubernetes Secret made from a
    file keeps its newline in the environment, and both sides must agree). Raises
    ValueError (with the reason) for an unreadable file or a secret shorter than 16
    characters."""
    env = os.environ if env is None else env
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read().rstrip(b"\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read the secret file: {exc}") from None
        source = path
    else:
        value = env.get(SECRET_ENV)
        if not value:
            return None
        secret = value.encode().rstrip(b"\r\n")
        source = f"${SECRET_ENV}"
    if len(secret) < MIN_SECRET_LENGTH:
        raise ValueError(
            f"the secret in {source} is {len(secret)} characters; use at least "
            f"{MIN_SECRET_LENGTH} (e.g. the output of: openssl rand -hex 32)"
        )
    return secret


def new_nonce() -> bytes:
    return os.urandom(32)


def _proof(secret: bytes, side: bytes, nonce: bytes, cnonce: bytes) -> bytes:
    return hmac.new(secret, _LABEL + side + b"\0" + nonce + cnonce, hashlib.sha256).digest()


def client_proof(secret: bytes, nonce: bytes, cnonce: bytes) -> bytes:
    """What a frontend sends to prove it knows ``secret``."""
    return _proof(secret, b"frontend", nonce, cnonce)


def worker_proof(secret: bytes, nonce: bytes, cnonce: bytes) -> bytes:
    """What a worker sends (with its HELLO) to prove it knows ``secret``."""
    return _proof(secret, b"worker", nonce, cnonce)


def verify(expected: bytes, got: object) -> bool:
    """Whether ``got`` is ``expected``, in constant time (False for a non-bytes ``got``)."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)
