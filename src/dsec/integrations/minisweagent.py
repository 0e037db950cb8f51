"""A mini-swe-agent environment backed by a DSec sandbox.

mini-swe-agent loads its environment by import path, so a config needs one line::

    environment:
      environment_class: dsec.integrations.minisweagent.DSecEnvironment
      image: debian-python:bookworm      # any image the platform has
      cwd: /work

The platform is the SDK's (``DSEC_URL`` / ``DSEC_API_KEY``, or ``url`` / ``api_key``).
It follows mini-swe-agent's own ``LocalEnvironment`` contract: ``execute`` answers
``{"output", "returncode", "exception_info"}`` with stderr merged into stdout, and a
first output line ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit 0) raises
``Submitted`` with the rest as the submission. Every command runs in the sandbox, never
on the host, under the spec's limits, egress rules and audit.
"""

from __future__ import annotations

import contextlib
import platform as host_platform
from typing import Any

from minisweagent.exceptions import Submitted
from pydantic import BaseModel, Field

from dsec.api.spec import DSecContainerRunArgs
from dsec.errors import DSecError
from dsec.sdk.sync import DSecSyncClient, SyncSandbox

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class DSecEnvironmentConfig(BaseModel):
    """What the sandbox is, and how commands run in it."""

    image: str = "debian-python:bookworm"
    cwd: str = "/"
    env: dict[str, str] = Field(default_factory=dict)
    timeout: int = 30  # per command, seconds
    memory_limit_mb: int = 1024
    cpu_cores_limit: float = 1.0
    ttl_running_stop: int = 3600  # idle seconds before the platform stops it
    network_rules: dict[str, bool] = Field(default_factory=dict)
    create_timeout: float = 120.0
    url: str | None = None
    api_key: str | None = None


class DSecEnvironment:
    """One sandbox for one agent run; ``stop()`` (or garbage collection) ends it."""

    def __init__(
        self, *, config_class: type[DSecEnvironmentConfig] = DSecEnvironmentConfig, **kwargs: Any
    ) -> None:
        self.config = config_class(**kwargs)
        self._stopped = True  # until the sandbox exists: nothing for stop() to end
        self._client = DSecSyncClient(self.config.url, self.config.api_key)
        try:
            self.sandbox: SyncSandbox = self._client.run_container(
                DSecContainerRunArgs(
                    container_image=self.config.image,
                    memory_limit_mb=self.config.memory_limit_mb,
                    cpu_cores_limit=self.config.cpu_cores_limit,
                    ttl_running_stop=self.config.ttl_running_stop,
                    network_rules=self.config.network_rules,
                    init_user="root",
                    labels={"dsec.integration": "mini-swe-agent"},
                ),
                timeout=self.config.create_timeout,
            )
        except BaseException:
            self._client.close()
            raise
        self._stopped = False

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox (mini-swe-agent's contract)."""
        command = str(action.get("command", ""))
        limit = timeout or self.config.timeout
        try:
            r = self.sandbox.run_shell(
                "exec 2>&1\n" + command,
                timeout=limit,
                env=self.config.env,
                workdir=cwd or self.config.cwd,
            )
            output: dict[str, Any] = {
                "output": r.stdout,
                "returncode": r.exit_code,
                "exception_info": "",
            }
            if r.timed_out:
                output |= {
                    "returncode": -1,
                    "exception_info": f"the command timed out after {limit} s",
                    "extra": {"exception_type": "TimeoutExpired"},
                }
        except DSecError as exc:
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {exc.message}",
                "extra": {"exception_type": type(exc).__name__, "exception": exc.message},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = str(output.get("output", "")).lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the sandbox's id and image, and the caller's variables (the
        templates render ``{{system}}`` etc. from the host's uname, as LocalEnvironment)."""
        base = self.config.model_dump(exclude={"api_key"})
        return base | host_platform.uname()._asdict() | {"sandbox_id": self.sandbox.id} | kwargs

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json", exclude={"api_key"}),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                    "sandbox_id": self.sandbox.id,
                }
            }
        }

    def stop(self) -> None:
        """End the sandbox and the client; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.sandbox.stop()
        finally:
            self._client.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort, e.g. at interpreter exit
            self.stop()
