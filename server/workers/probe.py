"""``python -m server.workers.probe ADDRESS``: is a listening worker alive and serving?

For Kubernetes probes of worker pods (``exec``), and for operators. It connects to the
worker the way a frontend does (the secret from ``$TRIO_LLM_WORKER_SECRET`` or
``--secret-file``; TLS with ``--tls-ca``), completes the handshake, sends one PING and waits
for its PONG. A TCP connect alone would not do: the kernel accepts connections for a worker
whose engine loop hangs, while a PONG comes only from the loop itself, between two engine
steps, or, during one long step, from its pulse (:mod:`server.workers.pulse`: an unasked
PONG, sequence number 0, sent only while the step computes), which counts too. Exit status
0 and one line (``ok: running R, waiting W``) when the PONG came within ``--timeout``
seconds; 1 and the reason otherwise; 2 for a usage error. The worker logs the
probe's connection like any frontend's, and it holds no request.
"""

from __future__ import annotations

import argparse
import ssl
import sys

import trio

from ..config import EngineConfig
from ..manager.transport import SessionEnded, open_connected, tls_context
from ..worker_protocol import handshake, wire

__all__ = ["main", "probe"]

PROG = "python -m server.workers.probe"


async def probe(address: handshake.WorkerAddress, secret: bytes | None,
                tls: ssl.SSLContext | None = None) -> tuple[int, int]:
    """The worker's (running, waiting) counts, from one PING; SessionEnded if it fails."""
    config = EngineConfig(worker_secret=secret)
    link = await open_connected(config, address, tls)
    try:
        await link.handshake()
        await link.send.send_all(wire.encode([wire.PING, 1]))
        while True:
            data = await link.receive.receive_some(1 << 16)
            if not data:
                raise SessionEnded("the worker closed the connection before its PONG")
            for msg in link.decoder.feed(data):
                if wire.check_reply(msg)[0] == wire.PONG and msg[1] in (0, 1):  # 0: pulse
                    return msg[2], msg[3]
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise SessionEnded(f"the connection broke: {exc}") from None
    except wire.ProtocolError as exc:
        raise SessionEnded(f"protocol violation: {exc}") from None
    finally:
        await link.aclose(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("address", help="HOST:PORT, [IPV6]:PORT or unix:/path")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds for the whole probe (default 5)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help=f"the shared secret, in a file (default: ${handshake.SECRET_ENV})")
    p.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="connect over TLS, trusting the CA certificate(s) in this PEM file")
    args = p.parse_args(argv)
    try:
        address = handshake.parse_address(args.address)
        secret = handshake.read_secret(args.secret_file)
        tls = tls_context(args.tls_ca) if args.tls_ca else None
    except ValueError as exc:
        p.error(str(exc))
    except (OSError, ssl.SSLError) as exc:
        p.error(f"--tls-ca: {exc}")

    async def run() -> tuple[int, int] | None:
        with trio.move_on_after(args.timeout):
            return await probe(address, secret, tls)
        return None

    try:
        counts = trio.run(run)
    except SessionEnded as exc:
        print(f"{PROG}: {address}: {exc.reason}", file=sys.stderr)
        return 1
    if counts is None:
        print(f"{PROG}: {address}: no answer within {args.timeout:g} s", file=sys.stderr)
        return 1
    print(f"ok: running {counts[0]}, waiting {counts[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
