"""How a worker process ends once its body is done (server.workers.main.run_as_worker):
the exit a normal interpreter exit would make, without the teardown after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import trio

BODY = textwrap.dedent("""
    import atexit, concurrent.futures, sys
    from server.workers.main import run_as_worker

    def body(argv):
        # a library's thread pool that nobody shut down: its idle thread is not a daemon
        pool = concurrent.futures.ThreadPoolExecutor(1)
        assert pool.submit(lambda: 1).result() == 1
        atexit.register(lambda: print("atexit ran", flush=True))
        sys.stdout.write("buffered, not flushed")
        if argv == ["exit-3"]:
            raise SystemExit(3)
        if argv == ["exit-message"]:
            raise SystemExit("the reason")

    run_as_worker(body, sys.argv[1:])
""")


async def run_body(*args: str) -> subprocess.CompletedProcess:
    with trio.fail_after(60):  # (a hang guard: a worker that waits for the pool's thread)
        return await trio.run_process([sys.executable, "-c", BODY, *args],
                                      capture_stdout=True, capture_stderr=True, check=False)


async def test_a_worker_ends_with_its_code_after_the_exit_steps_of_a_normal_exit():
    for args, code in (((), 0), (("exit-3",), 3)):
        done = await run_body(*args)
        assert done.returncode == code, done.stderr
        # the thread pool's idle thread ended, the atexit handlers ran, output was flushed
        assert done.stdout.decode() == "buffered, not flushedatexit ran\n"
        assert done.stderr == b""


async def test_a_worker_that_exits_with_a_message_says_it_and_ends_with_1():
    done = await run_body("exit-message")
    assert done.returncode == 1
    assert done.stdout.decode() == "buffered, not flushedatexit ran\n"
    assert done.stderr == b"the reason\n"
