"""Hardening of container sandboxes: the seccomp allow-list, its notify listener in the
edge, capabilities, masked kernel paths and a non-dumpable pid 1.

Everything runs for real: a `dsec up` with real crun sandboxes, and a static C probe
(tests/seccomp_probe.c, built on the host) that tries each refused system call as root
inside a sandbox with arguments that would be harmless even if the call went through.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient
from dsec.backends.container.oci_spec import DEFAULT_CAPS
from dsec.native import binary
from dsec.security import seccomp
from dsec.security.seccomp_listener import BURST, PAUSE
from tests.conftest import PlatformProcess, platform_process
from tests.hostprint import HostPrint

pytestmark = pytest.mark.root

PROBE_IN_SANDBOX = "/tmp/probe"

# probe name -> the system call the edge must record
REPORTED = {
    **{name: name for name in (
        "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module",
        "delete_module", "swapon", "swapoff", "mount", "umount2", "pivot_root",
        "open_tree", "move_mount", "fsopen", "fsmount", "fspick", "mount_setattr",
        "unshare", "setns", "keyctl", "add_key", "request_key", "bpf",
        "perf_event_open", "userfaultfd", "ptrace", "process_vm_readv",
        "process_vm_writev", "clock_settime", "clock_adjtime", "adjtimex",
        "settimeofday", "acct", "quotactl", "syslog", "iopl", "ioperm",
        "open_by_handle_at", "name_to_handle_at", "vhangup", "lookup_dcookie", "kcmp",
        "pidfd_getfd",
    )},
    "clone_newuser": "clone",
    "clone_newnet": "clone",
    "socket_vsock": "socket",
}  # fmt: skip


@pytest.fixture(scope="module")
def probe() -> bytes:
    source = Path(__file__).with_name("seccomp_probe.c")
    path = binary(
        source,
        name="seccomp-probe",
        subdir="tests",
        cflags=["-O1", "-static", "-pthread", "-Wall"],
        what="the seccomp test probe",
    )
    return path.read_bytes()


def run_args(image: str = "busybox:latest", **kw: Any) -> DSecContainerRunArgs:
    kw.setdefault("memory_limit_mb", 128)
    return DSecContainerRunArgs.model_validate({"container_image": image, **kw})


@pytest.fixture(scope="module")
def sync(platform: PlatformProcess, busybox_image: str) -> Iterator[DSecSyncClient]:
    with DSecSyncClient(platform.url, platform.api_key) as client:
        yield client


def run_probe(sb: Any, *names: str, timeout: float = 30) -> dict[str, tuple[int, int]]:
    r = sb.run_shell(f"{PROBE_IN_SANDBOX} {' '.join(names)}", timeout=timeout)
    assert r.exit_code == 0, r
    out: dict[str, tuple[int, int]] = {}
    for line in r.stdout.splitlines():
        name, ret, err = line.split()
        out[name] = (int(ret), int(err))
    assert set(out) == set(names), r
    return out


def events(
    data_dir: Path, sandbox_id: str, *, want: int = 0, wait: float = 3.0
) -> list[dict[str, Any]]:
    """seccomp_violation events of a sandbox, straight from the edge's audit database
    (the flusher writes every ~50 ms); waits until at least ``want`` are there."""
    deadline = time.monotonic() + wait
    while True:
        with sqlite3.connect(data_dir / "audit.db") as db:
            rows = db.execute(
                "SELECT detail FROM audit WHERE sandbox = ? AND event = 'seccomp_violation' "
                "ORDER BY seq",
                (sandbox_id,),
            ).fetchall()
        found = [json.loads(r[0]) for r in rows]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def records(data_dir: Path, sandbox_id: str, action: str) -> int:
    with sqlite3.connect(data_dir / "audit.db") as db:
        (n,) = db.execute(
            "SELECT COUNT(*) FROM audit WHERE sandbox = ? AND action = ?", (sandbox_id, action)
        ).fetchone()
    return int(n)


def notify_fds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:seccomp notify":
                count += 1
        except OSError:
            pass
    return count


def sockets(pid: int) -> int:
    """Sockets ``pid`` holds, not counting its link to an idle spare supervisor (the
    agent keeps one forked between commands: a socketpair with its own child)."""
    held = sum(
        1
        for fd in os.listdir(f"/proc/{pid}/fd")
        if _link(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    )
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return held - sum(1 for c in children if _comm(int(c)) == "dsec-spare")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def signal_reports(data_dir: Path, sandbox_id: str) -> int:
    """signal_to_init events of a sandbox."""
    with sqlite3.connect(data_dir / "audit.db") as db:
        rows = db.execute(
            "SELECT 1 FROM audit WHERE sandbox = ? AND event = 'signal_to_init'",
            (sandbox_id,),
        ).fetchall()
    return len(rows)


def init_pid(plat: PlatformProcess, sandbox_id: str) -> int:
    return int((plat.data_dir / "sandboxes" / sandbox_id / "init.pid").read_text())


def test_dangerous_calls_refused_recorded_host_unaffected(
    sync: DSecSyncClient, platform: PlatformProcess, probe: bytes
) -> None:
    before = HostPrint.take()
    sb = sync.run_container(run_args(job_id="job-seccomp"), timeout=60)
    try:
        sb.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
        got = run_probe(sb, *REPORTED)
        wrong = {n: r for n, r in got.items() if r != (-1, errno.EPERM)}
        assert not wrong, f"not refused with EPERM: {wrong}"
        # A clock change through the shell's own tools fails too.
        r = sb.run_shell("date -s '2001-01-01 00:00:00'; hostname evil")
        assert "not permitted" in r.stderr
        evs = events(platform.data_dir, sb.id, want=len(REPORTED) + 1)
        seen = {e["syscall"] for e in evs}
        missing = set(REPORTED.values()) - seen
        assert not missing, f"no event for {missing}"
        assert "clock_settime" in seen  # from busybox date; hostname is refused quietly
        mount = next(e for e in evs if e["syscall"] == "mount")
        assert mount["result"] == "EPERM" and mount["comm"] == "probe"
        assert mount["pid"] > 1 and len(mount["args"]) == 6
        with sqlite3.connect(platform.data_dir / "audit.db") as db:
            (job,) = db.execute(
                "SELECT DISTINCT job FROM audit WHERE sandbox = ? AND event IS NOT NULL",
                (sb.id,),
            ).fetchone()
        assert job == "job-seccomp"
    finally:
        sb.stop()
    before.assert_same(HostPrint.take())


def test_normal_work_and_quiet_refusals(
    sync: DSecSyncClient, platform: PlatformProcess, probe: bytes
) -> None:
    sb = sync.run_container(run_args(), timeout=60)
    try:
        sb.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
        got = run_probe(
            sb,
            "clone3",
            "io_uring_setup",
            "personality_addr_no_randomize",
            "sethostname",
            "personality_query",
            "socket_unix",
            "fork",
            "thread",
        )
        # clone3 and io_uring say "not implemented", so libc and runtimes fall back.
        assert got["clone3"] == (-1, errno.ENOSYS)
        assert got["io_uring_setup"] == (-1, errno.ENOSYS)
        assert got["personality_addr_no_randomize"] == (-1, errno.EPERM)
        assert got["sethostname"] == (-1, errno.EPERM)
        assert got["personality_query"][0] >= 0 and got["socket_unix"][0] >= 0
        assert got["fork"][0] > 0 and got["thread"] == (0, 0)
        r = sb.run_shell("echo a | sed s/a/b/ | tr b c; sleep 0.01 & wait; echo $((6*7))")
        assert (r.exit_code, r.stdout) == (0, "c\n42\n")
        # Quiet: none of these is a violation.
        assert events(platform.data_dir, sb.id, wait=0.3) == []
    finally:
        sb.stop()


def test_capabilities_masked_paths_and_pid1(sync: DSecSyncClient) -> None:
    sb = sync.run_container(run_args(), timeout=60)
    try:
        r = sb.run_shell("grep -E '^(CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status")
        status = dict(line.split(":\t") for line in r.stdout.splitlines())
        caps = _cap_bits()
        want = sum(1 << caps[c] for c in DEFAULT_CAPS)
        assert int(status["CapEff"], 16) == want
        assert int(status["CapBnd"], 16) == want
        assert int(status["CapAmb"], 16) == 0
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
        # pid 1 holds the agent socket; root inside must not reach it or read pid 1.
        for cmd in (
            "readlink /proc/1/fd/3",
            "cat /proc/1/fd/3",
            "cat /proc/1/environ",
            "head -c1 /proc/1/mem",
            "ls -l /proc/1/root/",
        ):
            r = sb.run_shell(cmd)
            assert r.exit_code != 0, (cmd, r)
        # Kernel addresses and the sysrq trigger are masked.
        r = sb.run_shell("wc -c < /proc/kallsyms; echo h > /proc/sysrq-trigger; echo rc=$?")
        assert r.stdout.split()[0] == "0"
        r = sb.run_shell("cat /sys/kernel/vmcoreinfo 2>/dev/null | wc -c")
        assert r.stdout.strip() == "0"
    finally:
        sb.stop()


def _cap_bits() -> dict[str, int]:
    # bit numbers from <linux/capability.h>
    names = [
        "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID",
        "SETUID", "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST",
        "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO",
        "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
        "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE",
        "AUDIT_CONTROL", "SETFCAP",
    ]  # fmt: skip
    return {f"CAP_{n}": i for i, n in enumerate(names)}


def test_notify_fds_never_leak(
    sync: DSecSyncClient, platform: PlatformProcess, probe: bytes
) -> None:
    assert platform.proc is not None
    edge_pid = platform.proc.pid
    base = notify_fds(edge_pid)
    sb = sync.run_container(run_args(), timeout=60)
    try:
        # The edge holds the only copy: not crun, not the sandbox's own pid 1.
        deadline = time.monotonic() + 3
        while notify_fds(edge_pid) != base + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert notify_fds(edge_pid) == base + 1
        # crun's child holds the fd (close-on-exec) from the filter's load until it
        # executes the agent, and the edge may have it before that exec: once the
        # sandbox runs its own code, the fd is gone.
        pid = init_pid(platform, sb.id)
        deadline = time.monotonic() + 3
        while "crun" in os.readlink(f"/proc/{pid}/exe") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "crun" not in os.readlink(f"/proc/{pid}/exe")
        assert notify_fds(pid) == 0
        # That fd is all the edge holds for it: pid 1 has no connection open but its
        # listening socket (the signal-report channel is opened on its doorbell, for
        # milliseconds: tests/adversary/test_init_signals.py has what pid 1 reports).
        assert sockets(pid) == 1
        sb.run_shell("kill -USR2 1; kill -HUP 1")  # refused by the filter, recorded
        deadline = time.monotonic() + 5
        while signal_reports(platform.data_dir, sb.id) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert signal_reports(platform.data_dir, sb.id) == 2
        while sockets(pid) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sockets(pid) == 1
    finally:
        sb.stop()
    deadline = time.monotonic() + 3
    while notify_fds(edge_pid) != base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert notify_fds(edge_pid) == base


def test_edge_crash_fails_closed_and_restart_monitors_new_sandboxes(probe: bytes) -> None:
    with platform_process() as plat:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            client.build_image("busybox")
            old = client.run_container(run_args(), timeout=60)
            old.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
        plat.kill()  # SIGKILL: the notify fd dies with the edge
        plat.start()
        with DSecSyncClient(plat.url, plat.api_key) as client:
            old = client.get(old.id)
            t0 = time.monotonic()
            got = run_probe(old, "reboot", "mount", "unshare")
            # Refused by the kernel (no listener: ENOSYS), never hanging, never allowed.
            assert all(v == (-1, errno.ENOSYS) for v in got.values()), got
            assert time.monotonic() - t0 < 5
            assert records(plat.data_dir, old.id, "seccomp_unmonitored") == 1
            new = client.run_container(run_args(), timeout=60)
            new.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
            assert run_probe(new, "reboot") == {"reboot": (-1, errno.EPERM)}
            assert [e["syscall"] for e in events(plat.data_dir, new.id, want=1)] == ["reboot"]
            old.stop()
            new.stop()


def test_event_flood_is_rate_limited(
    sync: DSecSyncClient, platform: PlatformProcess, probe: bytes
) -> None:
    sb = sync.run_container(run_args(), timeout=60)
    try:
        sb.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
        t0 = time.monotonic()
        got = run_probe(sb, *(["reboot"] * 60))
        took = time.monotonic() - t0
        assert got == {"reboot": (-1, errno.EPERM)}
        # Past the burst, each call waits a short pause: the flood is slowed, not served.
        assert took >= (60 - seccomp_burst()) * PAUSE * 0.9
        evs = events(platform.data_dir, sb.id, want=seccomp_burst(), wait=1.0)
        time.sleep(0.3)
        evs = events(platform.data_dir, sb.id, wait=0)
        assert len(evs) == seccomp_burst()
    finally:
        sb.stop()


def seccomp_burst() -> int:
    return BURST


def test_switch_off_and_kernel_only_mode(probe: bytes) -> None:
    """DSEC_SECCOMP=0: no filter (for measuring its cost); DSEC_SECCOMP_NOTIFY=0: the
    same profile, refused in the kernel alone, nothing recorded."""
    for env, mode in (({"DSEC_SECCOMP": "0"}, "0"), ({"DSEC_SECCOMP_NOTIFY": "0"}, "2")):
        with platform_process(**env) as plat, DSecSyncClient(plat.url, plat.api_key) as client:
            client.build_image("busybox")
            sb = client.run_container(run_args(), timeout=60)
            try:
                r = sb.run_shell("grep ^Seccomp: /proc/self/status")
                assert r.stdout.split()[-1] == mode
                sb.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)
                got = run_probe(sb, "reboot", "clone3")
                if mode == "2":
                    assert got == {"reboot": (-1, errno.EPERM), "clone3": (-1, errno.ENOSYS)}
                assert events(plat.data_dir, sb.id, wait=0.3) == []
            finally:
                sb.stop()


def test_profile_names_exist_and_do_not_overlap() -> None:
    allowed, flagged = set(seccomp.ALLOWED), set(seccomp.DANGEROUS)
    assert not allowed & flagged
    assert not (allowed | flagged) & set(seccomp.ENOSYS_CALLS)
    prof = seccomp.profile(listener_path="/x.sock", metadata="sb")
    assert prof["defaultAction"] == "SCMP_ACT_ERRNO" and prof["defaultErrnoRet"] == errno.EPERM
    assert prof["listenerMetadata"] == "sb"
    plain = seccomp.profile()
    assert "listenerPath" not in plain
    assert all(r["action"] != "SCMP_ACT_NOTIFY" for r in plain["syscalls"])


PY_WORKLOAD = r"""
import asyncio, ctypes, multiprocessing, os, socket, sqlite3, subprocess, tempfile
import threading, compileall, zipfile

def work(x):
    return x * x

async def main():
    r, w = socket.socketpair()
    w.send(b"x")
    loop = asyncio.get_running_loop()
    assert await loop.sock_recv(r, 1) == b"x"
    p = await asyncio.create_subprocess_exec("true")
    assert await p.wait() == 0

threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
asyncio.run(main())
with multiprocessing.Pool(2) as pool:
    assert pool.map(work, range(10))[-1] == 81
assert subprocess.run(["sh", "-c", "echo ok"], capture_output=True).stdout == b"ok\n"
d = tempfile.mkdtemp()
with sqlite3.connect(os.path.join(d, "a.db")) as db:
    db.execute("create table t (x)")
open(os.path.join(d, "m.py"), "w").write("X = 1\n")
assert compileall.compile_dir(d, quiet=1)
with zipfile.ZipFile(os.path.join(d, "z.zip"), "w") as z:
    z.write(os.path.join(d, "m.py"), "m.py")
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mount(b"none", b"/mnt", b"tmpfs", 0, None) == -1
print("workload ok", ctypes.get_errno())
"""


def test_python_workload_under_the_profile(sync: DSecSyncClient, platform: PlatformProcess) -> None:
    """Threads, asyncio, subprocesses, multiprocessing, sqlite, compileall, in the
    debian-python image; a ctypes mount() is refused and recorded."""
    sync.build_image("debian-python")
    sb = sync.run_container(run_args("debian-python:bookworm", memory_limit_mb=512), timeout=120)
    try:
        sb.write_file("/tmp/work.py", PY_WORKLOAD.encode())
        r = sb.run_shell("python3 /tmp/work.py", timeout=120)
        assert (r.exit_code, r.stdout) == (0, f"workload ok {errno.EPERM}\n"), r
        assert [e["syscall"] for e in events(platform.data_dir, sb.id, want=1)] == ["mount"]
    finally:
        sb.stop()


def _signal_verdicts(cases: list[tuple[int, int, int, int]]) -> list[int]:
    """errno of each raw syscall(nr, a0, a1, a2) under the profile (flag rules turned
    into ERRNO 99, so flagged and merely refused differ), in a child that is pid 1 of
    its own pid namespace: a wrongly allowed kill(1, ...) only signals that child."""
    import ctypes
    import struct

    prof = seccomp.profile(listener_path="/x.sock", metadata="t")
    rules = [
        {**r, "action": "SCMP_ACT_ERRNO", "errnoRet": 99} if r["action"] == "SCMP_ACT_NOTIFY" else r
        for r in prof["syscalls"]
    ]
    bpf = seccomp.compile_bpf({**prof, "syscalls": rules})
    assert bpf is not None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    r, w = os.pipe()
    parent = os.fork()
    if parent == 0:  # the test process's child: give it a pid namespace of its own
        try:
            os.setsid()  # kill(0, ...) below must reach this group only, not pytest's
            assert libc.unshare(0x20000000) == 0  # CLONE_NEWPID
            pid = os.fork()
            if pid == 0:
                import signal as sig

                for s in (sig.SIGTERM, sig.SIGINT, sig.SIGUSR1):
                    sig.signal(s, sig.SIG_IGN)
                buf = ctypes.create_string_buffer(bpf)
                prog = struct.pack("HL", len(bpf) // 8, ctypes.addressof(buf))
                fprog = ctypes.create_string_buffer(prog)
                libc.prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
                libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
                assert libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) == 0  # a filter
                out = []
                for nr, *args in cases:
                    rc = libc.syscall(ctypes.c_long(nr), *(ctypes.c_ulong(a) for a in args))
                    out.append(0 if rc == 0 else ctypes.get_errno())
                os.write(w, json.dumps(out).encode())
                os._exit(0)
            os.waitpid(pid, 0)
        except BaseException as exc:  # say why, instead of an empty pipe
            os.write(w, json.dumps(repr(exc)).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 65536)
    os.close(r)
    os.waitpid(parent, 0)
    return list(json.loads(data))


def test_signal_rules_flag_pid1_whatever_the_high_bits() -> None:
    """kill-family calls at pid 1 (low 32 bits) with a signal are flagged; probes,
    other targets, the caller's own group and kill(-1) pass."""
    kill, tkill, tgkill = 62, 200, 234
    self_pid = 1  # the child is pid 1 of its namespace: flagged cases never run
    cases = [
        (kill, 1, 15, 0),  # flagged
        (kill, (1 << 32) | 1, 15, 0),  # flagged: the kernel sees pid 1
        (kill, 0xFFFFFFFF00000001, 2, 0),  # flagged
        (kill, 0xFFFFFFFFFFFFFFFF, 10, 0),  # kill(-1): allowed (nothing else: ESRCH)
        (kill, 1, 0, 0),  # probe: allowed
        (kill, 0, 10, 0),  # own process group (SIGUSR1, ignored): allowed
        (kill, 2, 10, 0),  # no such pid: allowed, ESRCH
        (kill, 0xFFFFFFFFFFFFFFFE, 10, 0),  # group 2: allowed, ESRCH
        (tkill, 1, 15, 0),  # flagged
        (tkill, 3, 10, 0),  # allowed, ESRCH
        (tgkill, 1, 1, 2),  # flagged (the signal is the third argument)
    ]
    got = _signal_verdicts(cases)
    esrch = errno.ESRCH
    assert got == [99, 99, 99, esrch, 0, 0, esrch, esrch, 99, esrch, 99], got
    assert self_pid == 1
    assert "memfd_secret" in seccomp.DANGEROUS and "memfd_secret" not in seccomp.ALLOWED
    assert not set(seccomp.SIGNAL_CALLS) & set(seccomp.ALLOWED)
