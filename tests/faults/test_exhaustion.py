"""Exhaustion, for real: a small data disk filled up, a platform out of fds, a broken
seccomp listener. Each must give a typed error (507/503, never a 500 or a traceback),
show in ``/v1/health`` as ``degraded`` with the reason, and heal by itself once the
resource is back, without a restart.

Every mount, loop device, file and process a test makes is removed in ``finally``
blocks (the platform's own leftovers by ``host_leaks``/``clean_leftovers``), also when
the test fails. The figures (faults injected, survived, untyped 5xx, tracebacks in the
log) are printed at the end of the module (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient
from dsec.errors import InsufficientStorage, ResourceExhausted
from tests.conftest import PlatformProcess, clean_leftovers, host_leaks
from tests.ports import free_port
from tests.waiting import until

pytestmark = pytest.mark.root

MiB = 1024 * 1024
# A platform with a 1 GiB sandbox disk and no egress rules (nothing here needs them).
SMALL = {"DSEC_SANDBOX_DISK_GB": "1", "DSEC_NETWORK": "0"}
SMALL_PREALLOCATED = {**SMALL, "DSEC_SANDBOX_DISK_PREALLOCATE": "1"}


@dataclass
class Figures:
    injected: int = 0
    survived: int = 0
    untyped_5xx: int = 0
    tracebacks: int = 0
    notes: list[str] = field(default_factory=list)


FIGURES = Figures()


@pytest.fixture(scope="module", autouse=True)
def report_figures() -> Iterator[None]:
    yield
    sys.stdout.write(
        f"\nexhaustion faults: injected {FIGURES.injected}, survived {FIGURES.survived}, "
        f"untyped 5xx {FIGURES.untyped_5xx}, tracebacks in the log {FIGURES.tracebacks}\n"
        + "".join(f"  {n}\n" for n in FIGURES.notes)
    )


@dataclass
class OffsitePlatform(PlatformProcess):
    """A platform whose log lives outside its data dir (which the test fills up), in
    ``log_dir``: a temp dir the test removes (small_fs's, faulted_platform's)."""

    log_dir: Path = field(kw_only=True)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.edge_id}.log"


def run_args(**kw: Any) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 64)
    return DSecContainerRunArgs.model_validate(
        {"container_image": "busybox:latest", "job_id": "exhaustion-test", **kw}
    )


def create_raw(http: httpx.Client, **kw: Any) -> httpx.Response:
    """POST a create as any client would; counts an untyped 5xx."""
    spec = run_args(**kw).model_dump(mode="json", exclude_none=True)
    resp = http.post("/v1/sandboxes", json={"spec": spec, "timeout": 60}, timeout=90)
    if resp.status_code >= 500 and (
        resp.status_code == 500 or resp.json().get("error", {}).get("code") == "internal"
    ):
        FIGURES.untyped_5xx += 1
    return resp


def stop_raw(http: httpx.Client, sandbox_id: str) -> httpx.Response:
    """DELETE the sandbox as any client would: 200 with its final state."""
    resp = http.delete(f"/v1/sandboxes/{sandbox_id}", timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def health(http: httpx.Client) -> dict[str, Any]:
    body: dict[str, Any] = http.get("/v1/health", timeout=10).json()
    return body


def healthy_within(http: httpx.Client, timeout: float) -> None:
    until("health ok", lambda: health(http)["status"] == "ok", timeout, interval=0.2)


def degraded_within(http: httpx.Client, resource: str, timeout: float = 10) -> None:
    until(
        f"health degraded by {resource}", lambda: degraded_by(http, resource), timeout, interval=0.2
    )


def assert_heals(http: httpx.Client, *, timeout: float) -> None:
    """The fault is gone: health says ok again by itself, a create works (and is
    stopped), and the fault counts as survived."""
    healthy_within(http, timeout)
    resp = create_raw(http)
    assert resp.status_code in (200, 201), resp.text
    stop_raw(http, resp.json()["id"])
    FIGURES.survived += 1


def count_tracebacks(plat: PlatformProcess) -> int:
    if not plat.log_path.exists():
        return 0
    return len(re.findall(r"^Traceback \(most recent call last\)", plat.log_path.read_text(), re.M))


@contextlib.contextmanager
def running(plat: PlatformProcess) -> Iterator[PlatformProcess]:
    """Start, and on the way out stop, leak-check and clean up ``plat``."""
    try:
        plat.start()
        yield plat
    except BaseException:
        if plat.log_path.exists():
            sys.stderr.write(f"--- platform log ---\n{plat.log_path.read_text()[-6000:]}\n")
        raise
    finally:
        plat.stop()
        leaks = host_leaks(plat.data_dir, plat.edge_id)
        clean_leftovers(plat.data_dir, plat.edge_id)
        FIGURES.tracebacks += count_tracebacks(plat)
        log = plat.log_path.read_text()[-6000:] if leaks and plat.log_path.exists() else ""
        assert not leaks, f"platform left these behind: {leaks}\n--- platform log ---\n{log}"


@contextlib.contextmanager
def faulted_platform(
    env: dict[str, str],
) -> Iterator[tuple[OffsitePlatform, DSecSyncClient, httpx.Client]]:
    """A platform of its own for one fault (its data dir and log in a fresh temp dir,
    busybox built), with an SDK client and a raw HTTP client; on the way out it is
    stopped and leak-checked (``running``), its log must hold no traceback, and the
    temp dir goes, also when the test failed."""
    base = Path(tempfile.mkdtemp(prefix="dsec-exh-", dir="/tmp"))
    plat = OffsitePlatform(
        data_dir=base / "d", edge_id="x" + secrets.token_hex(4), extra_env=env, log_dir=base
    )
    plat.data_dir.mkdir()
    try:
        with (
            running(plat),
            DSecSyncClient(plat.url, plat.api_key) as client,
            httpx.Client(
                base_url=plat.url, headers={"Authorization": f"Bearer {plat.api_key}"}
            ) as http,
        ):
            client.build_image("busybox")
            yield plat, client, http
        assert count_tracebacks(plat) == 0, plat.log_path.read_text()[-4000:]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def small_fs(size_mb: int) -> Iterator[Path]:
    """A fresh ext4 of ``size_mb`` in a sparse file, loop-mounted (autoclear loop
    device); unmounted and removed afterwards, also on failure."""
    base = Path(tempfile.mkdtemp(prefix="dsec-exh-", dir="/tmp"))
    image, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    try:
        with open(image, "wb") as fh:
            fh.truncate(size_mb * MiB)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
        try:
            yield mnt
        finally:
            # The platform's own loop device (sandboxes.img) is detached by the kernel
            # a moment after its unmount: retry before falling back to a lazy unmount.
            for _ in range(50):
                done = subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
                if done.returncode == 0:
                    break
                time.sleep(0.1)
            else:
                subprocess.run(["umount", "-l", str(mnt)], check=False)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def settle(path: Path, timeout: float = 10.0) -> None:
    """Wait until ``path``'s free space stops moving: the sandbox disk is a sparse image
    on it, and btrfs punches what a sandbox deleted back into the image *asynchronously*
    (async discard), so space freed inside a sandbox a moment ago would come back to
    the host after ``fill`` measured it (seen under load: a data dir filled to leave
    532 MiB had more a second later, and a create the test expected refused went on)."""
    os.sync()
    deadline = time.monotonic() + timeout
    last = free_bytes(path)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = free_bytes(path)
        if abs(now - last) < 1 << 20:
            return
        last = now


def fill(path: Path, leave: int = 0) -> Path:
    """Take every free byte of ``path``'s file system but ``leave`` (one file); called
    again, tops the filler up to ``leave`` (it never shrinks it)."""
    settle(path)
    filler = path / "filler"
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize - leave
    subprocess.run(["fallocate", "-l", str(max(free, 4096)), str(filler)], check=False)
    # fallocate rounds; top up with small writes until ENOSPC
    with contextlib.suppress(OSError), open(path / "filler2", "ab") as fh:
        while os.statvfs(path).f_bavail * os.statvfs(path).f_frsize > leave:
            fh.write(b"\0" * 65536)
            fh.flush()
    return filler


def unfill(path: Path) -> None:
    for name in ("filler", "filler2"):
        (path / name).unlink(missing_ok=True)


# -- a full data disk -------------------------------------------------------------------------
def test_full_data_disk_is_typed_visible_and_heals() -> None:
    """A 1.5 GiB data dir (1 GiB of it the preallocated sandbox disk) filled up: creates
    get 507 ``insufficient_storage``, health is degraded (disk, since when), a running
    sandbox's writes stay backed (fsync succeeds) and a write past its disk fails with
    ENOSPC/EDQUOT inside; after freeing space creates work again, no restart."""
    with small_fs(1536) as mnt:
        data_dir = mnt / "d"
        data_dir.mkdir()
        plat = OffsitePlatform(
            data_dir=data_dir,
            edge_id="x" + secrets.token_hex(4),
            log_dir=mnt.parent,  # small_fs's temp dir: gone with it
            extra_env={
                "DSEC_SANDBOX_DISK_GB": "1",
                "DSEC_NETWORK": "0",
                "DSEC_SANDBOX_DISK_PREALLOCATE": "1",
            },
        )
        with running(plat):
            image = data_dir / "sandboxes.img"
            # Preallocated: the host already paid for the whole image.
            assert image.stat().st_blocks * 512 >= image.stat().st_size
            with (
                DSecSyncClient(plat.url, plat.api_key) as client,
                httpx.Client(
                    base_url=plat.url, headers={"Authorization": f"Bearer {plat.api_key}"}
                ) as http,
            ):
                client.build_image("busybox")
                sb = client.run_container(run_args(), timeout=60)
                FIGURES.injected += 1
                try:
                    fill(mnt)
                    # 1. typed, never a 500
                    for _ in range(5):
                        resp = create_raw(http)
                        assert resp.status_code == 507, resp.text
                        err = resp.json()["error"]
                        assert err["code"] == "insufficient_storage"
                        assert "free space" in err["message"]
                    with pytest.raises(InsufficientStorage):
                        client.run_container(run_args(), timeout=60)
                    # 2. visible
                    h = health(http)
                    assert h["status"] == "degraded", h
                    (cond,) = [d for d in h["degraded"] if d.get("resource") == "disk"]
                    assert cond["since"] <= time.time() and cond["what_to_do"]
                    # 3. inside the sandbox: writes are backed by the preallocated image
                    r = sb.run_shell("dd if=/dev/zero of=/ok bs=1M count=16 conv=fsync")
                    assert r.exit_code == 0, r
                    # ... and one past the sandbox disk fails inside, loudly
                    r = sb.run_shell(
                        "dd if=/dev/zero of=/big bs=1M count=1400 conv=fsync", timeout=300
                    )
                    assert r.exit_code != 0, r
                    low = r.stderr.lower()
                    assert "no space left" in low or "quota exceeded" in low, r
                    # btrfs frees the blocks with a later commit: the sandbox can
                    # write again soon after (its file system never went read-only).
                    r = sb.run_shell(
                        "rm /big; for i in $(seq 60); do sync; "
                        "echo fine > /after 2>/dev/null && break; sleep 0.5; done; cat /after",
                        timeout=60,
                    )
                    assert r.exit_code == 0 and r.stdout.strip() == "fine", r
                finally:
                    unfill(mnt)
                # 4. heals by itself
                assert_heals(http, timeout=30)
                # The same with the disk full to the last byte while a create runs on.
                FIGURES.injected += 1
                try:
                    fill(mnt, leave=0)
                    resp = create_raw(http)
                    assert resp.status_code == 507, resp.text
                    r = sb.run_shell("echo still > /x && cat /x")
                    assert r.exit_code == 0 and r.stdout.strip() == "still", r
                finally:
                    unfill(mnt)
                assert_heals(http, timeout=30)
                sb.stop()
            FIGURES.notes.append(f"disk: log tracebacks {count_tracebacks(plat)}")
            assert count_tracebacks(plat) == 0, plat.log_path.read_text()[-4000:]


def mount_options(path: Path) -> list[str]:
    """The options of the mount at ``path`` (btrfs turns ``rw`` into ``ro`` when it
    aborts a transaction: no dmesg needed to tell)."""
    target = str(path.resolve())
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[1] == target:
            return fields[3].split(",")
    raise AssertionError(f"{target} is not mounted")


def dd_bytes(stderr: str) -> int:
    """Bytes busybox dd says it wrote ("N bytes (..) copied")."""
    found = re.search(r"(\d+) bytes", stderr)
    return int(found.group(1)) if found else 0


def degraded_by(http: httpx.Client, resource: str) -> bool:
    return any(d.get("resource") == resource for d in health(http)["degraded"])


def test_full_data_disk_with_a_sparse_image_fails_writes_inside_and_heals() -> None:
    """The default (sparse) sandbox disk on a 2 GiB data dir that fills up: the host-space
    guard clamps the sandboxes' quota limits, so a running sandbox's write fails inside
    with EDQUOT at write() time instead of being lost at writeback (which used to turn
    btrfs read-only under every sandbox); health says ``sandbox_disk``; creates get 507
    while the data dir is full; a create while the host is merely short gets a clamped
    limit; once space is back the limits return and the file system was never read-only."""
    with small_fs(2048) as mnt:
        data_dir = mnt / "d"
        data_dir.mkdir()
        plat = OffsitePlatform(
            data_dir=data_dir,
            edge_id="x" + secrets.token_hex(4),
            log_dir=mnt.parent,  # small_fs's temp dir: gone with it
            extra_env={
                "DSEC_SANDBOX_DISK_GB": "1",
                "DSEC_NETWORK": "0",
                "DSEC_SANDBOX_DISK_PREALLOCATE": "0",  # the default: sparse
                # no pause swap file on this 2 GiB file system: it would hold an eighth
                # of it for good, and the sandbox disk could not come back within the
                # reserve once the filler is gone (what this test watches heal)
                "DSEC_SWAP": "off",
            },
        )
        with running(plat):
            image = data_dir / "sandboxes.img"
            sandboxes = data_dir / "sandboxes"
            assert image.stat().st_blocks * 512 < image.stat().st_size // 2  # sparse
            with (
                DSecSyncClient(plat.url, plat.api_key) as client,
                httpx.Client(
                    base_url=plat.url, headers={"Authorization": f"Bearer {plat.api_key}"}
                ) as http,
            ):
                client.build_image("busybox")
                sb = client.run_container(run_args(), timeout=60)
                assert health(http)["status"] == "ok"
                FIGURES.injected += 1
                try:
                    fill(mnt)
                    # 1. visible: the guard clamped (and the data dir is full)
                    degraded_within(http, "sandbox_disk")
                    (cond,) = [
                        d for d in health(http)["degraded"] if d["resource"] == "sandbox_disk"
                    ]
                    assert "EDQUOT" in cond["reason"] and cond["what_to_do"], cond
                    # 2. creates are typed 507 while the data dir is full
                    resp = create_raw(http)
                    assert resp.status_code == 507, resp.text
                    assert resp.json()["error"]["code"] == "insufficient_storage"
                    # 3. a write inside fails there, loudly, well below the sandbox's
                    # own 1 GiB limit (without the guard it "succeeds" into the void)
                    r = sb.run_shell("dd if=/dev/zero of=/big bs=1M count=400", timeout=300)
                    assert r.exit_code != 0, r
                    low = r.stderr.lower()
                    assert "quota exceeded" in low or "no space left" in low, r
                    os.sync()  # what the sandbox wrote before reaches the image: no abort
                    assert "rw" in mount_options(sandboxes), mount_options(sandboxes)
                finally:
                    unfill(mnt)
                # 4. heals: limits back, health ok, and the file system stayed writable
                healthy_within(http, 30)
                r = sb.run_shell(
                    "rm -f /big; dd if=/dev/zero of=/after bs=1M count=64 && echo fine",
                    timeout=60,
                )
                assert r.exit_code == 0 and r.stdout.strip().endswith("fine"), r
                os.sync()  # the sandbox's writes reach the image: no abort now either
                assert "rw" in mount_options(sandboxes), mount_options(sandboxes)
                r = sb.run_shell("cat /after | wc -c; rm /after")
                assert r.exit_code == 0 and r.stdout.strip() == str(64 * MiB), r
                resp = create_raw(http)
                assert resp.status_code in (200, 201), resp.text
                stop_raw(http, resp.json()["id"])
                FIGURES.survived += 1

                # The host short but not full: creates go on with clamped limits, and
                # each sandbox may write only its share of what is left.
                FIGURES.injected += 1
                late = None
                try:
                    budget = 256 * MiB
                    fill(mnt, leave=512 * MiB + budget)  # the reserve plus the budget
                    degraded_within(http, "sandbox_disk")
                    resp = create_raw(http)
                    assert resp.status_code in (200, 201), resp.text
                    late = resp.json()["id"]
                    for sid in (sb.id, late):
                        r = client.get(sid).run_shell(
                            "dd if=/dev/zero of=/big bs=1M count=600", timeout=300
                        )
                        assert r.exit_code != 0, (sid, r)
                        assert "quota exceeded" in r.stderr.lower(), (sid, r)
                        assert dd_bytes(r.stderr) < budget, (sid, r)
                        client.get(sid).run_shell("rm -f /big")
                    assert "rw" in mount_options(sandboxes)
                finally:
                    unfill(mnt)
                healthy_within(http, 30)
                assert late is not None
                r = client.get(late).run_shell("dd if=/dev/zero of=/big bs=1M count=300 && rm /big")
                assert r.exit_code == 0, r  # its configured limit is back
                stop_raw(http, late)
                FIGURES.survived += 1

                # So short that a new sandbox's share would be useless: creates get 507
                # from the guard (the data dir itself still has room), typed, no traceback.
                FIGURES.injected += 1
                try:
                    fill(mnt, leave=512 * MiB + 20 * MiB)
                    degraded_within(http, "sandbox_disk")
                    fill(mnt, leave=512 * MiB + 20 * MiB)  # what came back meanwhile
                    time.sleep(1.0)  # two of the guard's looks (every 0.5 s)
                    resp = create_raw(http)
                    assert resp.status_code == 507, resp.text
                    assert resp.json()["error"]["code"] == "insufficient_storage"
                    r = sb.run_shell("dd if=/dev/zero of=/big bs=1M count=100")
                    assert r.exit_code != 0 and "quota exceeded" in r.stderr.lower(), r
                    sb.run_shell("rm -f /big")
                finally:
                    unfill(mnt)
                assert_heals(http, timeout=30)
                sb.stop()
            FIGURES.notes.append(f"sparse disk: log tracebacks {count_tracebacks(plat)}")
            assert count_tracebacks(plat) == 0, plat.log_path.read_text()[-4000:]


# -- out of file descriptors ------------------------------------------------------------------
def test_out_of_fds_is_typed_visible_and_heals() -> None:
    """The platform's ``nofile`` lowered to 400 (soft and hard, with prlimit) and then
    used up by idle connections: creates get 503 ``resource_exhausted``, health is
    degraded (fds); once the connections close, creates work again (the seccomp
    listener, which used to die on EMFILE, is still there). The hard limit below 4096
    also lowers the sandboxes' own nofile instead of failing every create."""
    with faulted_platform(SMALL_PREALLOCATED) as (plat, client, http):
        conns: list[socket.socket] = []
        try:
            assert plat.proc is not None
            limit = 400
            subprocess.run(
                ["prlimit", f"--pid={plat.proc.pid}", f"--nofile={limit}:{limit}"], check=True
            )
            # Below 4096: sandboxes get the host's hard limit instead of a failed create.
            resp = create_raw(http)
            assert resp.status_code in (200, 201), resp.text
            sid = resp.json()["id"]
            r = client.get(sid).run_shell("ulimit -n")
            assert r.stdout.strip() == str(limit), r
            stop_raw(http, sid)
            assert health(http)["status"] == "ok"
            victim = create_raw(http).json()["id"]  # stopped while the fds are gone
            FIGURES.injected += 1
            for _ in range(limit + 50):
                s = socket.create_connection(("127.0.0.1", plat.port))
                conns.append(s)
            time.sleep(1.0)  # the server accepts what it can
            stopped = http.delete(f"/v1/sandboxes/{victim}", timeout=60)
            assert stopped.status_code in (200, 503), stopped.text
            statuses = []
            for _ in range(5):
                resp = create_raw(http)
                statuses.append(resp.status_code)
                if resp.status_code in (200, 201):
                    stop_raw(http, resp.json()["id"])
            assert 503 in statuses, statuses
            assert all(s in (201, 503) for s in statuses), statuses
            resp = create_raw(http)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "resource_exhausted"
            with pytest.raises(ResourceExhausted):  # the SDK re-raises the same class
                client.run_container(run_args(), timeout=60)
            h = health(http)
            assert h["status"] == "degraded", h
            assert any(d.get("resource") == "fds" for d in h["degraded"]), h
            for s in conns:
                s.close()
            conns.clear()
            assert_heals(http, timeout=60)
            # Its teardown, if it failed for want of fds, is done again without a restart.
            if stopped.status_code == 503:
                stop_raw(http, victim)
            until(
                "the victim's directory removed",
                lambda: not (plat.data_dir / "sandboxes" / victim).exists(),
                30,
                interval=0.2,
            )
            FIGURES.notes.append(
                f"fds: create statuses while exhausted {statuses}; the stop while exhausted: "
                f"{stopped.status_code} {stopped.json().get('reason', '')!r}"
            )
        finally:
            for s in conns:
                s.close()


# -- a broken seccomp listener ----------------------------------------------------------------
def test_broken_seccomp_listener_recovers() -> None:
    """The seccomp socket file crun hands notify fds to is removed under a running
    platform (a cleaned-up run dir): health says the component is down, the supervisor
    binds it again, and creates work without a restart."""
    with faulted_platform(SMALL_PREALLOCATED) as (plat, _client, http):
        sock = plat.data_dir / "run" / "seccomp.sock"
        assert sock.exists()
        for _ in range(3):
            FIGURES.injected += 1
            old = sock.stat().st_ino
            sock.unlink()

            def replaced(old: int = old) -> bool:
                return sock.exists() and sock.stat().st_ino != old

            until("a new socket", replaced, 30, interval=0.2)
            resp = create_raw(http)
            assert resp.status_code in (200, 201), resp.text
            sid = resp.json()["id"]
            assert resp.json().get("state") == "running"
            stop_raw(http, sid)
            FIGURES.survived += 1
        h = health(http)
        # Listed while it was down; ok again once it has run STABLE seconds.
        healthy_within(http, 30)
        FIGURES.notes.append(f"seccomp: health after rebinding {h['status']}")


# -- at the source, in one process --------------------------------------------------------------
LISTENER_UNDER_EMFILE = r"""
import array, json, os, resource, socket, sys, time
from pathlib import Path
from dsec.security.audit import NullAudit
from dsec.security.seccomp_listener import SeccompListener

path = Path(sys.argv[1])
lst = SeccompListener(path, NullAudit())
lst.start()
time.sleep(0.3)  # the thread has its epoll before the fds run out
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
r, w = os.pipe()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 2, hard))
hog = []
try:
    while True:
        hog.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
client.connect(str(path))  # sits in the backlog: the listener cannot accept (EMFILE)
msg = json.dumps({"metadata": "sb-emfile"}).encode()
client.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
client.close()
deadline = time.monotonic() + 2
while lst.accept_failures == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
alive_while_exhausted = lst.alive()

for fd in hog:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
deadline = time.monotonic() + 10
while not lst.attached("sb-emfile") and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"alive": alive_while_exhausted, "attached": lst.attached("sb-emfile"),
                  "accept_failures": lst.accept_failures}))
lst.close()
"""


def test_seccomp_listener_survives_emfile(tmp_path: Path) -> None:
    """The listener's accept fails with EMFILE while the process is out of fds: it used
    to die (every create after failed "the seccomp listener is not running" until a
    restart); now it pauses accepting and takes the queued notify fd once fds are free."""
    FIGURES.injected += 1
    # From a shell the listener's accept fails with EMFILE (and it goes on); under the
    # test runner the queued connection is often only accepted once fds are free (not
    # understood yet): either way the thread must live and the notify fd must arrive.
    with open(tmp_path / "out", "w+") as out_f, open(tmp_path / "err", "w+") as err_f:
        proc = subprocess.run(
            [sys.executable, "-c", LISTENER_UNDER_EMFILE, str(tmp_path / "s.sock")],
            stdout=out_f,
            stderr=err_f,
            timeout=60,
            check=False,
        )
    res = subprocess.CompletedProcess(
        proc.args, proc.returncode, (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["alive"] and out["attached"], (out, res.stderr)
    # accept usually fails with EMFILE here (the connection waits in the backlog); the
    # fd may also be taken by a thread in between: either way the fd must arrive.
    FIGURES.notes.append(f"seccomp EMFILE: accept failures {out['accept_failures']}")
    assert "Traceback" not in res.stderr, res.stderr
    FIGURES.survived += 1


def test_sqlite_on_a_full_disk_is_typed_at_the_source() -> None:
    """The edge's own store on a file system filled to the last byte: the SQLite error
    it raises is classified as disk exhaustion (507 with what to do), not a 500."""
    from dsec.edge.state import EdgeStateDB
    from dsec.exhaustion import Exhaustion, Resource, classify

    FIGURES.injected += 1
    with small_fs(64) as mnt:
        db = EdgeStateDB(mnt / "edge.db")
        try:
            fill(mnt)
            ex = Exhaustion(mnt)
            with pytest.raises(Exception) as info:
                for i in range(10_000):  # past what the WAL's pages already hold
                    db._db.execute(
                        "INSERT INTO idle_deadlines VALUES (?, ?)", (f"x{i}" * 50, float(i))
                    )
            assert classify(info.value) is Resource.DISK, info.value
            typed = ex.typed(info.value)
            assert isinstance(typed, InsufficientStorage) and typed.status == 507
            assert [c.resource for c in ex.conditions()] == [Resource.DISK]
            unfill(mnt)
            time.sleep(2.1)
            assert ex.conditions() == []
        finally:
            db.close()
            unfill(mnt)
    FIGURES.survived += 1


# -- out of pids ------------------------------------------------------------------------------
PIDS_V1 = Path("/sys/fs/cgroup/pids")


@contextlib.contextmanager
def pids_jail(pids: list[int]) -> Iterator[Path]:
    """A pids cgroup (v1) holding ``pids`` (with their threads); put back and removed
    afterwards, also on failure."""
    cg = PIDS_V1 / f"dsec-exh-{secrets.token_hex(4)}"
    cg.mkdir()
    try:
        for pid in pids:
            (cg / "cgroup.procs").write_text(str(pid))
        yield cg
    finally:
        (cg / "pids.max").write_text("max")
        for line in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (PIDS_V1 / "cgroup.procs").write_text(line)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.skipif(not (PIDS_V1 / "cgroup.procs").exists(), reason="needs a v1 pids hierarchy")
def test_out_of_pids_is_typed_and_heals() -> None:
    """The platform and its spawner in a pids cgroup with no room for another process:
    creates get 503 ``resource_exhausted`` (pids), never a 500; with the limit lifted,
    creates work again without a restart."""
    with faulted_platform(SMALL_PREALLOCATED) as (plat, _client, http):
        assert plat.proc is not None
        from tests.conftest import spawners

        with pids_jail([plat.proc.pid, *spawners(plat.data_dir)]) as cg:
            FIGURES.injected += 1
            current = int((cg / "pids.current").read_text())
            (cg / "pids.max").write_text(str(current))
            statuses = []
            for _ in range(3):
                resp = create_raw(http)
                statuses.append((resp.status_code, resp.json().get("error", {}).get("code")))
                if resp.status_code in (200, 201):
                    stop_raw(http, resp.json()["id"])
            FIGURES.notes.append(f"pids: create answers while exhausted {statuses}")
            assert all(code == 503 for code, _ in statuses), statuses
            assert {c for _, c in statuses} == {"resource_exhausted"}, statuses
            (cg / "pids.max").write_text("max")
        resp = create_raw(http)
        assert resp.status_code in (200, 201), resp.text
        stop_raw(http, resp.json()["id"])
        FIGURES.survived += 1


def _vm_size(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for {pid}")


def test_out_of_memory_is_typed_and_heals() -> None:
    """The platform and its spawners held to the address space they use now (``prlimit
    --as``, so every allocation past it fails with ENOMEM, as on a host out of memory
    with overcommit off): creates get 503 ``resource_exhausted``, never a 500 or a
    traceback, and the platform stays up; with the limit lifted, creates work again
    without a restart."""
    with faulted_platform(SMALL) as (plat, _client, http):
        assert plat.proc is not None
        from tests.conftest import spawners

        pids = [plat.proc.pid, *spawners(plat.data_dir)]
        FIGURES.injected += 1
        for pid in pids:
            limit = _vm_size(pid) + 4 * MiB
            subprocess.run(["prlimit", f"--pid={pid}", f"--as={limit}:"], check=True)
        statuses = []
        resources: set[str] = set()
        try:
            for _ in range(3):
                resp = create_raw(http)
                err = resp.json().get("error", {})
                statuses.append((resp.status_code, err.get("code")))
                resources.add(str(err.get("details", {}).get("resource")))
                if resp.status_code in (200, 201):
                    stop_raw(http, resp.json()["id"])
        finally:
            for pid in pids:
                subprocess.run(["prlimit", f"--pid={pid}", "--as=unlimited:"], check=False)
        FIGURES.notes.append(f"memory: create answers while exhausted {statuses} {resources}")
        assert all(code == 503 for code, _ in statuses), statuses
        assert {c for _, c in statuses} == {"resource_exhausted"}, statuses
        assert resources == {"memory"}, resources
        assert plat.proc.poll() is None, "the platform died"
        assert_heals(http, timeout=60)


# -- host limits at start ----------------------------------------------------------------------
def refused_up(data_dir: Path, nofile: int | None = None) -> tuple[int, str]:
    """`dsec up` that must refuse at its start checks (before claiming anything)."""
    argv = [sys.executable, "-m", "dsec.cli.main", "up", "--port", str(free_port())]
    argv += ["--data-dir", str(data_dir), "--no-save-config"]
    if nofile is not None:
        argv = ["prlimit", f"--nofile={nofile}:{nofile}", *argv]
    env = {**os.environ, "DSEC_EDGE_ID": "x" + secrets.token_hex(4)}
    env["XDG_CONFIG_HOME"] = str(data_dir.parent / "xdg")
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        _out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return 0, "it started"
    return proc.returncode, err.decode(errors="replace")


def test_host_limits_refused_at_start_with_one_line() -> None:
    """A hard nofile of 128 and a data dir with 20-odd MiB free: `dsec up` refuses with
    one line that says what to do, having mounted and started nothing."""
    with small_fs(40) as mnt:
        data_dir = mnt / "d"
        data_dir.mkdir()
        FIGURES.injected += 2
        code, err = refused_up(data_dir, nofile=128)
        assert code != 0, err
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and "nofile" in lines[0] and "ulimit -Hn" in lines[0], err
        code, err = refused_up(data_dir)
        assert code != 0, err
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and "free" in lines[0] and "--data-dir" in lines[0], err
        assert not (data_dir / "sandboxes.img").exists()
        FIGURES.survived += 2


# -- supervision and classification, in process ---------------------------------------------
async def test_supervised_loop_dies_restarts_and_is_listed_until_stable() -> None:
    """A loop that dies three times (EMFILE) is restarted with backoff, listed as down
    meanwhile, and dropped from the list once it has run STABLE seconds."""
    import asyncio

    from dsec import supervise

    sup = supervise.Supervisor()
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise OSError(24, "Too many open files")
        await asyncio.sleep(3600)

    old = supervise.STABLE
    supervise.STABLE = 0.5
    try:
        sup.spawn("flaky", flaky)
        await asyncio.sleep(0.05)
        (down,) = sup.failures()
        assert down["component"] == "flaky" and "Too many open files" in str(down["reason"])
        for _ in range(100):
            await asyncio.sleep(0.05)
            if runs >= 4 and not sup.failures():
                break
        assert runs == 4 and sup.failures() == [], (runs, sup.failures())
    finally:
        supervise.STABLE = old
        await sup.close()


def test_classify_names_the_resource() -> None:
    import errno
    import sqlite3

    from dsec.errors import BackendError
    from dsec.exhaustion import Resource, classify

    cases: list[tuple[BaseException, Resource | None]] = [
        (sqlite3.OperationalError("database or disk is full"), Resource.DISK),
        (sqlite3.OperationalError("disk I/O error"), Resource.DISK),
        (OSError(errno.ENOSPC, "No space left on device"), Resource.DISK),
        (OSError(errno.EMFILE, "Too many open files"), Resource.FDS),
        (OSError(errno.ENFILE, "Too many open files in system"), Resource.FDS),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), Resource.MEMORY),
        (MemoryError(), Resource.MEMORY),
        (RuntimeError("can't start new thread"), Resource.PIDS),
        (BackendError("crun: fork: Resource temporarily unavailable"), Resource.PIDS),
        (BackendError("crun: no such image"), None),
        (ValueError("no space left on device"), None),  # text alone, from a value: no
        (sqlite3.IntegrityError("UNIQUE constraint failed"), None),
    ]
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = OSError(errno.EMFILE, "Too many open files")
    cases.append((wrapped, Resource.FDS))
    for exc, want in cases:
        assert classify(exc) is want, (exc, want)


def test_fault_figures_typed() -> None:
    """Runs last in the module: nothing untyped was seen by any client."""
    assert FIGURES.untyped_5xx == 0, FIGURES
