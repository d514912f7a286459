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
