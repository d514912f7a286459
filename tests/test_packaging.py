"""What an install gives a user: the examples' imports and the type information.

The README's Python examples and docs/examples/ import third-party packages; each must come
with the install or with the ``examples`` extra (issue 43: the README's example needed
openai, and serve_beside_your_app.py httpx, and neither came with the install). The package
ships ``py.typed``, so that a mypy user of the library gets its types.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imported(source: str) -> set[str]:
    """The top-level module names a piece of Python source imports."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def _examples() -> dict[str, str]:
    """The example code a user copies: docs/examples/*.py and the README's python blocks."""
    code = {str(path.relative_to(ROOT)): path.read_text() for path in (ROOT / "docs/examples").glob("*.py")}
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    code.update({f"README.md block {i}": block for i, block in enumerate(blocks)})
    return code


def test_the_examples_imports_come_with_the_examples_extra():
    requirements = pytest.importorskip("packaging.requirements")
    from packaging.utils import canonicalize_name

    declared = {
        canonicalize_name(requirements.Requirement(r).name)
        for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["examples"]
    }
    local = {path.stem for path in (ROOT / "docs/examples").glob("*.py")} | {"server"}
    distributions = metadata.packages_distributions()
    missing = {}
    for where, source in _examples().items():
        for module in _imported(source) - local - set(sys.stdlib_module_names):
            names = {canonicalize_name(d) for d in distributions.get(module, [module])}
            if not names & declared:
                missing[where] = sorted(missing.get(where, []) + [module])
    assert not missing, f"imports the examples extra does not install: {missing}"


def test_the_package_ships_its_type_information():
    assert (ROOT / "server" / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["server"]


def test_importing_the_library_imports_no_testing_module():
    """An application embedding the server gets no test tooling in its process: the
    heartbeat asks whether the clock is a MockClock only when trio.testing was imported
    by someone else (server.manager.worker)."""
    import subprocess

    code = ("import sys, server, server.manager.worker, server.http.app; "
            "print(sorted(m for m in sys.modules if m.startswith(('trio.testing', 'pytest'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "[]", out


#: What the server imports when it starts on the sim engine (trio-llm-server with no
#: engine extra): the CLI, the app, the worker loop and the sim engine.
_START_MODULES = ("server.cli", "server.http.app", "server.workers.main",
                  "server.engines.sim.engine", "server.supervisor")

_BLOCK_UNDECLARED = """
import importlib.abc, sys
allowed = set(sys.argv[1].split(","))
modules = sys.argv[2].split(",")

class Undeclared(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        raise ModuleNotFoundError(f"{top} (not a dependency of the base install)")

sys.meta_path.insert(0, Undeclared())
for module in modules:
    __import__(module)
print("imported")
"""


def _base_distributions() -> set[str]:
    """The distributions ``pip install .`` brings: the base dependencies and theirs."""
    requirements = pytest.importorskip("packaging.requirements")
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [requirements.Requirement(r) for r in PROJECT["dependencies"]]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(requirements.Requirement(r) for r in metadata.requires(req.name) or ())
        except metadata.PackageNotFoundError:
            pass  # (a dependency for another Python version)
    return seen


def test_the_server_starts_on_the_base_install_alone():
    """The README's first command installs the base dependencies only: every module the
    server imports to start on the sim engine must come with them (dnslib came only with
    the test extra, and `trio-llm-server` failed at start on a fresh install). Run with
    every other installed package made unimportable."""
    import subprocess

    from packaging.utils import canonicalize_name

    base = _base_distributions()
    allowed = {"server"} | {
        module for module, dists in metadata.packages_distributions().items()
        if any(canonicalize_name(d) in base for d in dists)}
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK_UNDECLARED, ",".join(sorted(allowed)),
         ",".join(_START_MODULES)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == "imported", proc.stderr[-3000:]
