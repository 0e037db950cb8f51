"""Invoking the OCI runtime (crun by default; runc or another by path).

All runtime calls go through the agent binary's ``crun-wrap`` mode, which places the
listening agent socket at fd 3 (``--preserve-fds``) and, on hybrid cgroup hosts,
hides the v2 controllers from crun in a private mount namespace. A wrapper in C costs
a fraction of ``unshare -m sh -c 'mount --bind ...'`` on every create.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    def _argv(self, args: list[str], *, agent_fd: int | None) -> list[str]:
        argv = [str(self.wrapper), "crun-wrap"]
        if agent_fd is not None:
            argv += ["--fd", str(agent_fd)]
        if self.cgroups.crun_needs_empty_unified and self.name == "crun":
            argv += ["--mask-cgroup2", str(self.empty_file)]
        argv += ["--", self.path, "--root", str(self.state_root), *args]
        return argv

    async def call(
        self, *args: str, agent_fd: int | None = None, timeout: float = 60.0
    ) -> RuntimeResult:
        argv = self._argv(list(args), agent_fd=agent_fd)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(agent_fd,) if agent_fd is not None else (),
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BackendError(
                f"{self.name} {args[0]} did not finish within {timeout:.0f}s"
            ) from None
        return RuntimeResult(
            proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )

    async def check(self, *args: str, agent_fd: int | None = None, timeout: float = 60.0) -> str:
        res = await self.call(*args, agent_fd=agent_fd, timeout=timeout)
        if res.returncode != 0:
            raise BackendError(
                f"{self.name} {args[0]} failed (exit {res.returncode}): "
                f"{(res.stderr or res.stdout).strip()[-2000:]}"
            )
        return res.stdout

    async def run_detached(
        self, container_id: str, bundle: Path, pid_file: Path, agent_fd: int
    ) -> None:
        """`run --detach`: the container inherits crun's stdio, so it must not be a pipe
        we wait on (it would never reach EOF); a log file in the bundle takes both."""
        log_path = bundle / "runtime.log"
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
            agent_fd=agent_fd,
        )
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                pass_fds=(agent_fd,),
            )
        finally:
            os.close(log_fd)
        try:
            code = await asyncio.wait_for(proc.wait(), 60.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BackendError(
                f"{self.name} run {container_id} did not finish within 60s"
            ) from None
        if code != 0:
            text = log_path.read_text(errors="replace").strip()[-2000:]
            raise BackendError(f"{self.name} run failed (exit {code}): {text or 'no output'}")

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
