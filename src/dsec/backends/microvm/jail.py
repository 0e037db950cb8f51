"""Confine the QEMU process (the jailer idea): its own uid, no capabilities, its own
namespaces and only its own files reachable.

QEMU parses guest-controlled device state; a guest that breaks out of QEMU must land
in a process that can do as little as possible. ``dsec-vmjail`` (C, next to this file)
does it between our spawn and QEMU's exec, so the pid we track stays QEMU's:

- cgroup: the pid is written into the sandbox's cgroups first (all of QEMU's memory,
  including its own overhead, is charged to the sandbox);
- uid/gid = ``uid_base + pid``: unique among live VMs with no allocation table and no
  /etc/passwd entries (a pid cannot be shared by two live processes), so one QEMU can
  neither signal nor ptrace another; files it must write are chowned to it;
- mount namespace with an empty read-only tmpfs root holding /usr, three /dev nodes,
  and exactly the kernel, initrd, drives and its socket directory, each bound at its
  own path (the command line is unchanged); no /proc, /sys, /home, /var;
- empty network namespace (the tap arrives as an inherited fd), ipc and uts namespaces;
- every capability dropped (bounding set too) and no_new_privs; QEMU's own
  ``-sandbox`` seccomp filter then denies spawn, setuid and resource control.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec import native
from dsec.agent.build import CFLAGS
from dsec.backends.microvm.qemu import VMConfig
from dsec.errors import BackendError

SOURCE = Path(__file__).with_name("dsec-vmjail.c")
# Far above login users (1000+) and the usual subordinate-id ranges (100000+ per
# user); pid_max is at most 2^22, so base + pid stays below 2^31.
UID_BASE = 1_500_000_000


def jail_binary() -> Path:
    return native.binary(
        SOURCE, name="dsec-vmjail", subdir="microvm", cflags=CFLAGS, what="the QEMU jail"
    )


def vm_uid(pid: int, uid_base: int = UID_BASE) -> int:
    """The uid (and gid) the jailed QEMU with this pid runs as."""
    return uid_base + pid


@dataclass(frozen=True)
class Jail:
    """How to confine one QEMU. ``cgroup_dirs``: one directory per hierarchy (e.g.
    ``CgroupHost.member_dirs(rel)``); ``netns``: put QEMU in an empty network namespace."""

    cgroup_dirs: tuple[Path, ...] = ()
    netns: bool = True
    uid_base: int = UID_BASE
    extra_ro: tuple[Path, ...] = ()
    own_ro: tuple[Path, ...] = ()
    """Read-only files chowned to this QEMU's uid (a verifier's private protected
    images, root 0600 otherwise)."""
    die_with_parent: bool = False
    """SIGKILL QEMU when the edge process dies: for VMs that are not sandboxes (a
    template being saved), which nothing would re-adopt."""
    as_uid: int | None = None
    """Run as this uid (>= ``uid_base``) instead of ``uid_base + pid``: a helper that
    works on one VM's files for it (qemu-img at a full VM's snapshot) runs as that VM's
    QEMU, reaching what QEMU can and nothing more (``vm_uid(qemu_pid)``)."""

    def prefix(self, config: VMConfig) -> list[str]:
        """The launcher argv to put before QEMU's (``QemuProcess.launch(prefix=)``).

        QEMU gets read access to the kernel, initrd and read-only drives, write
        access to the writable drives and to the directories of its two sockets
        (chowned to its uid, as are the writable drives)."""
        ro = [config.kernel, *([config.initrd] if config.initrd else [])]
        ro += [d.path for d in config.drives if d.readonly]
        rw_files = [d.path for d in config.drives if not d.readonly]
        socket_dirs = sorted({config.qmp_socket.parent, config.agent_socket.parent})
        return self.prefix_for(ro=ro, rw=[*rw_files, *socket_dirs], kvm=config.accel == "kvm")

    def prefix_for(self, *, ro: Sequence[Path], rw: Sequence[Path], kvm: bool) -> list[str]:
        """The launcher argv for a QEMU of any machine type: ``ro`` files it may read
        (kernel, initrd, read-only drives: ``extra_ro`` is added), ``rw`` files and
        directories it may write, chowned to its uid (writable drives, the
        directory of its sockets), ``/dev/kvm`` with ``kvm``. ``prefix`` derives
        these from a microVM's config; dsec.backends.fullvm from its own."""
        argv = [str(jail_binary()), "--uid-base", str(self.uid_base)]
        if self.as_uid is not None:
            if self.as_uid < self.uid_base:
                raise BackendError(f"a jailed uid must be >= {self.uid_base}: {self.as_uid}")
            argv += ["--as-uid", str(self.as_uid)]
        if self.netns:
            argv.append("--netns")
        if self.die_with_parent:
            argv.append("--die-with-parent")
        for d in self.cgroup_dirs:
            argv += ["--cgroup", str(d)]
        for path in [*ro, *self.extra_ro]:
            argv += ["--ro", os.path.realpath(path)]
        for path in self.own_ro:
            argv += ["--own", os.path.realpath(path)]
        for path in rw:
            real = os.path.realpath(path)
            argv += ["--rw", real, "--own", real]
        if kvm:
            argv += ["--dev", "/dev/kvm", "--group", str(kvm_group())]
        argv.append("--")
        return argv


def kvm_group(path: str = "/dev/kvm") -> int:
    """The group that grants /dev/kvm to a jailed QEMU (its supplementary group).

    Never the root group, and only if the device is group read-write (Debian:
    ``root:kvm 0660``); otherwise a jailed QEMU cannot use KVM: say how to fix it."""
    st = os.stat(path)
    if st.st_gid == 0 or st.st_mode & 0o060 != 0o060:
        raise BackendError(
            f"{path} is mode {st.st_mode & 0o777:o} group {st.st_gid}: a jailed QEMU needs "
            "it group read-write for a non-root group (chgrp kvm /dev/kvm; chmod 0660)"
        )
    return st.st_gid


def jail_argv(jail: Jail | None, config: VMConfig) -> Sequence[str]:
    """``jail.prefix(config)``, or nothing for an unconfined QEMU (tests, debugging)."""
    return jail.prefix(config) if jail is not None else ()
