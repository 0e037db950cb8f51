"""What the fault tests share: platforms started the way an operator would, a second
`dsec up` that must refuse, and polling instead of fixed sleeps."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dsec.edge.identity import derived_edge_id
from tests.conftest import PlatformProcess, clean_leftovers, host_leaks
from tests.ports import free_port


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A fresh (empty) data dir path, removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="dsec-f-", dir="/tmp"))
    try:
        yield base / "d"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def default_platform() -> Iterator[tuple[PlatformProcess, str]]:
    """`dsec up` without an edge id (DSEC_EDGE_ID empty: the default, derived per host
    and data dir); yields it and the id it must have chosen. Stopped, leak-checked and
    removed afterwards, also when the test fails."""
    with scratch_dir() as data_dir:
        data_dir.mkdir()
        edge_id = derived_edge_id(data_dir)
        plat = PlatformProcess(data_dir=data_dir, edge_id="")
        try:
            plat.start()
            yield plat, edge_id
        except BaseException:
            if plat.log_path.exists():
                sys.stderr.write(f"--- platform log ---\n{plat.log_path.read_text()[-6000:]}\n")
            raise
        finally:
            plat.stop()
            leaks = host_leaks(data_dir, edge_id)
            clean_leftovers(data_dir, edge_id)
            assert not leaks, f"platform left these behind: {leaks}"


def second_up(data_dir: Path, edge_id: str | None, timeout: float = 60.0) -> tuple[int, str]:
    """Run another `dsec up` that is expected to refuse; (exit code, its stderr).
    One that starts after all is killed (and the test fails on its exit code)."""
    env = dict(os.environ)
    env.pop("DSEC_EDGE_ID", None)
    if edge_id is not None:
        env["DSEC_EDGE_ID"] = edge_id
    env["XDG_CONFIG_HOME"] = str(data_dir.parent / "xdg-second")
    argv = [sys.executable, "-m", "dsec.cli.main", "up", "--port", str(free_port())]
    argv += ["--data-dir", str(data_dir), "--no-save-config"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
        return 0, f"it started (killed after {timeout}s): {err.decode(errors='replace')}"
    return proc.returncode, err.decode(errors="replace")
