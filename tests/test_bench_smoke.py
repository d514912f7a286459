"""Every bench script's smoke run (``python bench/X.py --smoke``, bench/loadgen_lib/smoke.py):
so that a bench that no longer runs fails CI, not the next measurement (issue 42 item 7:
bench/stream_overhead.py had stopped running when the transport began reading its fake
process's ``returncode``, and nothing noticed).

The scripts are found here (every ``bench/*.py``): a new one without ``--smoke`` fails. Each
runs from the repository root and must exit 0, print something on stdout (its figures,
which mean nothing here) and say on stderr that it ran as a smoke run. Scripts that need an
extra (torch, transformers, ...) are skipped where it is not installed, as the suite's other
tests are. ``HANG_GUARD`` is a hang guard only.

Each script runs in a forked child of one process per xdist worker that imported
:data:`PRELOAD` once (tests/smoke_forker.py), as ``python SCRIPT --smoke`` would run it.
Twelve scripts import torch and transformers; each import cost about 3.5 s of CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.smoke_forker import Forker

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

#: What the forking parent imports once, for the scripts' children: the heavy modules of
#: :data:`NEEDS` and what the scripts import of ours (vllm is left out: one script imports
#: it, and two parents would each pay its 4 s).
PRELOAD = ["numpy", "torch", "transformers", "tokenizers", "xgrammar", "llguidance",
           "transformers.models.llama.modeling_llama", "server.engines.transformers.engine",
           "trio", "httpx", "bench.loadgen_lib.smoke"]


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    """One forking parent for this module's tests on this xdist worker (they run one after
    another: each is its own unit, handed out in order)."""
    forker = Forker(PRELOAD, tmp_path_factory.mktemp("forker") / "log")
    yield forker
    forker.close()


def test_every_script_is_found():
    assert len(SCRIPTS) >= 30 and "stream_overhead.py" in SCRIPTS, SCRIPTS
    for script, test in OWN_SMOKE_TEST.items():
        assert "--smoke" in (ROOT / test).read_text(), (script, test)


@pytest.mark.parametrize("script", SCRIPTS)  # (under -n, spread: tests/conftest.py's SPREAD)
def test_smoke_run(script, forker, tmp_path):
    missing = [m for m in NEEDS.get(script, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    run = forker.run(ROOT / "bench" / script, ["--smoke"], cwd=ROOT, out_dir=tmp_path,
                     timeout=HANG_GUARD)
    output = f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    assert not run.timed_out, f"still running after {HANG_GUARD} s\n{output}"
    assert run.returncode == 0, output
    assert run.stdout.strip(), output
    assert "smoke run" in run.stderr, output
