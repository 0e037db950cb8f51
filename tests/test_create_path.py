"""The cheap create/teardown path (bench/results/lazy.md): each shortcut still does
what the slow path did. Real cgroups, a real tmpfs, the real crun binary."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from dsec import linux
from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxState
from dsec.api.spec import DSecContainerRunArgs
from dsec.backends.base import SandboxRecord
from dsec.backends.container.backend import drop_page_charges, v1_pages_charged
from dsec.backends.container.facts import ContainerFacts
from dsec.backends.container.runtime import OCIRuntime
from dsec.edge.state import EdgeStateDB
from dsec.resources import cgroups


@pytest.fixture
def tmp_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-cp-", dir="/tmp"))
    try:
        yield path
    finally:
        for m in reversed(linux.mounts(path)):
            with contextlib.suppress(OSError):
                linux.umount(m.mount_point, detach=True)
        shutil.rmtree(path, ignore_errors=True)


def _resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(out.strip())


def test_drop_page_charges_reclaims_pages_of_an_emptied_cgroup(tmp_dir: Path) -> None:
    host = cgroups.detect()
    if "memory" not in host.v1:
        pytest.skip("v1 memory controller only (v2 uses memory.reclaim as before)")
    rel = f"/dsec-test-cp-{secrets.token_hex(4)}"
    d = host.v1["memory"] / rel.strip("/")
    data = tmp_dir / "data"
    d.mkdir()
    try:
        # Pages a sandbox wrote (synced: clean, reclaimable) stay charged to its cgroup.
        subprocess.run(
            [
                "sh",
                "-c",
                f'echo $$ > {d}/cgroup.procs && exec dd if=/dev/zero of="$1" bs=1M count=4 '
                "conv=fsync status=none",
                "sh",
                str(data),
            ],
            check=True,
        )
        assert v1_pages_charged(d) >= 4 << 20, "the writer's page cache was not charged here"
        assert _resident_bytes(data) == 4 << 20
        drop_page_charges(host, rel)
        # Every page of what it wrote is gone. What may stay charged are a few pages of
        # shared files (the shell's libraries) the writer faulted back in: other
        # processes on the host keep them referenced, so reclaim rightly keeps them.
        # Measured: 2 pages in 99 runs of 100, 8 in one; 1024+ when nothing is done.
        assert _resident_bytes(data) == 0
        assert v1_pages_charged(d) <= 16 * 4096, v1_pages_charged(d)
        drop_page_charges(host, rel)  # nothing to do: a no-op, not an error
    finally:
        host.kill_and_remove(rel, timeout=5)
    assert not d.exists()


def _record(sid: str) -> SandboxRecord:
    now = datetime.now(UTC)
    return SandboxRecord(
        id=sid,
        spec=DSecContainerRunArgs(container_image="busybox:latest"),
        image=ImageInfo(
            name="busybox",
            tag="latest",
            digest="sha256:" + "0" * 64,
            layers=["sha256:" + "1" * 64],
            size_bytes=1,
            created_at=now,
        ),
        state=SandboxState.CREATING,
        created_at=now,
        updated_at=now,
        edge="e1",
    )


def test_state_only_write_keeps_the_spec_and_writes_unsaved_records_whole(
    tmp_dir: Path,
) -> None:
    db = EdgeStateDB(tmp_dir / "edge.db")
    try:
        rec = _record("e1-" + "a" * 16)
        db.save(rec)
        rec.state, rec.reason = SandboxState.STOPPED, "stopped by request"
        rec.facts = ContainerFacts(dir=Path("/x"), pid=7)
        db.save_state(rec)
        fresh = _record("e1-" + "b" * 16)
        fresh.state = SandboxState.RUNNING
        db.save_state(fresh)  # never saved before: written whole
        loaded = {r.id: r for r in db.load("e1")}
        assert loaded[rec.id].state is SandboxState.STOPPED
        assert loaded[rec.id].reason == "stopped by request"
        assert ContainerFacts.of(loaded[rec.id].facts) == ContainerFacts(dir=Path("/x"), pid=7)
        assert loaded[rec.id].spec == rec.spec and loaded[rec.id].image == rec.image
        assert loaded[fresh.id].state is SandboxState.RUNNING
        assert loaded[fresh.id].spec == fresh.spec
    finally:
        db.close()


def _crun() -> str:
    crun = shutil.which("crun")
    assert crun is not None, "crun is installed by scripts/install.sh"
    return crun


def _runtime(tmp_dir: Path, runtime: str) -> OCIRuntime:
    """An OCIRuntime of its own under ``tmp_dir`` (the wrapper is never started here)."""
    run = tmp_dir / "run"
    return OCIRuntime(
        runtime=runtime,
        state_root=run / "crun",
        wrapper=Path("/bin/true"),
        cgroups=cgroups.detect(),
        empty_file=run / "empty",
    )


def _lists(rt: OCIRuntime) -> bool:
    """What the wrapper would execute runs, as crun, on the runtime's state root."""
    out = subprocess.run(
        [rt.exec_path, "--root", str(rt.state_root), "list"],
        capture_output=True,
        text=True,
        check=True,
    )
    return "NAME" in out.stdout


def test_runtime_state_on_tmpfs_and_sealed_crun(tmp_dir: Path) -> None:
    rt = _runtime(tmp_dir, _crun())
    rt.open()
    try:
        assert linux.is_mounted(rt.state_root)
        assert rt.exec_path != rt.path and Path(rt.exec_path).name == "crun"
        # The sealed copy is crun, and runs as crun (the orphan reaper goes by name).
        assert _lists(rt)
        # A dead container's state goes without a crun call; ids cannot escape the root.
        (rt.state_root / "c1").mkdir()
        (rt.state_root / "c1" / "status").write_text("{}")
        assert rt.list_ids() == {"c1"}
        assert rt.forget("c1") and rt.list_ids() == set()
        assert not rt.forget("../crun") and rt.state_root.is_dir()
        # Kept while a container is left (the next edge process needs it) ...
        (rt.state_root / "c2").mkdir()
        rt.close()
        assert linux.is_mounted(rt.state_root)
        rt.open()
        assert rt.forget("c2")
    finally:
        rt.close()
    # ... unmounted once none is.
    assert not linux.is_mounted(rt.state_root)
    assert rt.exec_path == rt.path


def test_sealed_crun_is_copied_again_when_the_binary_is_replaced(tmp_dir: Path) -> None:
    """A package upgrade (a crun CVE fix) takes effect at the next call, not at the next
    edge restart."""
    crun = _crun()
    binary = tmp_dir / "bin" / "crun"
    binary.parent.mkdir()
    shutil.copy2(crun, binary)
    rt = _runtime(tmp_dir, str(binary))
    rt.open()
    try:
        before = Path(rt.exec_path).readlink()
        assert rt._argv(["list"])[-1] == "list" and Path(rt.exec_path).readlink() == before
        upgraded = binary.with_name("crun.new")  # a new inode, as dpkg installs one
        shutil.copy2(crun, upgraded)
        with upgraded.open("ab") as f:
            f.write(b"\0")  # a different file, still the same program
        upgraded.replace(binary)
        argv = rt._argv(["list"])
        assert rt.exec_path in argv and Path(rt.exec_path).readlink() != before
        assert _lists(rt)
    finally:
        rt.close()
    assert not linux.is_mounted(rt.state_root)
