"""A throwaway PostgreSQL server for tests: :func:`start_postgres` runs ``initdb`` into a new
temporary directory and ``pg_ctl start`` on a unix socket there (no TCP port), and gives back
a :class:`PostgresServer` whose :meth:`~PostgresServer.stop` stops it and removes the
directory. Debian's ``postgresql`` package has the binaries under
``/usr/lib/postgresql/*/bin``; :func:`find_binaries` says where, or None.

PostgreSQL refuses to run as root: under root the server runs as the ``postgres`` user (the
package makes it) or ``nobody``, owning the directory.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

__all__ = ["STORES", "PostgresServer", "find_binaries", "start_postgres", "state_database",
           "state_options"]

#: The two backends a test of the state store's users runs on (:func:`state_options`).
STORES = ["sqlite", "postgres"]


def find_binaries() -> str | None:
    """The directory with ``initdb`` and ``pg_ctl``, or None when PostgreSQL is absent."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb and shutil.which("pg_ctl") else None


#: Numbers the databases tests create (PostgresServer.new_database).
_databases = itertools.count()


@dataclass
class PostgresServer:
    directory: str
    bin_dir: str
    user: str  # the database superuser (the OS user the server runs as)
    _prefix: list[str]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@/{database}?host={self.directory}"

    def new_database(self, prefix: str = "t") -> str:
        """A new, empty database's URL (a test's own: its name unique in this run)."""
        import psycopg

        name = f"{prefix}{os.getpid()}_{next(_databases)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def restart(self) -> None:
        """Restart the server (every connection to it is cut)."""
        subprocess.run([*self._prefix, os.path.join(self.bin_dir, "pg_ctl"), "restart", "-w",
                        "-m", "immediate", "-D", os.path.join(self.directory, "data"),
                        "-l", os.path.join(self.directory, "log")],  # (not our pipes)
                       check=True, capture_output=True, timeout=300)

    def stop(self) -> None:
        subprocess.run([*self._prefix, os.path.join(self.bin_dir, "pg_ctl"), "stop", "-m",
                        "immediate", "-D", os.path.join(self.directory, "data")],
                       check=False, capture_output=True, timeout=120)
        shutil.rmtree(self.directory, ignore_errors=True)


def start_postgres(bin_dir: str) -> PostgresServer:
    """Start a new server (blocking: seconds). Raises ``subprocess.CalledProcessError``."""
    directory = tempfile.mkdtemp(prefix="pgtest-trio-llm-")
    prefix: list[str] = []
    user = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:
        user = "postgres"
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            entry = pwd.getpwnam("nobody")
            user = entry.pw_name
        os.chown(directory, entry.pw_uid, entry.pw_gid)
        prefix = ["runuser", "-u", user, "--"]
    data = os.path.join(directory, "data")
    try:
        subprocess.run([*prefix, os.path.join(bin_dir, "initdb"), "-D", data, "-U", user,
                        "--auth=trust", "--no-sync", "-E", "UTF8"],
                       check=True, capture_output=True, timeout=300)
        subprocess.run([*prefix, os.path.join(bin_dir, "pg_ctl"), "start", "-w", "-t", "120",
                        "-D", data, "-l", os.path.join(directory, "log"), "-o",
                        f"-k {directory} -c listen_addresses='' -c fsync=off"],
                       check=True, capture_output=True, timeout=300)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return PostgresServer(directory, bin_dir, user, prefix)


def state_options(request, tmp_path, prefix: str) -> dict:
    """The server options of a test parametrized over :data:`STORES`: SQLite in a
    directory of the test's own, or a new PostgreSQL database named from ``prefix`` (the
    ``postgres_server`` fixture's; skipped, saying why, where PostgreSQL is absent)."""
    if request.param == "sqlite":
        return {"state_dir": str(tmp_path / "state")}
    return {"state_url": request.getfixturevalue("postgres_server").new_database(prefix)}


def state_database(directory: str | None = None, url: str | None = None):
    """The state store's database in ``directory`` (SQLite) or at ``url`` (PostgreSQL),
    opened as its backend opens it: for a test that writes what an older server left.
    Blocking; close it after."""
    if directory is not None:
        from server.state.sqlite import SQLiteDatabase
        return SQLiteDatabase(directory)
    from server.state.postgres import PostgresDatabase
    return PostgresDatabase(url)  # type: ignore[arg-type]
