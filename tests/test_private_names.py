"""No module of ``server/`` uses another module's private names (issue 43).

A name with a leading underscore is its module's own: what other modules need is public
(in ``__all__``, with a docstring), so that a change inside one module cannot break another
unseen. Two shapes are checked, with the AST (no import): ``from x import _name`` where
``x`` is another module of ``server``, and ``module._name`` where ``module`` is a name
bound to another module of ``server`` (``from . import generate`` then
``generate._started``). Third-party private names are not this test's business: they live
in the ``private_api`` modules, each with its version table.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "server"

#: (module, the other module's private name it uses) -> why it may. Keep it short.
ALLOWED: dict[tuple[str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, of every module under ``root`` (a package)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _absolute(module: str, path: Path, level: int, name: str | None) -> str:
    """The dotted name a (relative) ``from`` import in ``module`` refers to."""
    if level == 0:
        return name or ""
    package = module.split(".")
    if path.name != "__init__.py":
        package = package[:-1]  # a module's relative imports start at its package
    package = package[: len(package) - (level - 1)]
    return ".".join(package + ([name] if name else []))


def violations(root: Path) -> list[str]:
    """Where a module under ``root`` uses another module's private names (module
    docstring): ``path:line: what``."""
    modules = _modules(root)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        bound: dict[str, str] = {}  # a local name -> the module of ours it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node.level, node.module)
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in modules:  # a submodule: `from . import generate`
                        bound[alias.asname or alias.name] = target
                    elif (source in modules and source != module and _private(alias.name)
                          and (module, f"{source}.{alias.name}") not in ALLOWED):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                                     f"from {source} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname is not None and alias.name in modules:
                        bound[alias.asname] = alias.name
                    elif alias.name.split(".")[0] in {m.split(".")[0] for m in modules}:
                        head = alias.name.split(".")[0]
                        bound[head] = head
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            owner = _dotted(node.value, bound, modules)
            if owner is not None and owner != module and (
                    (module, f"{owner}.{node.attr}") not in ALLOWED):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                             f"{owner}.{node.attr}")
    return found


def _dotted(node: ast.expr, bound: dict[str, str], modules: dict) -> str | None:
    """The module of ours that ``node`` (a name, or names joined by dots) is, or None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value, bound, modules)
        if owner is not None and f"{owner}.{node.attr}" in modules:
            return f"{owner}.{node.attr}"
    return None


def test_no_module_of_the_server_uses_another_modules_private_names():
    assert violations(SERVER) == []


@pytest.mark.parametrize("source, expected", [
    ("from .b import _x\n", ["pkg/a.py:1: from pkg.b import _x"]),
    ("from pkg.b import _x as y\n", ["pkg/a.py:1: from pkg.b import _x"]),
    ("from . import b\nb._x()\n", ["pkg/a.py:2: pkg.b._x"]),
    ("import pkg.b\npkg.b._x\n", ["pkg/a.py:2: pkg.b._x"]),
    ("import pkg.b as c\nc._x\n", ["pkg/a.py:2: pkg.b._x"]),
    ("from .b import x, __version__\nfrom . import b\nb.x, b.__doc__\n", []),
    ("def _mine(): ...\nfrom . import a\na._mine\n", []),  # its own
    ("from os import _exit\nimport sys\nsys._getframe\n", []),  # not ours
])
def test_the_check_finds_each_shape(tmp_path, source, expected):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "b.py").write_text("_x = 1\nx = 2\n")
    (package / "a.py").write_text(source)
    assert violations(package) == expected
