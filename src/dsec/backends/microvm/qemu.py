"""The QEMU command line of one microVM, and the QEMU process that runs it.

One VM is one ``qemu-system-x86_64`` process on ``-M microvm`` (virtio-mmio, no PCI,
no firmware tables to walk: the fastest QEMU boot there is). The process must outlive
the edge that started it (an edge crash must not kill every VM on the host), so it runs
in its own session with no pipe to its parent: stdout and stderr go to a file, the
guest's serial console goes to a bounded in-QEMU ring buffer read over QMP, and a new
edge finds it again by pid + start time (``QemuProcess.adopt``).

Why a ring buffer and not a console file: the guest is hostile and a file chardev grows
without bound; RLIMIT_FSIZE cannot bound it either (it would also cap the writable disk
and the snapshot file QEMU writes). So a guest that powers off or panics is *paused*
(``-action shutdown=pause``) instead of ending QEMU, which keeps the console readable
for the error message until the owner kills it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal

from dsec import linux
from dsec.errors import BackendError

Accel = Literal["kvm", "tcg"]

QEMU = "qemu-system-x86_64"
# The microvm machine has no PIT/HPET to calibrate the TSC against under TCG: without
# these the guest hangs at boot (measured). Under KVM the kvm-clock replaces them.
TCG_CMDLINE = ("tsc_early_khz=2000000", "lpj=4000000")
TCG_TB_SIZE_MB = 64  # TCG translation cache (MiB)
# reboot=t: a guest reboot is a triple fault, which -no-reboot turns into a shutdown
# event at once. The kernel's default order (ACPI, then the keyboard controller, EFI,
# PCI port 0xcf9, then triple fault) depends on devices the microvm machine lacks or
# emulates partially; the guest-death test saw a sysrq 'b' guest hang in that chain.
BASE_CMDLINE = ("console=ttyS0", "quiet", "panic=-1", "reboot=t", "pci=off")
# -sandbox: QEMU's own seccomp filter. spawn=deny also rules out `exec:` migration,
# which is why snapshots go through a passed fd.
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
AGENT_CHARDEV = "agent"  # QMP's name of the agent port's chardev (query-chardev)
CONSOLE_RING_BYTES = 64 * 1024  # power of two (QEMU's ringbuf requirement)


@dataclass(frozen=True)
class Drive:
    """One virtio-blk drive; the guest finds it by ``serial`` (never by order)."""

    path: Path
    serial: str
    readonly: bool = True
    format: Literal["raw", "qcow2"] = "raw"
    """qcow2 only for a verifier's throwaway view of an agent disk (backed by a
    passed fd: ``VMConfig.fdsets``)."""
    options: str = ""
    """Extra ``-drive`` options (``backing.file.locking=off`` for that view: the
    agent's stopped QEMU still holds its disk's write lock)."""


@dataclass(frozen=True)
class NetAttachment:
    """A tap opened by the caller (in the sandbox's netns); QEMU inherits the fd."""

    tap_fd: int
    mac: str


@dataclass(frozen=True)
class VMConfig:
    """Everything that decides one VM's QEMU command line.

    ``params`` are the guest boot parameters (``dsec.layers=2`` ...) appended to the
    kernel command line. ``incoming`` names a snapshot to restore from instead of
    booting (see snapshot.py); it does not change the device set, which is what lets
    a snapshot be restored at all.
    """

    kernel: Path
    initrd: Path | None
    agent_socket: Path
    qmp_socket: Path
    log_path: Path
    params: Mapping[str, str] = field(default_factory=dict)
    vcpus: int = 1
    memory_mb: int = 256
    drives: tuple[Drive, ...] = ()
    net: NetAttachment | None = None
    accel: Accel = "tcg"
    incoming: Path | None = None
    console_ring_bytes: int = CONSOLE_RING_BYTES
    fdsets: tuple[tuple[int, int], ...] = ()
    """(fd, set): fds QEMU inherits as ``/dev/fdset/<set>`` (``-add-fd``), e.g. the
    read-only backing file of a qcow2 view; not part of the machine's shape."""

    def cmdline(self) -> str:
        parts = list(BASE_CMDLINE)
        if self.accel == "tcg":
            parts += TCG_CMDLINE
        for key, value in self.params.items():
            if (
                not key
                or any(c.isspace() or c == "=" for c in key)
                or any(c.isspace() for c in value)
            ):
                raise BackendError(f"invalid guest boot parameter {key!r}={value!r}")
            parts.append(f"{key}={value}")
        return " ".join(parts)

    def machine_key(self) -> str:
        """What a snapshot's restore must match (QEMU migration needs the same device
        set, -m and -smp, and the same kernel/initrd/cmdline loaded into the guest):
        a template snapshot is keyed by this. Drive *files* and the tap are not part
        of it, only how many drives there are and which are writable."""
        shape = {
            "qemu": qemu_version(),
            "kernel": _file_id(self.kernel),
            "initrd": _file_id(self.initrd) if self.initrd is not None else None,
            "cmdline": self.cmdline(),
            "vcpus": self.vcpus,
            "memory_mb": self.memory_mb,
            "drives": [d.readonly for d in self.drives],
            "serials": [d.serial for d in self.drives],
            "net": self.net is not None,
            "accel": self.accel,
            "ring": self.console_ring_bytes,
        }
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:24]


def _file_id(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise BackendError(f"{QEMU} not found: apt-get install qemu-system-x86")
    return path


@cache
def qemu_version() -> str:
    out = subprocess.run(
        [qemu_binary(), "--version"], capture_output=True, text=True, check=False
    ).stdout
    return out.splitlines()[0].strip() if out else "unknown"


@cache
def supports_sandbox() -> bool:
    """Whether this QEMU was built with seccomp (-sandbox is listed only then)."""
    out = subprocess.run(
        [qemu_binary(), "-help"], capture_output=True, text=True, check=False
    ).stdout
    return any(line.startswith("-sandbox") for line in out.splitlines())


def cpu_memory_argv(accel: Accel, memory_mb: int, vcpus: int) -> list[str]:
    """``-accel``, ``-cpu``, ``-m``, ``-smp``: the same for every QEMU machine here
    (microVMs, full VMs). TCG's translation cache defaults to 1 GiB, filled as code is
    translated, and charged to the sandbox's cgroup: bounded so that the backends'
    VMM overhead holds."""
    return [
        "-accel", "kvm" if accel == "kvm" else f"tcg,tb-size={TCG_TB_SIZE_MB}",
        "-cpu", "host" if accel == "kvm" else "max",
        "-m", str(memory_mb),
        "-smp", str(vcpus),
    ]  # fmt: skip


def guest_end_argv(console_ring_bytes: int) -> list[str]:
    """How every VM here ends and keeps its console: a guest that powers off, reboots
    or panics (panic=-1) stops instead of ending QEMU, so the console ring (serial
    port, bounded) stays readable; the owner then kills it."""
    return [
        "-no-reboot",
        "-action", "shutdown=pause",
        "-chardev", f"ringbuf,id=console,size={console_ring_bytes}",
        "-serial", "chardev:console",
    ]  # fmt: skip


def build_argv(config: VMConfig, *, binary: str | None = None) -> list[str]:
    """The full qemu-system-x86_64 argv for ``config`` (pure: no files touched)."""
    if config.vcpus < 1 or config.memory_mb < 16:
        raise BackendError(f"bad VM size: {config.vcpus} vCPUs, {config.memory_mb} MiB")
    ring = config.console_ring_bytes
    if ring < 4096 or ring & (ring - 1):
        raise BackendError(f"console ring size {ring} is not a power of two >= 4096")
    argv = [
        binary or qemu_binary(),
        "-M", "microvm",
        *cpu_memory_argv(config.accel, config.memory_mb, config.vcpus),
        "-nodefaults", "-no-user-config", "-nographic",
        *guest_end_argv(ring),
        "-kernel", str(config.kernel),
        "-append", config.cmdline(),
        "-chardev", f"socket,id=qmp,path={config.qmp_socket},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id={AGENT_CHARDEV},path={config.agent_socket},server=on,wait=off",
        "-device", f"virtserialport,chardev={AGENT_CHARDEV},name=dsec.agent",
    ]  # fmt: skip
    if config.initrd is not None:
        argv += ["-initrd", str(config.initrd)]
    if supports_sandbox():
        argv += ["-sandbox", SANDBOX]
    for i, drive in enumerate(config.drives):
        if "," in str(drive.path) or "," in drive.serial:
            raise BackendError(f"drive path or serial contains a comma: {drive}")
        ro = "on" if drive.readonly else "off"
        argv += [
            "-drive",
            f"id=d{i},file={drive.path},format={drive.format},if=none,readonly={ro}"
            + (f",{drive.options}" if drive.options else ""),
            "-device", f"virtio-blk-device,drive=d{i},serial={drive.serial}",
        ]  # fmt: skip
    for fd, fdset in config.fdsets:
        argv += ["-add-fd", f"fd={fd},set={fdset}"]
    if config.net is not None:
        argv += [
            "-netdev", f"tap,id=n0,fd={config.net.tap_fd}",
            "-device", f"virtio-net-device,netdev=n0,mac={config.net.mac}",
        ]  # fmt: skip
    if config.incoming is not None:
        argv += ["-incoming", "defer"]
    return argv


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (/proc/PID/stat field 22), or None
    if there is no such process or it is a zombie (dead, just not reaped)."""
    st = linux.proc_stat(pid)
    return None if st is None or st.dead else st.start_time


class QemuProcess:
    """A running QEMU, identified by pid AND start time (a pid alone may be reused).

    Works the same for a process this edge started (its child, reaped on kill) and
    one a previous edge started (``adopt``: reparented, so reaped by whoever is the
    subreaper; a zombie counts as dead).
    """

    def __init__(self, pid: int, start_time: int, qmp_socket: Path, log_path: Path) -> None:
        self.pid = pid
        self.start_time = start_time
        self.qmp_socket = qmp_socket
        self.log_path = log_path
        self._child = False

    @classmethod
    def launch(
        cls,
        config: VMConfig,
        *,
        prefix: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
    ) -> QemuProcess:
        """Start QEMU for ``config`` in its own session.

        ``prefix`` is a launcher argv that execs QEMU in place (jail.py's
        ``Jail.prefix``: cgroup, uid, namespaces); the pid we get is then the QEMU
        pid, since the launcher does not fork. The tap fd (if any) and ``pass_fds``
        are inherited; every other fd of ours is not.
        """
        inherit = list(pass_fds) + ([config.net.tap_fd] if config.net else [])
        inherit += [fd for fd, _ in config.fdsets]
        return cls.spawn(
            [*prefix, *build_argv(config)],
            qmp_socket=config.qmp_socket,
            log_path=config.log_path,
            stale=(config.qmp_socket, config.agent_socket),
            pass_fds=inherit,
            env=env,
        )

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        *,
        qmp_socket: Path,
        log_path: Path,
        stale: Sequence[Path] = (),
        pass_fds: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
    ) -> QemuProcess:
        """Start any QEMU command line (``argv``, launcher prefix included) the way
        ``launch`` does: its own session, stdin /dev/null, stdout and stderr to
        ``log_path``, exactly ``pass_fds`` inherited. For machines other than the
        microVM (dsec.backends.fullvm builds its own q35 argv); ``stale`` sockets are
        removed first so that a QMP connect never finds an old one. ``qmp_socket``
        must be the path of the argv's ``-chardev socket,id=qmp`` (``find_running``
        and ``adopt`` rely on that)."""
        for path in stale:
            path.unlink(missing_ok=True)
        argv = list(argv)
        inherit = list(pass_fds)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        restore: list[tuple[int, bool]] = []
        try:
            for fd in inherit:
                restore.append((fd, os.get_inheritable(fd)))
                os.set_inheritable(fd, True)
            pid = os.posix_spawn(
                argv[0],
                argv,
                dict(env) if env is not None else {"PATH": "/usr/bin:/bin"},
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                ],
                setsid=True,
            )
        except OSError as exc:
            raise BackendError(f"cannot start {argv[0]}: {exc}") from exc
        finally:
            os.close(log_fd)
            for fd, was in restore:
                os.set_inheritable(fd, was)
        start = _start_time(pid)
        proc = cls(pid, start or 0, qmp_socket, log_path)
        proc._child = True
        if start is None:  # exited at once (bad arguments): reap it and say why
            proc.kill()
            raise BackendError(f"QEMU exited at start: {proc.log_tail()}")
        return proc

    @classmethod
    def adopt(cls, pid: int, start_time: int, qmp_socket: Path, log_path: Path) -> QemuProcess:
        """Take over a QEMU a previous edge started (its pid and start time were
        recorded at launch). Raises BackendError if that process is gone."""
        proc = cls(pid, start_time, qmp_socket, log_path)
        if not proc.is_alive():
            raise BackendError(f"QEMU pid {pid} (start {start_time}) is no longer running")
        return proc

    def is_alive(self) -> bool:
        if self._child:
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    self._child = False
                    return False
        return _start_time(self.pid) == self.start_time

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL and wait until it is gone (reaped if ours). Idempotent; safe on a
        reused pid (the start time must match before any signal is sent)."""
        if _start_time(self.pid) == self.start_time:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self._child:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self._child = False
            return
        deadline = time.monotonic() + timeout
        while _start_time(self.pid) == self.start_time:
            if time.monotonic() > deadline:
                raise BackendError(f"QEMU pid {self.pid} did not die within {timeout}s")
            time.sleep(0.005)

    def wait_exit(self, timeout: float) -> bool:
        """Wait for the process to end by itself (after a QMP quit); True if it did."""
        deadline = time.monotonic() + timeout
        while self.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        self.kill()  # reaps a child; no-op otherwise
        return True

    def log_tail(self, limit: int = 4096) -> str:
        """The end of QEMU's own stdout/stderr (its error messages; the guest cannot
        write there). Bounded by what QEMU writes; read only the tail."""
        try:
            with open(self.log_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""


def find_running(root: Path) -> list[QemuProcess]:
    """Every live QEMU whose QMP socket lies under ``root`` (an edge's VM directory):
    what a restarted edge compares with its records, adopting the known ones and
    killing the rest (``kill`` checks the start time read here)."""
    prefix = f"socket,id=qmp,path={os.path.realpath(root)}/"
    found: list[QemuProcess] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(QEMU.encode()):
            continue
        for arg in argv:
            text = arg.decode(errors="replace")
            if text.startswith(prefix):
                start = _start_time(pid)
                if start is not None:
                    qmp = Path(text.removeprefix("socket,id=qmp,path=").split(",")[0])
                    found.append(QemuProcess(pid, start, qmp, qmp.parent / "qemu.log"))
                break
    return found
