"""E2B create requests -> our RunArgs, and our SandboxInfo -> E2B's answer shapes.

An E2B template names an image: ``templateID`` is taken as an image reference, ``base``
(E2B's default template) becomes a configurable default image, and a configurable
metadata key overrides the template with an image as slime does. A metadata key may
select the microVM backend. E2B's ``timeout`` becomes the idle TTL (ttl_running_stop):
our edge stops a sandbox nobody used for that long. The sandbox runs as uid 1000 named
``user`` with home ``/home/user`` (created at start when the image lacks them), E2B's
default user.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import ValidationError

from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import DSecContainerRunArgs, DSecMicroVMRunArgs, RunArgs
from dsec.errors import InvalidArgument

ENVD_VERSION = "0.5.7"  # the features we serve (octet-stream uploads; no file metadata)
TEMPLATE_LABEL = "e2b.template"
USER = "user"
HOME = "/home/user"
UID = "1000:1000"
DEFAULT_TIMEOUT = 300
MAX_TIMEOUT = 86400


@dataclass(frozen=True)
class E2BConfig:
    """What the operator chooses: the image of ``base``, and the metadata keys that
    pick an image and a backend. Read from the environment of `dsec up`."""

    default_image: str = "busybox:latest"
    image_metadata_key: str = "image"
    backend_metadata_key: str = "dsec.backend"
    memory_mb: int = 512
    cpu_cores: float = 1.0

    @classmethod
    def from_env(cls) -> E2BConfig:
        env = os.environ
        return cls(
            default_image=env.get("DSEC_E2B_DEFAULT_IMAGE", cls.default_image),
            image_metadata_key=env.get("DSEC_E2B_IMAGE_METADATA_KEY", cls.image_metadata_key),
            backend_metadata_key=env.get("DSEC_E2B_BACKEND_METADATA_KEY", cls.backend_metadata_key),
        )


def _str_map(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidArgument(f"{what} must be an object of strings")
    return dict(value)


def create_spec(body: dict[str, Any], config: E2BConfig, job_id: str) -> RunArgs:
    """The spec of a ``POST /v2/sandboxes`` body. ``job_id`` is the sandbox's own job:
    E2B's pause of one sandbox is our job pause (dsec.rl.jobs) of a job of one."""
    template = body.get("templateID")
    if not isinstance(template, str) or not template or len(template) > 256:
        raise InvalidArgument("templateID must be a non-empty string")
    metadata = _str_map(body.get("metadata"), "metadata")
    env = _str_map(body.get("envVars"), "envVars")
    timeout = body.get("timeout", DEFAULT_TIMEOUT)
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
        raise InvalidArgument("timeout must be a non-negative integer of seconds")
    image = metadata.get(config.image_metadata_key) or (
        config.default_image if template == "base" else template
    )
    backend = metadata.get(config.backend_metadata_key, "container")
    labels = {**metadata, TEMPLATE_LABEL: template}
    common: dict[str, Any] = {
        "memory_limit_mb": config.memory_mb,
        "cpu_cores_limit": config.cpu_cores,
        "ttl_running_stop": min(timeout, MAX_TIMEOUT) or DEFAULT_TIMEOUT,
        "init_user": UID,
        "env": {"HOME": HOME, "USER": USER, **env},
        "labels": labels,
        "job_id": job_id,
    }
    try:
        if backend == "microvm":
            spec: RunArgs = DSecMicroVMRunArgs(image=image, **common)
        elif backend == "container":
            spec = DSecContainerRunArgs(container_image=image, **common)
        else:
            raise InvalidArgument(f"metadata {config.backend_metadata_key!r}: unknown backend")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgument(f"{where}: {first['msg']}") from None
    return spec


E2B_STATES = {SandboxState.PAUSED: "paused"}


def _template(info: SandboxInfo) -> str:
    return info.labels.get(TEMPLATE_LABEL, info.image)


def _metadata(info: SandboxInfo) -> dict[str, str]:
    return {k: v for k, v in info.labels.items() if k != TEMPLATE_LABEL}


def created(info: SandboxInfo, token: str) -> dict[str, Any]:
    """E2B's ``Sandbox`` (create and connect answers)."""
    return {
        "templateID": _template(info),
        "sandboxID": info.id,
        "clientID": info.edge,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "domain": None,
    }


def _end_at(info: SandboxInfo) -> str:
    ttl = info.spec.ttl_running_stop or DEFAULT_TIMEOUT
    return (info.updated_at + timedelta(seconds=ttl)).isoformat()


def listed(info: SandboxInfo) -> dict[str, Any]:
    """E2B's ``ListedSandbox``."""
    return {
        "templateID": _template(info),
        "sandboxID": info.id,
        "clientID": info.edge,
        "startedAt": info.created_at.isoformat(),
        "endAt": _end_at(info),
        "cpuCount": max(1, int(info.spec.cpu_cores_limit)),
        "memoryMB": info.spec.memory_limit_mb,
        "diskSizeMB": info.spec.disk_limit_mb or 0,
        "state": E2B_STATES.get(info.state, "running"),
        "envdVersion": ENVD_VERSION,
        "metadata": _metadata(info),
    }


def detail(info: SandboxInfo, token: str | None) -> dict[str, Any]:
    """E2B's ``SandboxDetail``."""
    out = listed(info)
    if token is not None:
        out["envdAccessToken"] = token
    return out
