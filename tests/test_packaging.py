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
