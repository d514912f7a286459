"""``./run-tests`` names test files and tests by path: a renamed file or test must not turn
a CI stage into an error (or, with a glob, into a stage that silently runs fewer files)."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def run_tests():
    return SimpleNamespace(**runpy.run_path(str(ROOT / "run-tests"), run_name="run_tests"))


def test_every_path_a_stage_names_exists(run_tests):
    for stage in run_tests.STAGES:
        assert stage.env in run_tests.ENVIRONMENTS, stage.name
        for command in stage.commands:
            for arg in command:
                if not arg.startswith("tests"):
                    continue
                matches = run_tests.expand([arg])
                assert matches != [arg] or "*" not in arg, f"{stage.name}: {arg} matches nothing"
                for match in matches:
                    path, _, test = match.partition("::")
                    assert (ROOT / path).exists(), f"{stage.name}: {path}"
                    if test:
                        source = (ROOT / path).read_text()
                        assert re.search(rf"def {re.escape(test)}\(", source), f"{stage.name}: {match}"


def test_a_dry_run_prints_every_stage_and_runs_nothing(run_tests, capsys):
    assert run_tests.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for stage in run_tests.STAGES:
        assert (f"=== {stage.name}:" in out) == stage.in_matrix, stage.name
    assert "TRIO_LLM_HTTP_FALLBACK=1 python -m pytest -q -n 2 --dist loadgroup tests/test_http_" in out
    with pytest.raises(SystemExit):
        run_tests.main(["no-such-stage"])


@pytest.fixture
def no_postgresql(run_tests, monkeypatch):
    """As on a fresh machine: no PostgreSQL binaries (issue 44: the state store's tests)."""
    monkeypatch.setitem(run_tests.SYSTEM_PACKAGES, "postgresql", lambda: False)
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")


def test_postgresql_is_installed_with_apt_before_the_main_stage(run_tests, no_postgresql,
                                                                monkeypatch, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert run_tests.main(["--dry-run", "lint", "main"]) == 0
    out = capsys.readouterr().out
    install = out.index("$ DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql")
    assert out.index("=== lint:") < install < out.index("=== main:")
    assert "(postgresql)" in out.split("=== summary")[1]  # its time, as an environment's


def test_without_root_the_stage_runs_and_its_tests_skip(run_tests, no_postgresql,
                                                        monkeypatch, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert run_tests.main(["--dry-run", "main"]) == 0
    out = capsys.readouterr().out
    assert "postgresql is not installed, and installing it needs root" in out
    assert "apt-get install" not in out and "=== main:" in out
    code = run_tests.main(["--dry-run", "--no-install", "main"])
    assert "apt-get" not in capsys.readouterr().out
    # (--no-install builds nothing: without .venv, as in a clone that ran only the quick
    # stage, the main stage cannot run)
    assert code == (0 if (ROOT / ".venv").is_dir() else 1)


def test_a_failed_install_is_missing_not_a_failure(run_tests, no_postgresql, monkeypatch,
                                                   capsys):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    run = run_tests.Run([], run_tests.parse(["--dry-run"]))
    monkeypatch.setattr(run, "execute", lambda commands, env, extra: False)
    run.install_system(["postgresql"])
    run.install_system(["postgresql"])  # tried once a run
    assert [result[:2] for result in run.results] == [("(postgresql)", run_tests.MISSING)]
    assert run.run()


def test_a_stage_keeps_the_bytecode_it_compiles(run_tests, monkeypatch):
    """pip installs without compiling, so a stage's processes must write what they compile,
    or each compiles torch, transformers and vLLM anew (15 against 6.5 s an import of vLLM)."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    proc = subprocess.run([sys.executable, "-c", "import sys; print(sys.dont_write_bytecode)"],
                          env=run_tests.environ_of(".venv", {}), capture_output=True, text=True,
                          check=True)
    assert proc.stdout.strip() == "False"
