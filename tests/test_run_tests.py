"""``./run-tests`` names test files and tests by path: a renamed file or test must not turn
a CI stage into an error (or, with a glob, into a stage that silently runs fewer files)."""

from __future__ import annotations

import re
import runpy
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
