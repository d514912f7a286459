"""bench/against.py (issue 47 item 4): its smoke run (ours against ours as the peer) prints a
table per round and ``ratio: X.XX`` last, and leaves no process behind; it refuses a peer
command without ``{port}`` and says why a peer that exits before it is ready did (its output);
SIGTERM in the middle of a round stops both servers. Real processes on real time: the
``fail_after`` bounds are hang guards only, and no figure is asserted (they are the bench's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "bench" / "against.py")
HANG_GUARD = 300  # seconds


def run(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *options], cwd=ROOT, capture_output=True,
                          text=True, timeout=HANG_GUARD, stdin=subprocess.DEVNULL)


def started_processes(stderr: str) -> list[int]:
    """The processes of both servers, as the script lists them when it stops each."""
    stops = re.findall(r"against: (ours|peer) stopped \(exit status (-?\d+).*?; processes ([\d ]+)\)",
                       stderr)
    assert sorted(name for name, _, _ in stops) == ["ours", "peer"], stderr
    return [int(pid) for _, _, pids in stops for pid in pids.split()]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        assert state == b"Z", (pid, state)  # (a zombie not yet reaped by init is gone too)


def test_smoke_run_prints_a_table_per_round_and_the_ratio_last():
    proc = run("--smoke")
    out = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, out
    assert "smoke run" in proc.stderr, out
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"ratio: \d+\.\d\d", lines[-1]), out
    assert re.search(r"per round: \d+\.\d\d, \d+\.\d\d; range \d+\.\d\d-\d+\.\d\d", proc.stdout), out
    assert lines[0].startswith("machine: ") and " commit " in lines[0], out
    for r in (1, 2):
        assert f"\nround {r}\n| server | tokens/s |" in proc.stdout, out
    rows = [line.split(" | ") for line in lines if line.startswith(("| ours ", "| peer "))]
    assert len(rows) == 4, out
    assert all(row[-1] == "0 |" and row[4] != "-" for row in rows), out  # (no errors, CPU read)
    # the runs alternate: ours first in round 1, the peer first in round 2
    order = re.findall(r"against: round (\d) (ours|peer):", proc.stderr)
    assert order == [("1", "ours"), ("1", "peer"), ("2", "peer"), ("2", "ours")], out
    assert_gone(started_processes(proc.stderr))


def test_a_peer_command_without_a_port_is_refused_before_anything_starts():
    proc = run("--peer", "python -m server --port 8000")
    assert proc.returncode == 2, proc.stderr
    assert "{port}" in proc.stderr and "against: peer (pid" not in proc.stderr, proc.stderr


def test_a_peer_that_exits_before_it_is_ready_is_reported_with_its_output():
    peer = "python -c 'import sys; print(\"no model at port {port}\", file=sys.stderr); sys.exit(3)'"
    proc = run("--peer", peer)
    kept = re.search(r"peer stopped \(exit status 3\); its log: (\S+)", proc.stderr)
    if kept:  # (kept for a user to read; not here)
        Path(kept[1]).unlink(missing_ok=True)
    assert proc.returncode == 2, proc.stderr
    assert kept, proc.stderr
    assert "peer exited with status 3 before it was ready" in proc.stderr, proc.stderr
    assert re.search(r"no model at port \d+", proc.stderr), proc.stderr
    assert "against: ours (pid" not in proc.stderr, proc.stderr  # (the peer starts first)


def test_a_peer_that_refuses_every_request_is_a_failure_that_says_why():
    """Every request of the peer's runs is a 400 (its context is shorter than a request):
    each of its runs says loadgen's first error, the exit status is 1, and no ratio is
    made of its rounds. A warm-up that fails throughout stops loadgen before it measures
    anything, so its run said 0 requests, 0 errors and nothing else before."""
    peer = (f"{sys.executable} -m server --host 127.0.0.1 --port {{port}} --engine sim "
            "--max-model-len 16 --disable-log-requests")
    proc = run("--peer", peer, "--rounds", "1", "--requests", "16", "--concurrency", "4",
               "--max-tokens", "32", "--prompt-tokens", "8", "--loadgen=--warmup 1")
    out = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 1, out
    assert re.search(r"round 1 peer: (warm-up|measured) error: \S*400", proc.stderr), out
    assert not re.search(r"round 1 ours: (warm-up|measured) error", proc.stderr), out
    assert "no ratio:" in proc.stdout and proc.stdout.strip().endswith("ratio: n/a"), out
    assert_gone(started_processes(proc.stderr))


async def test_sigterm_in_a_round_stops_both_servers():
    proc = await trio.lowlevel.open_process(
        [sys.executable, SCRIPT, "--smoke", "--duration", "600"], cwd=ROOT,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = b""
    try:
        with trio.fail_after(HANG_GUARD):
            while b"loadgen: warmup:" not in err:  # (the first round's measured window began)
                chunk = await proc.stderr.receive_some()
                assert chunk, err.decode()
                err += chunk
            proc.terminate()
            async for chunk in proc.stderr:
                err += chunk
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    stderr = err.decode()
    assert proc.returncode == 130, stderr
    assert "against: interrupted (SIGTERM)" in stderr, stderr
    assert "against: round 1 ours:" not in stderr, stderr  # (it was stopped in the round)
    assert_gone(started_processes(stderr))
