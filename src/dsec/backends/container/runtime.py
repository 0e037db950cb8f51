"""Invoking the OCI runtime (crun by default; runc or another by path).

All runtime calls go through the agent binary's ``crun-wrap`` mode, which on hybrid
cgroup hosts hides the v2 controllers from crun in a private mount namespace and mounts
the sandbox's root overlay there. A wrapper in C costs a fraction of
``unshare -m sh -c 'mount ...'`` on every create. Processes are started with
``posix_spawn`` (see dsec.spawn): forking the platform's interpreter cost ~4 ms each.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec import spawn
from dsec.backends.container.oci_spec import AGENT_FD
from dsec.errors import BackendError
from dsec.resources.cgroups import CgroupHost


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
    ) -> None:
        path = shutil.which(runtime) if "/" not in runtime else runtime
        if path is None or not os.access(path, os.X_OK):
            raise BackendError(
                f"OCI runtime {runtime!r} not found; install crun (apt-get install crun) "
                "or pass the path of another runtime"
            )
        self.path = path
        self.name = Path(path).name
        self.state_root = state_root
        self.wrapper = wrapper
        self.cgroups = cgroups
        self.empty_file = empty_file
        state_root.mkdir(parents=True, exist_ok=True)
        empty_file.parent.mkdir(parents=True, exist_ok=True)
        if not empty_file.exists():
            empty_file.write_bytes(b"")

    def _argv(self, args: list[str], *, overlay: tuple[Path, str] | None = None) -> list[str]:
        argv = [str(self.wrapper), "crun-wrap"]
        if overlay is not None:
            argv += ["--overlay-target", str(overlay[0]), "--overlay-data", overlay[1]]
        if self.cgroups.crun_needs_empty_unified and self.name == "crun":
            argv += ["--mask-cgroup2", str(self.empty_file)]
        argv += ["--", self.path, "--root", str(self.state_root), *args]
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
    ) -> None:
        """`run --detach` with the agent socket at fd 3 and the root overlay, which the
        wrapper mounts in crun's private mount namespace only: the host's mount table
        stays the same size however many sandboxes run."""
        argv = self._argv(
            [
                "run",
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
