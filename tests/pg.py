"""A real PostgreSQL 15 server for tests (the Debian package's binaries), no mocks.

One server per test session (initdb + start take ~1-2 s), one fresh database per test
(``pg_url``). PostgreSQL refuses to run as root, so the cluster belongs to the
``postgres`` system user the package created. Durability is switched off: the data is
thrown away with the temp dir.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import linux
from tests.ports import free_port

PG_BIN = Path(os.environ.get("DSEC_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "postgres"
DATABASE = "dsec"


class PostgresServer:
    """initdb into a fresh temp dir, start on 127.0.0.1:<free port>, trust auth."""

    def __init__(self) -> None:
        if not (PG_BIN / "postgres").exists():
            pytest.fail(f"PostgreSQL binaries not found in {PG_BIN}: run scripts/install.sh")
        self.root = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.log = self.root / "postgres.log"
        self.port = 0
        self.pid: int | None = None
        self.startup_seconds = 0.0
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        started = time.perf_counter()
        user = pwd.getpwnam(PG_USER)
        self.socket_dir.mkdir()
        for path in (self.root, self.socket_dir):
            os.chown(path, user.pw_uid, user.pw_gid)
        self._as_postgres(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            PG_USER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        )
        options = " ".join(
            [
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.socket_dir}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
            ]
        )
        for attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            try:
                self._as_postgres(
                    "pg_ctl",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    f"{options} -p {self.port}",
                    "-w",
                    "-t",
                    "30",
                    "start",
                )
                break
            except subprocess.CalledProcessError:
                if attempt == 2:
                    raise RuntimeError(f"postgres did not start: {self._log_tail()}") from None
        self.pid = self._postmaster_pid()
        self.psql(f"CREATE DATABASE {DATABASE}")
        self.startup_seconds = time.perf_counter() - started

    def _as_postgres(self, tool: str, *args: str) -> str:
        proc = subprocess.run(
            ["runuser", "-u", PG_USER, "--", str(PG_BIN / tool), *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(
                proc.returncode, proc.args, proc.stdout, proc.stderr
            )
        return proc.stdout

    def _postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def _log_tail(self) -> str:
        try:
            return self.log.read_text()[-2000:]
        except OSError:
            return "(no log)"

    def url_for(self, database: str) -> str:
        return f"postgresql+asyncpg://{PG_USER}@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        """The ``dsec`` database (asyncpg driver), over TCP as a cluster would use it."""
        return self.url_for(DATABASE)

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run one statement as the superuser (over the unix socket: no password)."""
        proc = subprocess.run(
            [
                str(PG_BIN / "psql"),
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                str(self.socket_dir),
                "-p",
                str(self.port),
                "-U",
                PG_USER,
                "-d",
                database,
                "-c",
                sql,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"psql {sql!r} failed: {proc.stderr.strip()}")
        return proc.stdout.strip()

    def create_database(self) -> str:
        name = "t_" + secrets.token_hex(6)
        self.psql(f"CREATE DATABASE {name}")
        return name

    def drop_database(self, name: str) -> None:
        self.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def alive(self) -> bool:
        """The postmaster runs (a zombie waiting for init to reap it does not count)."""
        if self.pid is None:
            return False
        return linux.pid_alive(self.pid)

    def stop(self) -> None:
        """Fast shutdown, then immediate, then SIGKILL; remove the directory. Idempotent."""
        if self.data.exists() and self.alive():
            for mode in ("fast", "immediate"):
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self._as_postgres("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
                if not self.alive():
                    break
        if self.pid is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)  # pg_ctl makes postmaster a group leader
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)


def our_postgres_pids(root: Path) -> list[int]:
    """Processes of a server rooted at ``root``: every postgres process (postmaster and
    backends alike) runs with its data directory as working directory."""
    pids: list[int] = []
    prefix = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd.startswith(prefix):
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()
        leaked = our_postgres_pids(server.root)
        assert not leaked, f"postgres processes left behind: {leaked}"


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    """A fresh, empty database for one test; dropped afterwards."""
    name = postgres.create_database()
    try:
        yield postgres.url_for(name)
    finally:
        postgres.drop_database(name)
