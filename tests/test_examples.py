"""The runnable examples in docs/ keep working."""

import pathlib
import sys

import trio

ROOT = pathlib.Path(__file__).resolve().parent.parent


async def run_example(*args: str, timeout: float) -> tuple[int, str]:
    """Run ``python ARGS`` from the project root; its exit status and output."""
    with trio.fail_after(timeout):
        result = await trio.run_process(
            [sys.executable, *args], capture_stdout=True, check=False, cwd=ROOT
        )
    return result.returncode, result.stdout.decode()


async def test_embed_example_runs():
    code, out = await run_example(str(ROOT / "docs" / "examples" / "embed.py"), timeout=30)
    assert code == 0, out
    assert out.count("(length)") == 6
    assert "after cancelling: [(0, 0), (0, 0)]" in out


async def test_serve_beside_your_app_example_runs():
    code, out = await run_example(
        str(ROOT / "docs" / "examples" / "serve_beside_your_app.py"), timeout=60
    )
    assert code == 0, out
    assert "openai route: 200" in out and "own route: 200 {'summary'" in out
    assert "servers stopped; workers alive: 2" in out
    assert "engine stopped; workers alive: 0" in out


async def test_the_testing_kit_example_tests_pass():
    # docs/testing.md's example: a user's own code, tested in virtual time with the kit.
    code, out = await run_example(
        "-m", "pytest", "-q", "-p", "no:cacheprovider",
        str(ROOT / "docs" / "examples" / "test_my_policy.py"),
        timeout=120,
    )
    assert code == 0, out
    assert "3 passed" in out
