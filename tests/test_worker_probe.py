"""``python -m server.workers.probe``: the exec probe of worker pods (deploy/kubernetes)."""

from __future__ import annotations

import signal
import sys

import trio

from tests.remote import ROOT, SECRET, listening_worker, worker_env


async def run_probe(address: str, *args: str, secret: str | None = SECRET, timeout: float = 2):
    cmd = [sys.executable, "-m", "server.workers.probe", address, "--timeout", str(timeout),
           *args]
    with trio.fail_after(timeout + 20):
        return await trio.run_process(cmd, capture_stdout=True, capture_stderr=True,
                                      check=False, env=worker_env(secret), cwd=ROOT)


async def test_a_serving_worker_answers_and_a_hung_or_absent_one_does_not(tmp_path):
    async with listening_worker(tmp_path) as w:
        address = str(w.address)
        ok = await run_probe(address)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.decode().strip() == "ok: running 0, waiting 0"
        wrong = await run_probe(address, secret="another secret of 16+ chars")
        assert wrong.returncode == 1 and b"refused" in wrong.stderr
        # A worker whose loop does not run (stopped): the kernel still accepts the
        # connection, but no PONG comes.
        w.proc.send_signal(signal.SIGSTOP)
        try:
            hung = await run_probe(address, timeout=1)
        finally:
            w.proc.send_signal(signal.SIGCONT)
        assert hung.returncode == 1 and b"no answer within 1 s" in hung.stderr
        assert "Traceback" not in w.text()
    gone = await run_probe(address)
    assert gone.returncode == 1 and b"cannot connect" in gone.stderr
    usage = await run_probe("not-an-address")
    assert usage.returncode == 2
