"""Server processes bind their port first (dsec.net.ports.listen).

A port already taken stops `dsec up` at once with a message that says why, before it
has done any work (no databases, no recovery, nothing to undo); ``--port 0`` serves on
a port the kernel chooses and announces that one.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.errors import CannotListen
from dsec.net.ports import bound_port, listen
from tests.conftest import clean_leftovers, host_leaks, stop_process


def test_listen_binds_and_port_zero_gets_a_real_port() -> None:
    with listen("127.0.0.1", 0) as sock:
        port = bound_port(sock)
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # it listens already: a client waits in the backlog, is not refused


def test_listen_says_why_it_cannot() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(CannotListen, match=rf"127\.0\.0\.1:{port}: another process listens"):
            listen("127.0.0.1", port)
    with pytest.raises(CannotListen, match="no interface of this host has that address"):
        listen("192.0.2.1", 0)  # TEST-NET-1: never an address of this host
    with pytest.raises(CannotListen, match="unknown host"):
        listen("no-such-host.invalid", 0)


def test_a_restart_binds_while_old_connections_linger() -> None:
    """SO_REUSEADDR: a server restarted on its port is not refused because connections
    of the last run are still in TIME_WAIT."""
    with listen("127.0.0.1", 0) as sock:
        port = bound_port(sock)
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = sock.accept()
        conn.close()  # the server closes first: its side goes to TIME_WAIT
        client.close()
    with listen("127.0.0.1", port) as again:
        assert bound_port(again) == port


@contextlib.contextmanager
def scratch() -> Iterator[tuple[Path, str]]:
    """A data dir and an edge id, leak-checked and removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="dsec-t-", dir="/tmp"))
    edge_id = "t" + secrets.token_hex(4)
    try:
        yield base / "d", edge_id
    finally:
        leaks = host_leaks(base / "d", edge_id)
        clean_leftovers(base / "d", edge_id)
        shutil.rmtree(base, ignore_errors=True)
        assert not leaks, f"left behind: {leaks}"


def up(data_dir: Path, edge_id: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DSEC_EDGE_ID": edge_id, "DSEC_STOP_SANDBOXES_ON_EXIT": "1"}
    env["XDG_CONFIG_HOME"] = str(data_dir.parent / "xdg")
    key = "dsk_test_" + secrets.token_hex(8)
    argv = ["up", "--port", str(port), "--data-dir", str(data_dir), "--api-key", key]
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dsec.cli.main", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def test_dsec_up_on_a_taken_port_fails_at_once_having_done_nothing() -> None:
    with scratch() as (data_dir, edge_id), socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        log = data_dir.parent / "up.log"
        proc = up(data_dir, edge_id, port, log)
        try:
            assert proc.wait(60) == 1
        finally:
            stop_process(proc)
        text = log.read_text()
        assert f"error: cannot_listen: cannot listen on 127.0.0.1:{port}" in text
        assert "another process listens there" in text
        assert "Traceback" not in text and "Errno" not in text
        # Nothing was started: no databases, no data dir even.
        assert not data_dir.exists() or not any(data_dir.glob("*.db"))


def test_dsec_up_on_port_zero_announces_the_port_it_serves_on() -> None:
    with scratch() as (data_dir, edge_id):
        log = data_dir.parent / "up.log"
        proc = up(data_dir, edge_id, 0, log)
        try:
            deadline = time.monotonic() + 90
            url = None
            while url is None and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()[-3000:]
                found = re.search(r"URL\s+(http://127\.0\.0\.1:(\d+))", log.read_text())
                url = found.group(1) if found is not None and int(found.group(2)) else None
                time.sleep(0.1)
            assert url is not None, log.read_text()[-3000:]
            assert httpx.get(f"{url}/v1/health", timeout=5).status_code == 200
            saved = (data_dir.parent / "xdg" / "dsec" / "config.json").read_text()
            assert url in saved  # the SDK and CLI find the port that was chosen
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            stop_process(proc)


def test_the_layer_store_on_a_taken_port_fails_at_once_and_port_zero_serves(
    tmp_path: Path,
) -> None:
    """`dsec store serve`, the other server command: the same first bind."""
    root = tmp_path / "store"

    def store_serve(port: int) -> list[str]:
        argv = ["store", "serve", "--root", str(root), "--port", str(port), "--token", "dst_t"]
        return [sys.executable, "-m", "dsec.cli.main", *argv]

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            store_serve(port),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"error: cannot_listen: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not root.exists()  # the store was not opened
    proc = subprocess.Popen(
        store_serve(0),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"layer store (http://127\.0\.0\.1:(\d+)) serving", line)
        assert found is not None and int(found.group(2)) > 0, line
        reply = httpx.get(f"{found.group(1)}/v1/refs/none", timeout=5)
        assert reply.status_code in (401, 404)  # answered: it serves on the announced port
    finally:
        stop_process(proc)


def test_the_apiserver_on_a_taken_port_fails_before_it_reaches_its_database() -> None:
    """`dsec apiserver` binds before anything else: with its port taken it says so,
    not that its (here unreachable) database is down, and it does not wait for it."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        argv = ["apiserver", "--db", "postgresql://nobody@127.0.0.1:9/none"]
        argv += ["--cluster-token", "t" * 32, "--admin-key", "dsk_k", "--port", str(port)]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "dsec.cli.main", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1, done.stderr
    assert f"error: cannot_listen: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "database" not in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 30
