"""docs/architecture.md's module table names every module under server/, and nothing else.

A newcomer reads the table to find where a job is done; a module missing from it is
invisible, and a row for a module that was moved or removed sends them to nothing. So the
table is checked against the tree: every ``server/**/*.py`` file has a row (a package by
its folder, ``server/x/``, for its ``__init__.py``), and every path a row names exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def modules_in_tree(root: Path = ROOT) -> set[str]:
    """Every module under server/, as the table names it: ``server/x/y.py`` for a file,
    ``server/x/`` for a package (its ``__init__.py``)."""
    names = set()
    for path in (root / "server").rglob("*.py"):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts:
            continue
        if path.name == "__init__.py":
            names.add(rel.parent.as_posix() + "/")
        else:
            names.add(rel.as_posix())
    return names


def modules_in_table(text: str) -> dict[str, int]:
    """The paths the rows of the "## Modules" section name, each with its line number: the
    backticked ``server/...`` paths of a row's first cell (one or several, comma-separated)."""
    section = re.search(r"^## Modules\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "docs/architecture.md has no '## Modules' section"
    first_line = text[:section.start(1)].count("\n") + 1
    named: dict[str, int] = {}
    for offset, line in enumerate(section.group(1).split("\n")):
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3:
            continue
        for path in re.findall(r"`(server/[^`]*)`", cells[1]):
            named[path] = first_line + offset
    return named


def _row(path: str) -> str:
    return f"| `{path}` | <its job, in one line> |"


def check(text: str, tree: set[str]) -> list[str]:
    """What is wrong with the table, one line each: which row to add, which to remove."""
    named = modules_in_table(text)
    problems = [
        f"docs/architecture.md's module table has no row for {path}; add this row to its "
        f"'## Modules' section: {_row(path)}"
        for path in sorted(tree - named.keys())
    ]
    problems += [
        f"docs/architecture.md:{named[path]} names {path}, which is not a module under "
        f"server/: rename the row to the module's new path, or remove it"
        for path in sorted(named.keys() - tree)
    ]
    return problems


def test_every_module_has_a_row_and_every_row_a_module():
    problems = check(DOC.read_text(encoding="utf-8"), modules_in_tree())
    assert not problems, "\n".join(problems)


def test_check_names_the_row_to_add_and_the_row_to_remove():
    text = (
        "# A\n\n## Modules\n\n| module | job |\n|---|---|\n"
        "| `server/a.py`, `server/gone.py` | jobs |\n| `server/pkg/` | a package |\n\n"
        "## Next\n\n| `server/b.py` | outside the section: not a row of the table |\n"
    )
    tree = {"server/a.py", "server/b.py", "server/pkg/"}
    assert check(text, tree) == [
        "docs/architecture.md's module table has no row for server/b.py; add this row to "
        "its '## Modules' section: | `server/b.py` | <its job, in one line> |",
        "docs/architecture.md:7 names server/gone.py, which is not a module under server/: "
        "rename the row to the module's new path, or remove it",
    ]


def test_the_tree_walk_names_packages_by_their_folder(tmp_path):
    for name in ("server/__init__.py", "server/x/__init__.py", "server/x/y.py",
                 "server/x/__pycache__/y.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert modules_in_tree(tmp_path) == {"server/", "server/x/", "server/x/y.py"}
