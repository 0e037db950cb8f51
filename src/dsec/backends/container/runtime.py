"""Invoking the OCI runtime (crun by default; runc or another by path).

All runtime calls go through the agent binary's ``crun-wrap`` mode, which on hybrid
cgroup hosts hides the v2 controllers from crun in a private mount namespace and mounts
the sandbox's root overlay there. A wrapper in C costs a fraction of
``unshare -m sh -c 'mount ...'`` on every create. Processes are started with
``posix_spawn`` (see dsec.spawn): forking the platform's interpreter cost ~4 ms each.
crun runs from one sealed in-memory copy of itself (it would otherwise copy itself on
every call) and keeps its state on a tmpfs (see open()).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec import linux, spawn
from dsec.backends.container.cgview import CgroupView
from dsec.backends.container.oci_spec import AGENT_FD, DEV_TMPFS_OPTIONS
from dsec.errors import BackendError
from dsec.resources.cgroups import CgroupHost

# crun keeps ~28 KiB per container in its state (status, config.json, the seccomp
# program; each file a page at least): 256 MiB filled at 9,362 sandboxes ("write to
# seccomp fd", issue 19). A tmpfs holds only what is written, so the cap is for
# pid_max (32,768) containers at 64 KiB each.
STATE_OPTIONS = "mode=0700,size=2g"
# crun's cloned_binary.c: a binary running from a memfd with exactly these seals is
# not copied again.
_CRUN_MEMFD_NAME = "crun_cloned:/proc/self/exe"
_CRUN_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
# Runtimes whose /dev the wrapper mounts and fills (one tmpfs for /dev and /dev/shm,
# oci_spec.DEV_TMPFS_OPTIONS): checked for crun 1.8.1, which resolves bind sources in
# the wrapper's mount namespace and creates no device node in a /dev that is a bind.
# Others (runsc has its own /dev) keep their own /dev and /dev/shm mounts.
SHARED_DEV_RUNTIMES = frozenset({"crun"})
# Runtimes with ``run --no-new-keyring``: the wrapper gives each container an anonymous
# session keyring instead of the runtime's named one, whose name lookup walks every
# keyring on the host in each create (see crun-wrap --session-keyring in dsec-init.c).
OWN_KEYRING_RUNTIMES = frozenset({"crun", "runc"})
DEV_DIR_NAME = "dev"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeResult:
    returncode: int
    stdout: str
    stderr: str


class OCIRuntime:
    def __init__(
        self,
        *,
        runtime: str,
        state_root: Path,
        wrapper: Path,
        cgroups: CgroupHost,
        empty_file: Path,
        cgroup_parent: str | None = None,
    ) -> None:
        """``cgroup_parent``: where the sandboxes' cgroups go (``dsec/<edge>``); given,
        crun sees only the hierarchies a sandbox joins (CgroupView)."""
        path = shutil.which(runtime) if "/" not in runtime else runtime
        if path is None or not os.access(path, os.X_OK):
            raise BackendError(
                f"OCI runtime {runtime!r} not found; install crun (apt-get install crun) "
                "or pass the path of another runtime"
            )
        self.path = path
        self.name = Path(path).name
        # What the wrapper executes: ``path``, or a sealed in-memory copy of it (open()).
        self.exec_path = path
        self._sealed_fd: int | None = None
        self._sealed_from: tuple[int, int, int] | None = None  # (inode, mtime, size)
        self.state_root = state_root
        self.wrapper = wrapper
        self.cgroups = cgroups
        self.empty_file = empty_file
        self.view = (
            CgroupView(state_root.with_name(state_root.name + ".cgroups"), cgroups, cgroup_parent)
            if cgroup_parent is not None and self.name == "crun"
            else None
        )
        state_root.mkdir(parents=True, exist_ok=True)
        empty_file.parent.mkdir(parents=True, exist_ok=True)
        if not empty_file.exists():
            empty_file.write_bytes(b"")

    def open(self) -> None:
        """Keep the runtime's state on a tmpfs of its own.

        crun creates and deletes ~10 files per sandbox there; on the data disk (ext4
        here, which skips recently deleted inodes when it allocates one) that cost
        ~3.4 ms of CPU per sandbox lifecycle in a burst, measured. The state only
        describes live containers, which a reboot ends anyway; an edge restart finds the
        mount still there. State that already sits on disk (containers started by an
        older version) is left where it is, not hidden under a new mount."""
        if self.name == "crun":
            self._seal_binary()
        if self.view is not None:
            self.view.open()
        flags = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC
        if linux.is_mounted(self.state_root):
            # One an older edge mounted smaller: grow it (a remount keeps the files).
            with contextlib.suppress(OSError):
                remount = flags | linux.MS_REMOUNT
                linux.mount("tmpfs", self.state_root, "tmpfs", remount, STATE_OPTIONS)
            return
        if self.list_ids():
            return
        linux.mount("tmpfs", self.state_root, "tmpfs", flags, STATE_OPTIONS)

    def close(self) -> None:
        """Unmount the state tmpfs once no container is left in it (else it stays for
        the next edge process, like the sandboxes)."""
        if not self.list_ids() and linux.is_mounted(self.state_root):
            linux.umount(self.state_root, detach=True)
        if self.view is not None:
            self.view.close()
        if self._sealed_fd is not None:
            with contextlib.suppress(OSError):
                self._exec_link().unlink()
            self._drop_sealed()

    def _exec_link(self) -> Path:
        return self.state_root.with_name(self.state_root.name + ".exe") / self.name

    def _seal_binary(self) -> None:
        """Run crun from one sealed in-memory copy of itself that we hold.

        Against CVE-2019-5736 every crun call first copies its own binary into a
        sealed memfd (or a read-only bind mount of a temp file) and re-executes itself
        from it, unless it already runs from a fully sealed memfd: ~1.2 ms of CPU of the
        ~2.4 ms of each call, measured, two calls per sandbox. One sealed copy made
        here protects the same way (crun's own check accepts it: nothing can write to
        it); the wrapper executes it through a symlink named like the runtime (the
        process name stays ``crun`` for the orphan reaper). If it does not work here,
        the plain binary is used."""
        identity = _identity(self.path)  # before the copy: a later change copies again
        fd = os.memfd_create(_CRUN_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            with open(self.path, "rb") as src:
                os.write(fd, src.read())
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _CRUN_SEALS)
            link = self._exec_link()
            link.parent.mkdir(mode=0o700, exist_ok=True)
            tmp = link.with_name(f".{link.name}.{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            os.symlink(f"/proc/{os.getpid()}/fd/{fd}", tmp)
            os.replace(tmp, link)
            probe = subprocess.run(
                [str(link), "--version"], capture_output=True, timeout=30, check=False
            )
            if probe.returncode != 0:
                raise OSError(f"sealed copy does not run: {probe.stderr[-200:]!r}")
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("running %s from its own file (no sealed copy: %s)", self.path, exc)
            os.close(fd)
            self._drop_sealed()  # an outdated copy is not kept either
            return
        self._drop_sealed()  # a re-seal after an upgrade: the old copy goes
        self._sealed_fd, self._sealed_from = fd, identity
        self.exec_path = str(link)

    def _drop_sealed(self) -> None:
        if self._sealed_fd is not None:
            os.close(self._sealed_fd)
            self._sealed_fd = None
        self.exec_path = self.path

    def dev_tmpfs(self, bundle: Path) -> Path | None:
        """The empty directory under a sandbox's bundle that the wrapper mounts its
        /dev tmpfs on, in the wrapper's private mount namespace only (on the host it
        stays empty); None when this runtime mounts /dev itself. The caller creates
        it beside rootfs and passes it to build_config() and run_detached()."""
        return bundle / DEV_DIR_NAME if self.name in SHARED_DEV_RUNTIMES else None

    def _argv(
        self,
        args: list[str],
        *,
        overlay: tuple[Path, str] | None = None,
        dev_tmpfs: Path | None = None,
        starts_container: bool = False,
    ) -> list[str]:
        if self._sealed_fd is not None and _identity(self.path) != self._sealed_from:
            # The binary was replaced (a package upgrade, say a CVE fix): copy it anew,
            # or the edge would run the old one until it restarts. One stat per call.
            self._seal_binary()
        argv = [str(self.wrapper), "crun-wrap"]
        if overlay is not None:
            argv += ["--overlay-target", str(overlay[0]), "--overlay-data", overlay[1]]
        if dev_tmpfs is not None:
            argv += ["--dev-tmpfs", str(dev_tmpfs), "--dev-data", DEV_TMPFS_OPTIONS]
        if starts_container and self.name in OWN_KEYRING_RUNTIMES:
            argv += ["--session-keyring", "new"]
        if self.view is not None and self.view.in_use:
            # no unified hierarchy in the view: crun runs in v1 mode, needs no mask
            argv += self.view.argv(starts_container=starts_container)
        elif self.cgroups.crun_needs_empty_unified and self.name == "crun":
            argv += ["--mask-cgroup2", str(self.empty_file)]
        argv += ["--", self.exec_path, "--root", str(self.state_root), *args]
        return argv

    async def call(self, *args: str, timeout: float = 60.0) -> RuntimeResult:
        try:
            res = await spawn.run(self._argv(list(args)), timeout=timeout)
        except TimeoutError:
            raise BackendError(
                f"{self.name} {args[0]} did not finish within {timeout:.0f}s"
            ) from None
        return RuntimeResult(res.returncode, res.stdout, res.stderr)

    async def check(self, *args: str, timeout: float = 60.0) -> str:
        res = await self.call(*args, timeout=timeout)
        if res.returncode != 0:
            raise BackendError(
                f"{self.name} {args[0]} failed (exit {res.returncode}): "
                f"{(res.stderr or res.stdout).strip()[-2000:]}"
            )
        return res.stdout

    async def run_detached(
        self,
        container_id: str,
        bundle: Path,
        pid_file: Path,
        agent_fd: int,
        overlay: tuple[Path, str],
        dev_tmpfs: Path | None = None,
    ) -> None:
        """`run --detach` with the agent socket at fd 3 and the root overlay, which the
        wrapper mounts in crun's private mount namespace only: the host's mount table
        stays the same size however many sandboxes run. ``dev_tmpfs``: dev_tmpfs()'s
        directory, where the wrapper mounts the /dev the config binds (the same one
        build_config() was given)."""
        argv = self._argv(
            [
                "run",
                *(["--no-new-keyring"] if self.name in OWN_KEYRING_RUNTIMES else []),
                "--detach",
                "--preserve-fds",
                "1",
                "--bundle",
                str(bundle),
                "--pid-file",
                str(pid_file),
                container_id,
            ],
            overlay=overlay,
            dev_tmpfs=dev_tmpfs,
            starts_container=True,
        )
        try:
            res = await spawn.run(argv, pass_fd=(agent_fd, AGENT_FD), timeout=60.0)
        except TimeoutError:
            raise BackendError(
                f"{self.name} run {container_id} did not finish within 60s"
            ) from None
        if res.returncode != 0:
            text = (res.stderr or res.stdout).strip()[-2000:]
            raise BackendError(
                f"{self.name} run failed (exit {res.returncode}): {text or 'no output'}"
            )

    async def delete(self, container_id: str) -> None:
        """Kill (if running) and delete; a container that is already gone is fine."""
        res = await self.call("delete", "--force", container_id)
        if res.returncode != 0 and not _is_missing(res.stderr):
            raise BackendError(f"{self.name} delete {container_id} failed: {res.stderr.strip()}")

    def forget(self, container_id: str) -> bool:
        """Remove the state of a container whose processes are all gone (its cgroup
        was emptied by the caller) without starting the runtime: for crun, ``delete``
        of a dead container removes its cgroups (the caller does) and this directory,
        and costs a fork and exec (~2 ms of CPU). False: not crun, call delete()."""
        if self.name != "crun":
            return False
        state = self.state_root / container_id
        if os.sep in container_id or container_id in ("", ".", ".."):
            return False
        shutil.rmtree(state, ignore_errors=True)
        return not state.exists()

    async def state(self, container_id: str) -> dict[str, Any] | None:
        res = await self.call("state", container_id)
        if res.returncode != 0:
            if _is_missing(res.stderr):
                return None
            raise BackendError(f"{self.name} state {container_id} failed: {res.stderr.strip()}")
        parsed: dict[str, Any] = json.loads(res.stdout)
        return parsed

    def list_ids(self) -> set[str]:
        """Containers this runtime root knows (its state directories), without a fork."""
        try:
            return {e.name for e in os.scandir(self.state_root) if e.is_dir()}
        except FileNotFoundError:
            return set()


def _is_missing(stderr: str) -> bool:
    low = stderr.lower()
    return "does not exist" in low or "no such file" in low or "not found" in low


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)
