"""Every bench script's smoke run (``python bench/X.py --smoke``, bench/loadgen_lib/smoke.py):
so that a bench that no longer runs fails CI, not the next measurement (issue 42 item 7:
bench/stream_overhead.py had stopped running when the transport began reading its fake
process's ``returncode``, and nothing noticed).

The scripts are found here (every ``bench/*.py``): a new one without ``--smoke`` fails. Each
runs as a subprocess from the repository root and must exit 0, print something on stdout
(its figures, which mean nothing here) and say on stderr that it ran as a smoke run. Scripts
that need an extra (torch, transformers, ...) are skipped where it is not installed, as the
suite's other tests are. The subprocess's ``timeout`` is a hang guard only.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Scripts whose smoke run a test of their own runs and checks more closely.
OWN_SMOKE_TEST = {"join_balance.py": "tests/test_join_balance_bench.py",
                  "against.py": "tests/test_against_bench.py"}
SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py")
                 if path.name not in OWN_SMOKE_TEST)

#: Modules a script's smoke run needs beyond the base and test dependencies (the
#: transformers extra: the tiny model of tests/tiny_model.py is built with them).
_TRANSFORMERS = ("torch", "transformers", "tokenizers")
NEEDS = {
    "gpu_transformers.py": _TRANSFORMERS,
    "gpu_vllm.py": _TRANSFORMERS,
    "grammar_cost.py": (*_TRANSFORMERS, "xgrammar"),
    "hf_step.py": _TRANSFORMERS,
    "image_cost.py": (*_TRANSFORMERS, "vllm", "PIL"),
    "long_steps.py": _TRANSFORMERS,
    "schema_corpus.py": _TRANSFORMERS,
    "schema_validity.py": (*_TRANSFORMERS, "xgrammar", "jsonschema"),
    "step_contention.py": (*_TRANSFORMERS, "xgrammar"),
    "transformers_bench.py": _TRANSFORMERS,
    "vllm_frontend.py": _TRANSFORMERS,
    "vllm_threads.py": (*_TRANSFORMERS, "vllm"),
}

HANG_GUARD = 900  # seconds (a smoke run takes seconds to a minute on 2 busy cores)


def test_every_script_is_found():
    assert len(SCRIPTS) >= 30 and "stream_overhead.py" in SCRIPTS, SCRIPTS
    for script, test in OWN_SMOKE_TEST.items():
        assert "--smoke" in (ROOT / test).read_text(), (script, test)


@pytest.mark.parametrize("script", SCRIPTS)  # (under -n, spread: tests/conftest.py's SPREAD)
def test_smoke_run(script):
    missing = [m for m in NEEDS.get(script, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD,
                          stdin=subprocess.DEVNULL)
    output = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    assert proc.stdout.strip(), output
    assert "smoke run" in proc.stderr, output
