"""Issue 42 item 5: configuration that cannot work is refused at start, in one line naming
the option or the file, by the real command line (a subprocess each: the hang guard is the
subprocess timeout, far above the second or two a refusal takes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server.cli import build_parser
from server.engine_args import VLLM_FLAGS

#: A hang guard, not a bound on speed: a refusal is an import and a parse.
GUARD = 120


def start(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", "--port", "0", *argv],
                          capture_output=True, text=True, timeout=GUARD,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("argv, says", [
    (["--max-body-bytes", "-1"], "argument --max-body-bytes: expected an integer of at least 1"),
    (["--max-n", "0"], "argument --max-n: expected an integer of at least 1"),
    (["--heartbeat-timeout", "nan"], "argument --heartbeat-timeout: expected a number greater"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: expected a number"),
])
def test_a_limit_out_of_its_range_is_refused_at_start(argv, says):
    done = start(*argv)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def _bomb(levels: int = 8) -> str:
    """A YAML alias bomb of ~400 bytes: 9**levels strings once its aliases are written out."""
    lines = ["models:", "  - name: m", "    engine-arg:",
             '      a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        lines.append(f"      a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_bad_model_config_files_are_refused_at_start(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bomb())
    assert len(bomb.read_bytes()) < 600
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # (nothing ever writes it: reading it would wait forever)
    big = tmp_path / "big.yaml"
    big.write_text("models: []\n" + "#" * (2 << 20))
    for path, says in [(bomb, "once its YAML aliases are expanded"),
                       (fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                       (big, "larger than 1048576 bytes")]:
        done = start("--model-config", str(path))
        (line,) = done.stderr.splitlines()  # (one line, no traceback)
        assert done.returncode == 1 and line.startswith(f"trio-llm-server: {path}: "), line
        assert says in line, line


#: Numeric options vLLM checks itself (passed through as they are), not ours to bound.
VLLMS = {flag[2:].replace("-", "_") for flag, _, _ in VLLM_FLAGS}


@pytest.mark.parametrize("program", ["server", "listening worker"])
def test_every_numeric_option_has_a_range(program, capsys):
    """A new numeric option gets its range in server.option_bounds (or is vLLM's)."""
    from server.workers.listen import build_parser as worker_parser

    parser = build_parser() if program == "server" else worker_parser()
    numeric = {a.dest for a in parser._actions
               if a.type is not None and a.option_strings
               and getattr(a.type, "__name__", "") in ("int", "float")}
    unbounded = {d for d in numeric - VLLMS
                 if not hasattr(next(a for a in parser._actions if a.dest == d).type, "bounds")}
    assert not unbounded, f"give these a range in server/option_bounds.py: {sorted(unbounded)}"
    for action in parser._actions:
        if hasattr(action.type, "bounds"):
            flag = action.option_strings[0]
            with pytest.raises(SystemExit):
                parser.parse_args([flag, "-1"])
            assert f"argument {'/'.join(action.option_strings)}: expected" in \
                capsys.readouterr().err
