"""The data path of every backend whose sandboxes run ``dsec-init``: commands, files
and sessions go to the in-sandbox agent over one unix socket path per sandbox.

A container's agent listens on that path directly; a microVM's path is served by the
edge's end of the virtio-serial channel mux (dsec.guest.channel), which carries each
connection into the guest unchanged. Either way the agent protocol, and so this code,
is the same: written once here, so that a behaviour of ``exec`` or of the command
environment cannot differ between backends.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

from dsec.api.exec import ExecRequest, ExecResult
from dsec.backends.base import SandboxRecord
from dsec.errors import InvalidArgument
from dsec.images.extract import DEFAULT_PATH
from dsec.sessions.agent_client import AgentClient

__all__ = ["DEFAULT_PATH", "AgentDataPath", "image_env"]


def image_env(config: dict[str, Any]) -> dict[str, str]:
    """The environment an image's config declares (OCI ``Env`` list or a mapping)."""
    raw = config.get("env") or config.get("Env") or {}
    env: dict[str, str] = {}
    if isinstance(raw, dict):
        env.update({str(k): str(v) for k, v in raw.items()})
    elif isinstance(raw, list):
        for item in raw:
            key, sep, val = str(item).partition("=")
            if sep:
                env[key] = val
    return env


class AgentDataPath:
    """Mixin for a ``Backend``: exec, files, sessions through ``agent_socket``."""

    @abstractmethod
    def agent_socket(self, sandbox_id: str) -> Path:
        """Where the sandbox's agent is reached from the host."""

    def agent(self, rec: SandboxRecord) -> AgentClient:
        return AgentClient(self.agent_socket(rec.id))

    def command_env(self, rec: SandboxRecord, extra: dict[str, str]) -> dict[str, str]:
        """Image, then spec, then ``extra``: what a command starts with."""
        env = {"PATH": DEFAULT_PATH}
        env.update(image_env(rec.image.config))
        env.update(rec.spec.env)
        env.update(extra)
        return env

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
        argv = ["/bin/sh", "-c", req.command] if isinstance(req.command, str) else req.command
        res = await self.agent(rec).exec(
            argv,
            env=self.command_env(rec, req.env),
            cwd=req.workdir or rec.default_workdir,
            user=req.user or rec.default_user,
            timeout=req.timeout,
            max_output=req.max_output_bytes,
            stdin=req.stdin.encode() if req.stdin is not None else None,
        )
        return res.as_exec_result()

    async def read_file(self, rec: SandboxRecord, path: str, *, max_bytes: int) -> bytes:
        return await self.agent(rec).read_file(path, user=rec.spec.init_user, max_bytes=max_bytes)

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, *, mode: int) -> None:
        await self.agent(rec).write_file(path, data, user=rec.spec.init_user, mode=mode)

    async def check_init_user(self, rec_id: str, user: str) -> None:
        """Fail at create, not at the first command, if ``user`` cannot run commands."""
        if user in ("root", "0", "0:0"):
            return
        res = await AgentClient(self.agent_socket(rec_id)).exec(
            ["true"],
            env={"PATH": DEFAULT_PATH},
            cwd="/",
            user=user,
            timeout=10,
            max_output=4096,
            stdin=None,
        )
        if res.exit_code != 0:
            raise InvalidArgument(f"init_user {user!r} cannot run commands")
