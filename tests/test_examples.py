"""The runnable examples in docs/ keep working."""

import pathlib
import sys

import trio

ROOT = pathlib.Path(__file__).resolve().parent.parent


async def test_embed_example_runs():
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, str(ROOT / "docs" / "examples" / "embed.py")],
            capture_stdout=True,
            cwd=ROOT,
        )
    out = result.stdout.decode()
    assert out.count("(length)") == 6
    assert "after cancelling: [(0, 0), (0, 0)]" in out


async def test_serve_beside_your_app_example_runs():
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, str(ROOT / "docs" / "examples" / "serve_beside_your_app.py")],
            capture_stdout=True,
            cwd=ROOT,
        )
    out = result.stdout.decode()
    assert "openai route: 200" in out and "own route: 200 {'summary'" in out
    assert "servers stopped; workers alive: 2" in out
    assert "engine stopped; workers alive: 0" in out


async def test_the_testing_kit_example_tests_pass():
    # docs/testing.md's example: a user's own code, tested in virtual time with the kit.
    with trio.fail_after(120):
        result = await trio.run_process(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             str(ROOT / "docs" / "examples" / "test_my_policy.py")],
            capture_stdout=True,
            check=False,
            cwd=ROOT,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out
    assert "3 passed" in out
