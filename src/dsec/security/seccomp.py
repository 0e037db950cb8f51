"""The sandbox's seccomp profile: an allow-list, tighter than Docker's default.

Why an allow-list: a new kernel brings new system calls, and a deny-list would let
every one of them through until someone noticed. Everything not listed here fails with
EPERM. Three groups get special answers:

* ``DANGEROUS``: calls an agent never needs for its task and that can hurt or probe
  the host (reboot, kexec, modules, swap, mounts and namespaces, keyrings, bpf,
  perf, userfaultfd, ptrace, clock setting, ...). With a listener they are sent to the
  edge (``SCMP_ACT_NOTIFY``), which answers EPERM and records a ``seccomp_violation``
  event; without one they fail with EPERM as well. If the edge is gone, the kernel
  fails them with ENOSYS: they never hang and never succeed.
* ``ENOSYS_CALLS``: clone3 (its flags live in memory a filter cannot read, so libc must
  fall back to clone, whose flags we can check) and io_uring (a large, often-exploited
  kernel surface that Docker and Google also refuse; runtimes such as libuv fall back to
  thread pools when it reports ENOSYS, not when it reports EPERM).
* clone with a namespace flag and personality with an unusual persona are treated like
  ``DANGEROUS``; plain clone (fork, threads) and the personas Docker allows pass.

The profile is plain OCI JSON (``linux.seccomp``), so any OCI runtime can load it.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import functools
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.errors import BackendError
from dsec.security.audit import AuditSink
from dsec.security.seccomp_listener import SIGNAL_ARGS, SeccompListener

EPERM = 1
ENOSYS = 38

# Names for x86_64; a runtime skips names its architecture lacks (checked in tests).
ALLOWED: tuple[str, ...] = (
    # files and directories
    "access", "chdir", "chmod", "chown", "close", "close_range", "copy_file_range",
    "creat", "dup", "dup2", "dup3", "faccessat", "faccessat2", "fadvise64",
    "fallocate", "fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown", "fchownat",
    "fcntl", "fdatasync", "fgetxattr", "flistxattr", "flock", "fremovexattr",
    "fsetxattr", "fstat", "fstatfs", "fsync", "ftruncate", "futimesat", "getcwd",
    "getdents", "getdents64", "getxattr", "inotify_add_watch", "inotify_init",
    "inotify_init1", "inotify_rm_watch", "lchown", "lgetxattr", "link", "linkat",
    "listxattr", "llistxattr", "lremovexattr", "lseek", "lsetxattr", "lstat",
    "mkdir", "mkdirat", "mknod", "mknodat", "newfstatat", "open", "openat",
    "openat2", "pread64", "preadv", "preadv2", "pwrite64", "pwritev", "pwritev2",
    "read", "readahead", "readlink", "readlinkat", "readv", "removexattr",
    "rename", "renameat", "renameat2", "rmdir", "sendfile", "setxattr", "splice",
    "stat", "statfs", "statx", "symlink", "symlinkat", "sync", "sync_file_range",
    "syncfs", "tee", "truncate", "umask", "unlink", "unlinkat", "utime",
    "utimensat", "utimes", "vmsplice", "write", "writev", "fanotify_mark",
    "chroot", "cachestat",
    # memory
    "brk", "madvise", "membarrier", "memfd_create", "mincore",
    "mlock", "mlock2", "mlockall", "mmap", "mprotect", "mremap", "msync",
    "munlock", "munlockall", "munmap", "pkey_alloc", "pkey_free", "pkey_mprotect",
    "remap_file_pages", "map_shadow_stack", "process_mrelease",
    # processes, threads, signals, credentials
    "arch_prctl", "capget", "capset", "execve", "execveat", "exit", "exit_group",
    "fork", "vfork", "getcpu", "getegid", "geteuid", "getgid", "getgroups",
    "getitimer", "getpgid", "getpgrp", "getpid", "getppid", "getpriority",
    "getresgid", "getresuid", "getrlimit", "get_robust_list", "getrusage",
    "getsid", "gettid", "getuid", "ioprio_get", "ioprio_set",
    "pidfd_open", "pidfd_send_signal", "prctl", "prlimit64", "restart_syscall",
    "rseq", "rt_sigaction", "rt_sigpending", "rt_sigprocmask",
    "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
    "sched_getaffinity", "sched_getattr", "sched_getparam",
    "sched_get_priority_max", "sched_get_priority_min", "sched_getscheduler",
    "sched_rr_get_interval", "sched_setaffinity", "sched_setattr",
    "sched_setparam", "sched_setscheduler", "sched_yield", "seccomp",
    "setfsgid", "setfsuid", "setgid", "setgroups", "setitimer", "setpgid",
    "setpriority", "setregid", "setresgid", "setresuid", "setreuid", "setrlimit",
    "set_robust_list", "setsid", "set_tid_address", "setuid", "sigaltstack",
    "wait4", "waitid", "pause", "getrandom",
    "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self",
    # time (reading only), timers, polling, IPC
    "alarm", "clock_getres", "clock_gettime", "clock_nanosleep", "gettimeofday",
    "nanosleep", "time", "times", "timer_create", "timer_delete",
    "timer_getoverrun", "timer_gettime", "timer_settime", "timerfd_create",
    "timerfd_gettime", "timerfd_settime", "epoll_create", "epoll_create1",
    "epoll_ctl", "epoll_pwait", "epoll_pwait2", "epoll_wait", "eventfd",
    "eventfd2", "futex", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue",
    "poll", "ppoll", "pselect6", "select", "signalfd", "signalfd4", "pipe",
    "pipe2", "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents",
    "io_pgetevents", "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive",
    "mq_timedsend", "mq_unlink", "msgctl", "msgget", "msgrcv", "msgsnd",
    "semctl", "semget", "semop", "semtimedop", "shmat", "shmctl", "shmdt",
    "shmget", "ioctl", "sysinfo", "uname",
    # sockets (raw sockets need CAP_NET_RAW, which the sandbox lacks)
    "accept", "accept4", "bind", "connect", "getpeername", "getsockname",
    "getsockopt", "listen", "recvfrom", "recvmmsg", "recvmsg", "sendmmsg",
    "sendmsg", "sendto", "setsockopt", "shutdown", "socketpair",
)  # fmt: skip

# Refused and reported: what an agent does not need and what can hurt the host.
DANGEROUS: tuple[str, ...] = (
    "reboot", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module",
    "swapon", "swapoff",
    "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "clock_settime", "clock_adjtime", "adjtimex", "settimeofday",
    "acct", "quotactl", "quotactl_fd", "syslog", "iopl", "ioperm",
    "open_by_handle_at", "name_to_handle_at", "vhangup", "lookup_dcookie",
    "uselib", "_sysctl", "nfsservctl",
    # secret memory is unmapped from the kernel's direct map: our detectors could not
    # read it and it is a fresh kernel surface; nothing an agent's task needs
    "memfd_secret",
)  # fmt: skip
# Not listed anywhere, so refused quietly (EPERM, no event): calls that honest tools
# probe for, where an event would blame a clean rollout. NUMA policy (libnuma, hwloc
# and ML runtimes query it at load), sethostname (setup scripts; the sandbox has its own
# UTS namespace and no CAP_SYS_ADMIN anyway), modify_ldt (Wine), fanotify_init,
# process_madvise, move_pages/migrate_pages, and every call newer than this list.

ENOSYS_CALLS: tuple[str, ...] = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")

# vsock is not namespaced: from inside a VM (this host may be one), AF_VSOCK reaches the
# hypervisor's services whatever the sandbox's network namespace says.
AF_VSOCK = 40

# Signals aimed at pid 1 (the sandbox's dsec-init) and broadcast kills. pid 1 already
# ignores every signal from inside its pid namespace (dsec-init.c); these rules make
# the attempt fail with EPERM and reach the edge, which records ``signal_to_init``
# (SIGKILL and SIGSTOP never reach pid 1's signalfd: the kernel drops them for a
# namespace's init, so only here can they be seen). name -> (target arg, signal arg).
# Only a non-zero signal counts: ``kill(1, 0)`` is an existence probe honest tools use.
# pidfd_send_signal names its target by an fd a filter cannot read; pid 1 reports
# what arrives that way itself.
SIGNAL_CALLS: dict[str, tuple[int, int]] = SIGNAL_ARGS
INIT_PID = 1
BROADCAST = 0xFFFFFFFF  # kill(-1): every process but pid 1 (the kernel's definition)
LOW32 = 0xFFFFFFFF

# clone flags that create namespaces (Docker's mask 0x7E020000).
CLONE_NS_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
CLONE_NS_MASK = sum(CLONE_NS_FLAGS.values())
# Personas Docker allows: PER_LINUX, PER_LINUX32, UNAME26 (and with LINUX32), query.
ALLOWED_PERSONAS = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

_ARCHES = {
    "x86_64": ["SCMP_ARCH_X86_64"],
    "aarch64": ["SCMP_ARCH_AARCH64"],
}


def architectures() -> list[str]:
    """The native ABI only: 32-bit compat entry points are extra kernel surface that
    agents do not need (a 32-bit binary is refused by the filter)."""
    return _ARCHES.get(platform.machine(), [])


@functools.cache
def _rules(notify: bool) -> list[dict[str, Any]]:
    """The syscall rules; one shared list per mode, so a precompiled program can be
    found by identity (see precompiled())."""
    flagged = "SCMP_ACT_NOTIFY" if notify else "SCMP_ACT_ERRNO"

    def flag(names: list[str], args: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        rule: dict[str, Any] = {"names": names, "action": flagged}
        if not notify:
            rule["errnoRet"] = EPERM
        if args:
            rule["args"] = args
        return rule

    syscalls: list[dict[str, Any]] = [
        {"names": list(ALLOWED), "action": "SCMP_ACT_ALLOW"},
        flag(list(DANGEROUS)),
        {"names": list(ENOSYS_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        # fork and threads: clone without any namespace flag.
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [
                {"index": 0, "value": CLONE_NS_MASK, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
            ],
        },
    ]
    # socket: every family but vsock (crun turns several conditions on one argument into
    # separate, ORed rules, so one NE per rule is all a profile can say).
    syscalls += [
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"}],
        },
        flag(["socket"], [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_EQ"}]),
    ]
    syscalls += _signal_rules(flag, broadcast=False)
    # Conditions within one rule are ANDed, rules are ORed: one rule per persona and
    # one per namespace flag.
    syscalls += [
        {
            "names": ["personality"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": p, "op": "SCMP_CMP_EQ"}],
        }
        for p in ALLOWED_PERSONAS
    ]
    for bit in CLONE_NS_FLAGS.values():
        syscalls.append(
            flag(
                ["clone"],
                [{"index": 0, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}],
            )
        )
    return syscalls


def _masked(index: int, mask: int, value: int) -> dict[str, Any]:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _signal_rules(flag: Callable[..., dict[str, Any]], *, broadcast: bool) -> list[dict[str, Any]]:
    """Flag a kill-family call whose target's low 32 bits are pid 1 (and, with
    ``broadcast``, kill(-1)) and whose signal is not 0; allow every other call.

    kill(-1) never reaches pid 1 (the kernel skips a namespace's init), and it is an
    honest idiom (a test harness ending every process it started, a fork bomb's
    cleanup, dsec-untrusted's leftovers): it is not flagged (``broadcast`` False) in any
    profile the platform builds today; the rule stays for a profile that wants it.

    Why the target is compared masked, and why the allow side is a list of bit
    patterns: the kernel truncates the pid argument to 32 bits, so ``kill(1 << 32 | 1)``
    signals pid 1, and a plain 64-bit ``!= 1`` would let it through. libseccomp has no
    masked "not equal", and where an allow rule overlaps a flag rule for the same call
    the allow wins (checked in tests), so the allowed set is covered by patterns that
    are each disjoint from the flagged targets: bit 0 clear, or a bit k >= 1 set (target
    1 only); for kill, which also flags 0xffffffff, a pair of adjacent bits >= 1 that
    differ (a value whose bits 1..31 are neither all clear nor all set has one)."""
    rules: list[dict[str, Any]] = []
    for name, (target, sig) in SIGNAL_CALLS.items():
        flagged = [INIT_PID, BROADCAST] if name == "kill" and broadcast else [INIT_PID]
        for value in flagged:
            rules.append(
                flag(
                    [name],
                    [
                        _masked(target, LOW32, value),
                        {"index": sig, "value": 0, "op": "SCMP_CMP_NE"},
                    ],
                )
            )
        allow: list[dict[str, Any]] = [{"index": sig, "value": 0, "op": "SCMP_CMP_EQ"}]
        allow.append(_masked(target, 1, 0))
        if BROADCAST in flagged:
            for i in range(1, 31):
                pair = (1 << i) | (1 << (i + 1))
                allow += [_masked(target, pair, 1 << i), _masked(target, pair, 1 << (i + 1))]
        else:
            allow += [_masked(target, 1 << k, 1 << k) for k in range(1, 32)]
        rules += [{"names": [name], "action": "SCMP_ACT_ALLOW", "args": [a]} for a in allow]
    return rules


def profile(*, listener_path: str | None = None, metadata: str = "") -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object. With ``listener_path`` the dangerous calls go
    to that socket's listener (crun hands it the notify fd with ``metadata``)."""
    out: dict[str, Any] = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "architectures": architectures(),
        "syscalls": _rules(bool(listener_path)),
    }
    if listener_path:
        out["listenerPath"] = listener_path
        out["listenerMetadata"] = metadata
    return out


BPF_ANNOTATION = "run.oci.seccomp_bpf_data"
_compiled: dict[bool, str | None] = {}


def precompiled(prof: dict[str, Any]) -> str | None:
    """Base64 of the compiled program of a profile made by profile(), for crun's
    ``run.oci.seccomp_bpf_data`` (None for other profiles: crun compiles those)."""
    rules = prof.get("syscalls")
    for notify in (True, False):
        if rules is _rules(notify):
            if notify not in _compiled:
                bpf = compile_bpf(prof)
                _compiled[notify] = base64.b64encode(bpf).decode() if bpf else None
            return _compiled[notify]
    return None


class SeccompGuard:
    """What the container backend holds: the profile per sandbox and, when notify is
    on, the listener that answers and records the dangerous calls."""

    def __init__(self, *, socket_path: Path | None, audit: AuditSink) -> None:
        self.listener = SeccompListener(socket_path, audit) if socket_path else None

    @property
    def notify(self) -> bool:
        return self.listener is not None

    def start(self) -> None:
        precompiled(self.profile("warm-up"))  # compile once, not on the first create
        if self.listener is not None:
            self.listener.start()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()

    def profile(self, sandbox_id: str) -> dict[str, Any]:
        if self.listener is None:
            return profile()
        return profile(listener_path=str(self.listener.socket_path), metadata=sandbox_id)

    def check_attached(self, sandbox_id: str) -> None:
        """Fail a create whose violations could not be recorded. crun's `run` succeeds
        only once its helper has queued the notify fd on our socket, so a live listener
        thread will take it; not waiting for that keeps ~a GIL switch off every create."""
        if self.listener is not None and not self.listener.alive():
            raise BackendError(f"the seccomp listener is not running; cannot monitor {sandbox_id}")

    def forget(self, sandbox_id: str) -> None:
        if self.listener is not None:
            self.listener.forget(sandbox_id)


# -- precompiled filter ---------------------------------------------------------------
# crun compiles linux.seccomp with libseccomp on every create (~2 ms for this profile);
# its annotation run.oci.seccomp_bpf_data loads a ready program instead. We compile once
# per platform with the same library and the same rule semantics as crun 1.8's
# libcrun_generate_seccomp (names unknown to libseccomp skipped; several conditions on
# one argument become separate rules, i.e. ORed), so the filter is identical.
_ACTIONS = {"SCMP_ACT_ALLOW": 0x7FFF0000, "SCMP_ACT_NOTIFY": 0x7FC00000}
_ERRNO_ACTION = 0x00050000
_OPS = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}
_ARCH_TOKENS = {"SCMP_ARCH_X86_64": 0xC000003E, "SCMP_ARCH_AARCH64": 0xC00000B7}


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _action(name: str, errno_ret: int) -> int:
    if name == "SCMP_ACT_ERRNO":
        return _ERRNO_ACTION | (errno_ret & 0xFFFF)
    return _ACTIONS[name]


SCMP_FLTATR_CTL_OPTIMIZE = 8  # libseccomp >= 2.5


def compile_bpf(prof: dict[str, Any]) -> bytes | None:
    """The seccomp program of ``prof`` (OCI linux.seccomp), or None when libseccomp is
    missing or refuses it (crun then compiles the JSON itself, as before)."""
    path = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    default = _action(prof["defaultAction"], prof.get("defaultErrnoRet", EPERM))
    ctx = lib.seccomp_init(default)
    if not ctx:
        return None
    try:
        # A binary tree over syscall numbers instead of libseccomp's default linear
        # list: every system call of a sandbox pays O(log n) comparisons, not O(n), so
        # rules added for rare calls (the kill family's argument patterns) cost the
        # hot ones nothing. Older libseccomp without the attribute: the linear list.
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2)
        for arch in prof.get("architectures", []):
            token = _ARCH_TOKENS.get(arch)
            if token is None:
                return None
            rc = lib.seccomp_arch_add(ctx, token)
            if rc < 0 and rc != -17:  # EEXIST: the native arch is already there
                return None
        for rule in prof["syscalls"]:
            action = _action(rule["action"], rule.get("errnoRet", EPERM))
            if action == default:
                continue
            cmps = [
                _ArgCmp(a["index"], _OPS[a["op"]], a.get("value", 0), a.get("valueTwo", 0))
                for a in rule.get("args", [])
            ]
            indexes = [c.arg for c in cmps]
            groups = [[c] for c in cmps] if len(set(indexes)) < len(indexes) else [cmps]
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr == -10101:  # __NR_SCMP_ERROR: unknown to this libseccomp
                    continue
                for group in groups:
                    array = (_ArgCmp * max(1, len(group)))(*group)
                    if lib.seccomp_rule_add_array(ctx, action, nr, len(group), array) < 0:
                        return None
        fd = os.memfd_create("dsec-seccomp", os.MFD_CLOEXEC)
        try:
            if lib.seccomp_export_bpf(ctx, fd) < 0:
                return None
            return os.pread(fd, 1 << 20, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
