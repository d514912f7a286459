"""tests/smoke_forker.py: a script run in a forked child behaves as ``python SCRIPT ARGS``
(its exit status, output, ``__main__``, ``sys.argv``, ``sys.path``), and a hang is killed
with the processes it started. The bench smoke runs rely on it to fail as before."""

from __future__ import annotations

import textwrap
import time

import pytest

from tests.processes import pid_exists
from tests.smoke_forker import Forker


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    forker = Forker(["json"], tmp_path_factory.mktemp("forker") / "log")
    yield forker
    forker.close()


def _run(forker, tmp_path, source: str, *args: str, timeout: float = 120):
    script = tmp_path / "scripts" / "script.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(source))
    out = tmp_path / "out"
    out.mkdir()
    return forker.run(script, list(args), cwd=tmp_path, out_dir=out, timeout=timeout)


def test_forks_where_the_parent_runs_one_thread(forker):
    assert forker.why_not == ""


def test_a_script_runs_as_main_with_its_arguments_folder_and_no_stdin(forker, tmp_path):
    run = _run(forker, tmp_path, """
        import os, sys
        print(__name__, sys.argv[1:], sys.path[0] == os.path.dirname(__file__),
              os.getcwd(), repr(sys.stdin.read()))
        print("to stderr", file=sys.stderr)
    """, "--smoke", "x")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"__main__ ['--smoke', 'x'] True {tmp_path} ''\n"
    assert run.stderr == "to stderr\n"
    assert not run.timed_out


@pytest.mark.parametrize(("source", "status", "said"), [
    ("import sys; sys.exit(3)", 3, ""),
    ("raise RuntimeError('the bench broke')", 1, "RuntimeError: the bench broke"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -15, ""),
])
def test_a_failing_script_returns_its_status(forker, tmp_path, source, status, said):
    run = _run(forker, tmp_path, source)
    assert run.returncode == status, run.stderr
    assert said in run.stderr


def test_a_hung_script_is_killed_with_its_subprocesses(forker, tmp_path):
    run = _run(forker, tmp_path, """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
    """, timeout=10)  # (a guard the script never ends within: it sleeps for good)
    assert run.timed_out
    child = int(run.stdout)
    deadline = time.monotonic() + 60  # (a hang guard: SIGKILL is sent; init reaps it soon)
    while pid_exists(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_exists(child), "the script's subprocess outlived the hang guard"
