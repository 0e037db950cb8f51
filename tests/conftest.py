"""Shared fixtures: a real platform (`dsec up` in a subprocess) and leak checks.

Every platform a test starts gets its own data directory and edge id, so a leak check
can name exactly what that platform must have cleaned up: mounts under its data
directory, cgroups under ``dsec/<edge>``, runtime state, processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec import linux, native, spawn
from dsec.backends.container import sharedsys
from dsec.images.mounts import TRACE_USERS_ENV
from dsec.net.manager import host_leftovers as net_leftovers
from dsec.net.manager import remove_leftovers as remove_net_leftovers
from dsec.resources import cgroups, swap
from dsec.resources.disk import loop_devices_backed_by
from tests.fakenet import FakeService, catalog, fake_service, package_index, service_octet
from tests.pg import pg_url, postgres  # noqa: F401  (real PostgreSQL fixtures)
from tests.ports import free_port

# Every test platform turns on its own swap file (DSEC_SWAP=auto, dsec.resources.swap):
# a small one, so that several platforms at once do not take the host's disk.
os.environ.setdefault("DSEC_SWAP_GB", "1")

REPO = Path(__file__).resolve().parent.parent


@dataclass
class PlatformProcess:
    """One `dsec up` process; restartable (same data dir) for crash tests."""

    data_dir: Path
    edge_id: str
    api_key: str = field(default_factory=lambda: "dsk_test_" + secrets.token_hex(12))
    port: int = field(default_factory=free_port)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def start(self, timeout: float = 60.0) -> None:
        env = dict(os.environ)
        # A test's platform ends its sandboxes on SIGTERM, so the leak check after it
        # finds nothing; tests of live restore across SIGTERM pass "0" (dsec up's default).
        env.setdefault("DSEC_STOP_SANDBOXES_ON_EXIT", "1")
        env.setdefault(TRACE_USERS_ENV, "1")  # a layer user that never lets go is named
        env.update(self.extra_env)
        env["DSEC_EDGE_ID"] = self.edge_id
        env.setdefault("XDG_CONFIG_HOME", str(self.data_dir.parent / "xdg"))
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsec.cli.main",
                "up",
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--api-key",
                self.api_key,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsec up exited early:\n{self.log_path.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(
            f"dsec up not healthy in {timeout}s:\n{self.log_path.read_text()[-4000:]}"
        )

    def stop(self, timeout: float = 60.0) -> None:
        stop_process(self.proc, timeout)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing gets a chance to clean up."""
        kill_process(self.proc)
        self.proc = None


def stop_process(proc: subprocess.Popen[Any] | None, timeout: float = 60.0) -> None:
    """SIGTERM and wait (a clean shutdown); SIGKILL if it takes longer than ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_process(proc)


def kill_process(proc: subprocess.Popen[Any] | None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()


# What LayerMounts.close logs when it had to clean up after a layer user that never let
# go or a mount still busy: the platform leaves nothing behind, but the cause is a bug.
LAYER_CLOSE_MARKS = re.compile(
    r"layers still counted as used|still busy at close|layer sha256:\w+: [+-]\d+ (at|held by) "
)


def host_leaks(data_dir: Path, edge_id: str) -> list[str]:
    """Everything a stopped platform must not have left on the host."""
    leaks = sharedsys.leftovers(data_dir)  # the platform's read-only /sys, by name
    leaks += [f"mount {m.mount_point} ({m.fstype})" for m in linux.mounts(data_dir)]
    host = cgroups.detect()
    for name in sorted(host.children(f"/dsec/{edge_id}")):
        leaks.append(f"cgroup dsec/{edge_id}/{name}")
    for pid in host.pids(f"/dsec/{edge_id}"):
        leaks.append(f"process {pid} in dsec/{edge_id}")
    sandboxes = data_dir / "sandboxes"
    if sandboxes.is_dir():
        leaks.extend(f"sandbox dir {p}" for p in sandboxes.iterdir())
    agents = data_dir / "run" / "agents"
    if agents.is_dir():
        leaks.extend(f"agent socket {p}" for p in agents.iterdir())
    leaks.extend(f"lazy layer daemon {pid}" for pid in lazyfs_daemons(data_dir))
    leaks.extend(f"spawner {pid}" for pid in spawners(data_dir))
    crun_root = data_dir / "run" / "crun"
    if crun_root.is_dir():
        leaks.extend(f"runtime state {p.name}" for p in crun_root.iterdir() if p.is_dir())
    leaks.extend(
        f"swap area {a.filename}"
        for a in swap.active_swaps()
        if swap.area_file(a).startswith(str(data_dir).rstrip("/") + "/")
    )
    leaks.extend(f"loop device {dev}" for dev in leaked_loops(data_dir))
    leaks.extend(net_leftovers(edge_id))  # nft table, veths and VM taps (dsec.net)
    leaks.extend(fncall_leftovers(data_dir, edge_id))
    leaks.extend(microvm_leftovers(data_dir, edge_id))
    leaks.extend(fullvm_leftovers(data_dir, edge_id))
    return leaks


def qemus(data_dir: Path) -> list[int]:
    """QEMU processes (microVMs, template builds) naming a path below ``data_dir``
    anywhere in an argument (``socket,id=qmp,path=...``, ``file=...``)."""
    needle = os.fsencode(str(data_dir)) + b"/"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"qemu-system-x86_64") and any(needle in a for a in argv):
            found.append(int(entry))
    return found


def microvm_leftovers(data_dir: Path, edge_id: str) -> list[str]:
    """The microVM backend's QEMUs, VM directories, half-built templates and its
    cgroup tree (dsec/<edge>-vm); its taps share the edge's prefix (net_leftovers)."""
    host = cgroups.detect()
    rel = f"/dsec/{edge_id}-vm"
    leaks = [f"qemu {pid}" for pid in qemus(data_dir)]
    vms = data_dir / "vms"
    if vms.is_dir():
        leaks.extend(f"vm dir {p}" for p in vms.iterdir())
    templates = data_dir / "vm-templates"
    if templates.is_dir():
        leaks.extend(f"template build {p}" for p in templates.glob(".build-*"))
    leaks.extend(f"cgroup {rel[1:]}/{name}" for name in sorted(host.children(rel)))
    leaks.extend(f"process {pid} in {rel}" for pid in host.pids(rel))
    leaks.extend(f"cgroup {rel}" for d in host.dirs(rel) if d.is_dir())
    return leaks


def zygotes(data_dir: Path) -> list[int]:
    """FnCall zygotes (dsec-zygote) serving a pool of the platform on ``data_dir``."""
    return _helpers(data_dir, lambda argv: os.path.basename(argv[0]).startswith(b"dsec-zygote"))


def fncall_leftovers(data_dir: Path, edge_id: str) -> list[str]:
    """FnCall zygotes, sandbox processes and cgroups (dsec/<edge>.fncall) left behind."""
    host = cgroups.detect()
    rel = f"/dsec/{edge_id}.fncall"
    leaks = [f"fncall zygote {pid}" for pid in zygotes(data_dir)]
    leaks.extend(f"process {pid} in {rel}" for pid in host.pids(rel))
    leaks.extend(f"cgroup {rel}" for d in host.dirs(rel) if d.is_dir())
    return leaks


def leaked_loops(data_dir: Path, wait: float = 2.0) -> list[str]:
    """Loop devices backed by a file below ``data_dir`` (the sandboxes' disk image) that
    will not go away by themselves. An autoclear loop device is freed with the last
    reference to its file system, which a private mount namespace created meanwhile by
    anything else on the host (an image build's ``unshare``) still holds as a copy of the
    host's mount table; that is not a leak, it clears when that namespace ends."""
    deadline = time.monotonic() + wait
    while True:
        found = [
            dev
            for dev in loop_devices_backed_by(data_dir)
            if _read(f"/sys/block/{os.path.basename(dev)}/loop/autoclear") != "1"
        ]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _helpers(data_dir: Path, match: Callable[[list[bytes]], bool]) -> list[int]:
    """Live processes whose argv ``match``es and names a path below ``data_dir``
    (zombies have an empty cmdline, so they never match)."""
    found = []
    needle = os.fsencode(str(data_dir))
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if match(argv) and any(a.startswith(needle) for a in argv):
            found.append(int(entry))
    return found


def lazyfs_daemons(data_dir: Path) -> list[int]:
    """dsec-lazyfs processes serving a mount below ``data_dir``."""
    return _helpers(data_dir, lambda argv: os.path.basename(argv[0]).startswith(b"dsec-lazyfs"))


def _ppid(pid: int) -> int:
    st = linux.proc_stat(pid)
    return 0 if st is None else st.ppid


def spawners(data_dir: Path) -> list[int]:
    """The per-host spawner (dsec-init spawner) of the platform on ``data_dir``; not its
    children between fork and exec, which still carry its argv for a moment."""
    found = _helpers(data_dir, lambda argv: len(argv) > 2 and argv[1] == b"spawner")
    return [pid for pid in found if _ppid(pid) not in found]


def stop_spawners(data_dir: Path, timeout: float = 5.0) -> None:
    """Stop the spawner of the platform on ``data_dir`` as the platform does: asked, it
    reaps its children (the inits just killed) before it exits. A SIGKILL would hand
    them to pid 1 as zombies for good, seen by every worker's ``pid1_orphans``; so only
    one that does not drain in ``timeout`` is killed."""
    if not spawners(data_dir):
        return
    spawn.stop_spawner(data_dir / "run" / "spawner.sock")
    deadline = time.monotonic() + timeout
    while spawners(data_dir) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in spawners(data_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pid1_orphans(
    names: frozenset[str] = frozenset({"init", "crun"}),
    *,
    zombies_only: bool = False,
    edge_id: str | None = None,
) -> set[int]:
    """Processes called one of ``names`` (container inits, crun) re-parented to pid 1,
    which reaps late or never on this machine: such an init leaks a zombie once stopped.
    With ``edge_id``, not those in another platform's cgroups (a zombie keeps its
    cgroup): the other test worker's platforms are not this test's to answer for."""
    return {
        pid
        for pid, st in linux.proc_stats()
        if st.ppid == 1
        and st.comm in names
        and (st.state == "Z" or not zombies_only)
        and (edge_id is None or not _of_another_edge(pid, edge_id))
    }


def _of_another_edge(pid: int, edge_id: str) -> bool:
    """Whether ``pid`` sits in the cgroups of a platform other than ``edge_id``'s
    (/dsec/<edge>, and its -vm, -fvm and .fncall trees)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    edges = set(re.findall(r"/dsec/([^/.\n]+?)(?:-vm|-fvm|\.fncall)?(?=/|$)", text, re.MULTILINE))
    return bool(edges) and edge_id not in edges


def clean_leftovers(data_dir: Path, edge_id: str) -> None:
    """Remove even what a stopped platform leaked (its sandboxes' processes, mounts,
    loop devices, helpers), so that one failure does not cascade into the next test."""
    remove_edge_cgroup(edge_id)  # kills the sandboxes' processes first
    swap.remove_areas_below(data_dir)  # a killed platform's own swap file stays on
    sharedsys.remove_leftovers(data_dir)  # its shared /sys with every mount in it
    for m in reversed(linux.mounts(data_dir)):
        with contextlib.suppress(OSError):
            linux.umount(m.mount_point, detach=True)
    remove_net_leftovers(edge_id)
    for dev in loop_devices_backed_by(data_dir):
        subprocess.run(["losetup", "-d", dev], check=False)
    for pid in [*qemus(data_dir), *lazyfs_daemons(data_dir)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stop_spawners(data_dir)
    for pid in zygotes(data_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def fullvm_leftovers(data_dir: Path, edge_id: str) -> list[str]:
    """The fullvm backend's VM directories (overlays, sockets) and its cgroup tree
    (dsec/<edge>-fvm); its QEMUs are among ``qemus(data_dir)``."""
    host = cgroups.detect()
    rel = f"/dsec/{edge_id}-fvm"
    leaks: list[str] = []
    vms = data_dir / "fullvms"
    if vms.is_dir():
        leaks.extend(f"fullvm dir {p}" for p in vms.iterdir())
    leaks.extend(f"cgroup {rel[1:]}/{name}" for name in sorted(host.children(rel)))
    leaks.extend(f"process {pid} in {rel}" for pid in host.pids(rel))
    leaks.extend(f"cgroup {rel}" for d in host.dirs(rel) if d.is_dir())
    return leaks


def remove_edge_cgroup(edge_id: str) -> None:
    host = cgroups.detect()
    host.kill_and_remove(f"/dsec/{edge_id}", timeout=2)
    host.kill_and_remove(f"/dsec/{edge_id}.fncall", timeout=2)
    host.kill_and_remove(f"/dsec/{edge_id}-vm", timeout=2)
    host.kill_and_remove(f"/dsec/{edge_id}-fvm", timeout=2)


@contextlib.contextmanager
def platform_process(**extra_env: str) -> Iterator[PlatformProcess]:
    """A platform in a fresh data dir; stopped, leak-checked and removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="dsec-t-", dir="/tmp"))
    edge_id = "t" + secrets.token_hex(4)
    plat = PlatformProcess(data_dir=base / "d", edge_id=edge_id, extra_env=dict(extra_env))
    plat.data_dir.mkdir()
    try:
        plat.start()
        yield plat
    except BaseException:
        # The data dir goes below: keep the platform's own account of a failure.
        if plat.log_path.exists():
            sys.stderr.write(f"--- platform log ---\n{plat.log_path.read_text()[-6000:]}\n")
        raise
    finally:
        plat.stop()
        leaks = host_leaks(plat.data_dir, edge_id)
        clean_leftovers(plat.data_dir, edge_id)
        log_text = plat.log_path.read_text(errors="replace") if plat.log_path.exists() else ""
        log_tail = log_text[-3000:]
        shutil.rmtree(base, ignore_errors=True)
        assert not leaks, f"platform left these behind: {leaks}\n--- log ---\n{log_tail}"
        for line in log_text.splitlines():
            if LAYER_CLOSE_MARKS.search(line):  # recovered at close: said, not failed
                warnings.warn(f"platform {edge_id} at close: {line[:500]}", stacklevel=1)
                # The holder's own story from the log (the log goes with the data dir):
                # how that sandbox ended is what the next look at such a report needs.
                for holder in re.findall(r"held by (\S+) ", line):
                    story = [ln[:300] for ln in log_text.splitlines() if holder in ln]
                    warnings.warn(f"{holder} in the log: {story[-12:]}", stacklevel=1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a whole cluster (tests/cluster_env.py) or a platform
    (itself, or a field of a fixture's dataclass) reports what those processes logged:
    their directory is gone by the time anyone looks."""
    report = yield
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            tails = getattr(value, "log_tails", None)
            if callable(tails):
                report.sections.append(("cluster process logs", str(tails())))
            for plat in platforms_in(value):
                if plat.log_path.exists():
                    tail = plat.log_path.read_text(errors="replace")[-PLATFORM_LOG_TAIL:]
                    report.sections.append((f"platform {plat.edge_id} log", tail))
    return report


PLATFORM_LOG_TAIL = 8000  # characters of a platform's log a failed test reports


def platforms_in(value: object) -> list[PlatformProcess]:
    """``value`` if it is a platform, else its dataclass fields that are (one level)."""
    if isinstance(value, PlatformProcess):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (getattr(value, f.name) for f in dataclasses.fields(value))
        return [f for f in fields if isinstance(f, PlatformProcess)]
    return []


@dataclass
class FakeInternet:
    """The fake services the session platform's catalog points at (tests.fakenet)."""

    pypi: FakeService
    catalog: Path


@pytest.fixture(scope="session", autouse=True)
def build_cache() -> Iterator[Path]:
    """One cache of built-in recipes' trees (DSEC_BUILD_CACHE, PlatformConfig.
    build_cache_dir) for the session platform, every platform a test starts and
    test_images' own image root, kept across runs in $DSEC_CACHE_DIR/build like the
    other built artifacts the suite caches there (guest images, the FnCall toolchain):
    debian-python's debootstrap (~40 s) runs once per machine and again only when its
    recipe changes (the tree's stamp, dsec.images.builders.DEBIAN_RECIPE_VERSION). A
    directory the caller names in DSEC_BUILD_CACHE is used instead."""
    given = os.environ.get("DSEC_BUILD_CACHE")
    path = Path(given) if given else native.cache_dir() / "build"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["DSEC_BUILD_CACHE"] = str(path)
    try:
        yield path
    finally:
        if not given:
            os.environ.pop("DSEC_BUILD_CACHE", None)


@pytest.fixture(scope="session")
def fake_internet() -> Iterator[FakeInternet]:
    """A fake PyPI (a real package index with one wheel) in its own netns; the session
    platform's "pypi" service resolves to it, so nothing leaves the machine."""
    with tempfile.TemporaryDirectory(prefix="dsec-fakenet-") as tmp:
        index = package_index(Path(tmp) / "index")
        with service_octet() as octet, fake_service("pypi", octet, 2, root=index) as pypi:
            yield FakeInternet(pypi, catalog({"pypi": pypi}, Path(tmp) / "catalog.json"))


@pytest.fixture(scope="session")
def platform(fake_internet: FakeInternet) -> Iterator[PlatformProcess]:
    with platform_process(DSEC_NETWORK_CATALOG=str(fake_internet.catalog)) as plat:
        yield plat


@pytest.fixture(scope="session")
def busybox_image(platform: PlatformProcess) -> str:
    from dsec import DSecSyncClient

    with DSecSyncClient(platform.url, platform.api_key) as client:
        client.build_image("busybox")
    return "busybox:latest"


@pytest.fixture
async def roomy_sandbox(client: object, busybox_image: str) -> AsyncIterator[object]:
    """A busybox container with 256 MiB (room for a file or tmpfs test's big write),
    stopped afterwards even if the test already ended it."""
    from dsec import DSecClient, DSecContainerRunArgs
    from dsec.errors import DSecError

    assert isinstance(client, DSecClient)
    sandbox = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=256)
    )
    try:
        yield sandbox
    finally:
        with contextlib.suppress(DSecError):
            await sandbox.stop()


@pytest.fixture
async def client(platform: PlatformProcess) -> AsyncIterator[object]:
    from dsec import DSecClient

    c = DSecClient(platform.url, platform.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()
