"""A test process's children, from /proc: what the invariants after a test count.

Apart from tests/conftest.py (which re-exports them) because that imports the app, and a
process that builds a vLLM engine must not have Quart loaded first (tests/vllm_reference.py).
"""

from __future__ import annotations

import os


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this test process, from /proc."""
    return children_of(os.getpid())


def children_of(pid: int) -> set[int]:
    """Live (non-zombie) child processes of ``pid``, from /proc."""
    me = pid
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry))
    return found


def pid_exists(pid: int) -> bool:
    """True while ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
