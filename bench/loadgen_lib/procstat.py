"""Processes and their CPU time, from ``/proc`` (Linux): ``utime + stime`` of a process, its
descendants, the processes listening on a TCP port, and :class:`CpuMeter`, which measures the
server's frontend and workers over a run."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_stat(pid: int):
    """(ppid, utime+stime ticks, comm) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rp = data.rfind(b")")
    comm = data[data.find(b"(") + 1 : rp].decode("utf-8", "replace")
    rest = data[rp + 2 :].split()
    # rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15
    return int(rest[1]), int(rest[11]) + int(rest[12]), comm


def _all_pids() -> list[int]:
    try:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []


def descendants(root: int) -> list[int]:
    """All descendants of ``root`` (via the ppid field of /proc/*/stat), sorted."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = read_stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return sorted(out)


def pids_listening_on(port: int) -> list[int]:
    """Processes holding a TCP socket that listens on ``port`` (/proc/net/tcp{,6} + fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A = LISTEN
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return []
    found = []
    for pid in _all_pids():
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in inodes:
                    found.append(pid)
                    break
            except OSError:
                continue
    return sorted(found)


def server_pid_from_port(port: int) -> int | None:
    """The topmost process listening on ``port`` (one whose parent does not listen too)."""
    pids = pids_listening_on(port)
    if not pids:
        return None
    pidset = set(pids)
    for pid in pids:
        st = read_stat(pid)
        if st is None or st[0] not in pidset:
            return pid
    return pids[0]


def is_group_frontend(pid: int) -> bool:
    """Whether ``pid`` is one of the frontends of a ``--api-servers`` supervisor."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"\0--frontend-index\0" in f.read()
    except OSError:
        return False


class CpuMeter:
    """Reads the CPU time of the frontend and of its workers, before and after a run.

    Workers are the given pids, or (``auto_workers``) all descendants of the frontend at each
    snapshot, less those ``is_frontend`` says are frontends too (by default those of a
    ``--api-servers`` supervisor; bench/against.py's choice for another server), counted as
    frontend; a worker that appeared during the run is counted from zero, one that vanished
    is reported as lost (its CPU after the first snapshot is unknown).
    """

    def __init__(self, frontend: int | None, workers: list[int] | None, auto_workers: bool,
                 is_frontend: Callable[[int], bool] = is_group_frontend):
        self.frontend = frontend
        self.workers = list(workers or [])
        self.auto = auto_workers
        self.is_frontend = is_frontend
        self.before: dict | None = None

    def _snapshot(self) -> dict:
        pids = {}
        if self.frontend is not None:
            st = read_stat(self.frontend)
            if st is not None:
                pids["frontend"] = (self.frontend, st[1], st[2])
        workers = descendants(self.frontend) if self.auto and self.frontend else self.workers
        w, group = {}, {}
        for pid in workers:
            st = read_stat(pid)
            if st is None:
                continue
            if self.auto and self.is_frontend(pid):  # (--api-servers: a frontend, not a worker)
                group[pid] = st[1]
            else:
                w[pid] = (st[1], st[2])
        return {"frontend": pids.get("frontend"), "workers": w, "group": group,
                "t": time.perf_counter()}

    def start(self) -> None:
        self.before = self._snapshot()

    def stop(self) -> dict:
        """CPU seconds used since :meth:`start`: frontend, workers (per pid), total."""
        after = self._snapshot()
        before = self.before or {"frontend": None, "workers": {}}
        res: dict = {"frontend_pid": self.frontend, "frontend_cpu_s": None, "workers": []}
        if after["frontend"] and before["frontend"]:
            ticks = after["frontend"][1] - before["frontend"][1]
            # With --api-servers the pid is the supervisor's: its frontends count as frontend
            # (one that appeared during the run counts from zero).
            before_group = before.get("group", {})
            ticks += sum(t - before_group.get(pid, 0) for pid, t in after["group"].items())
            res["frontend_cpu_s"] = ticks / CLK_TCK
            res["frontend_processes"] = 1 + len(after["group"])
        total = 0.0
        for pid, (ticks, comm) in sorted(after["workers"].items()):
            b = before["workers"].get(pid, (0, comm))[0]
            cpu = (ticks - b) / CLK_TCK
            total += cpu
            res["workers"].append({"pid": pid, "comm": comm, "cpu_s": round(cpu, 3),
                                   "new": pid not in before["workers"]})
        res["lost_workers"] = sorted(set(before["workers"]) - set(after["workers"]))
        res["workers_cpu_s"] = total if (after["workers"] or before["workers"]) else None
        return res
