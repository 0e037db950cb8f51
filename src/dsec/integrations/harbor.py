"""A Harbor environment backed by a DSec sandbox.

Harbor (``pip install harbor``, Python >= 3.12) loads a custom environment by import
path, so a job needs one flag::

    harbor run -p path/to/task --agent oracle \\
        --env dsec.integrations.harbor:DSecEnvironment \\
        --ek memory_limit_mb=2048 --ek 'images={"python:3.12-slim": "debian-python:bookworm"}'

or ``environment: {import_path: "dsec.integrations.harbor:DSecEnvironment", kwargs: {...}}``
in a job or trial config. The platform is the SDK's (``DSEC_URL`` / ``DSEC_API_KEY``, or
what ``dsec up`` saved; ``url`` / ``api_key`` kwargs override them).

What a task's ``[environment]`` means here:

- ``docker_image``: the sandbox's image, mapped to one of the platform's image refs (the
  ``image`` kwarg overrides every task, the ``images`` kwarg maps Docker refs, else the
  ref itself with Docker Hub's ``docker.io/library/`` prefix dropped). The platform runs
  EROFS images it imported or built (``dsec image import``/``build``); it does not build
  Dockerfiles, so a task with only ``environment/Dockerfile`` (or a compose file, or
  ``force_build`` over a Dockerfile) is refused with ``Unsupported`` before any sandbox.
- ``cpus`` / ``memory_mb`` / ``storage_mb``: the spec's CPU, memory and disk limits.
- The network policy maps to egress rules (``dsec.net``), switched at run time with
  ``update_network``: ``no-network`` is no rule; ``allowlist`` takes IPv4 addresses and
  CIDRs as raw rules and host names only through the ``host_services`` kwarg (a host
  name to a service of the platform's catalog, e.g. ``{"pypi.org": "pypi"}``), since a
  service opens a catalog entry's names, not one host; ``public`` is the
  ``public_network_rules`` kwarg (default: none), because DSec has no open internet by
  design (DNS answers allowed names only).

Every command runs in the sandbox under the spec's limits, egress rules and audit;
files move through the SDK's data path (tar streams for directories).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ipaddress
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import (
    COMPOSE_FILE_NAME,
    DOCKERFILE_NAME,
    effective_exec_cwd,
)
from harbor.models.task.config import (
    EnvironmentConfig,
    NetworkAllowlistEntryType,
    NetworkMode,
    NetworkPolicy,
    classify_network_allowlist_entry,
)
from harbor.models.trial.paths import TrialPaths
from pydantic import ValidationError
from typing_extensions import override

from dsec.api.spec import DSecContainerRunArgs
from dsec.errors import FileNotFound, InvalidArgument, SandboxNotFound, Timeout, Unsupported
from dsec.sdk.client import DSecClient, Sandbox

ENVIRONMENT_TYPE = "dsec"
#: A rule that allows nothing: a sandbox created with rules (even this one) can have
#: them replaced later, which a sandbox created without any cannot.
_NOTHING = {"host": False}
_DOCKER_HUB_PREFIXES = ("docker.io/library/", "index.docker.io/library/", "docker.io/")


def map_image(
    docker_image: str | None, *, image: str | None, images: Mapping[str, str]
) -> str | None:
    """The platform image ref for a task's ``docker_image`` (None: the task has none)."""
    if image:
        return image
    if not docker_image:
        return None
    if docker_image in images:
        return images[docker_image]
    ref = docker_image
    for prefix in _DOCKER_HUB_PREFIXES:
        if ref.startswith(prefix):
            ref = ref[len(prefix) :]
            break
    return images.get(ref, ref)


def network_rules(
    policy: NetworkPolicy,
    *,
    public_rules: Mapping[str, bool],
    host_services: Mapping[str, str],
) -> dict[str, bool]:
    """Harbor's network policy as DSec egress rules (InvalidArgument if it has none)."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return dict(_NOTHING)
    if policy.network_mode == NetworkMode.PUBLIC:
        return dict(public_rules) or dict(_NOTHING)
    rules: dict[str, bool] = {}
    for entry in policy.allowed_hosts:
        kind = classify_network_allowlist_entry(entry)
        if kind == NetworkAllowlistEntryType.IPV4_ADDRESS:
            rules[entry] = True
        elif kind == NetworkAllowlistEntryType.IPV4_CIDR:
            rules[str(ipaddress.IPv4Network(entry))] = True
        elif entry in host_services:
            rules[host_services[entry]] = True
        else:
            raise InvalidArgument(
                f"network allowlist entry {entry!r} ({kind.value}) has no DSec egress rule: "
                "map host names to services of the platform's catalog with the "
                "host_services kwarg (e.g. {'pypi.org': 'pypi'}); IPv6 is not supported"
            )
    return rules or dict(_NOTHING)


class DSecEnvironment(BaseEnvironment):
    """One DSec container sandbox per Harbor environment (agent or verifier).

    Besides the abstract methods, it overrides and calls the hooks BaseEnvironment
    keeps for its providers (``_validate_definition``, ``_apply_network_policy``,
    ``_merge_env``, ``_resolve_user``, ``_effective_*``, ``_output_callback``, ...), as
    Harbor's own providers do: they are the subclass contract, not private state.
    """

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: TrialPaths,
        task_env_config: EnvironmentConfig,
        *args: Any,
        url: str | None = None,
        api_key: str | None = None,
        image: str | None = None,
        images: Mapping[str, str] | None = None,
        host_services: Mapping[str, str] | None = None,
        public_network_rules: Mapping[str, bool] | None = None,
        memory_limit_mb: int = 1024,
        cpu_cores_limit: float = 1.0,
        ttl_running_stop: int = 3600,
        create_timeout: float = 300.0,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("mounts"):
            raise Unsupported(
                "host mounts are not supported by DSec: nothing of the host is mounted into "
                "a sandbox; files move with upload/download"
            )
        # Read by the base class's validators during its __init__.
        self._image = image
        self._images = dict(images or {})
        self._host_services = dict(host_services or {})
        self._public_rules = dict(public_network_rules or {})
        self._default_memory_mb = memory_limit_mb
        self._default_cpus = cpu_cores_limit
        self._ttl_running_stop = ttl_running_stop
        self._create_timeout = create_timeout
        self._url = url
        self._api_key = api_key
        self._client: DSecClient | None = None
        #: Names this environment's sandbox, also when its create reply never came.
        self._labels = {
            "dsec.integration": "harbor",
            "dsec.harbor.env": uuid.uuid4().hex,
            "harbor.session": session_id[:256],
        }
        self._sandbox: Sandbox | None = None
        super().__init__(
            environment_dir,
            environment_name,
            session_id,
            trial_paths,
            task_env_config,
            *args,
            **kwargs,
        )

    @staticmethod
    @override
    def type() -> str:
        return ENVIRONMENT_TYPE

    @classmethod
    @override
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    @property
    @override
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=bool(self._host_services),
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            dynamic_network_policy=True,
        )

    @property
    def sandbox(self) -> Sandbox:
        """The running sandbox (``SandboxNotFound`` before ``start`` or after ``stop``)."""
        if self._sandbox is None:
            raise SandboxNotFound("the DSec environment is not started (or already stopped)")
        return self._sandbox

    @property
    def image(self) -> str | None:
        """The platform image ref this environment runs."""
        return map_image(self.task_env_config.docker_image, image=self._image, images=self._images)

    @override
    def _validate_definition(self) -> None:
        if (self.environment_dir / COMPOSE_FILE_NAME).exists() or self.extra_docker_compose_paths:
            raise Unsupported(
                "Docker Compose task environments are not supported by DSec: one sandbox "
                "per environment, no sidecar services"
            )
        if self.image is None and not (self.environment_dir / DOCKERFILE_NAME).exists():
            raise InvalidArgument(
                f"task environment {self.environment_dir} has no docker_image: set "
                "[environment].docker_image to an image the platform has, or pass image=..."
            )
        if self.image is None:
            raise Unsupported(
                "DSec does not build Dockerfiles (its images are EROFS layers the platform "
                "imported or built): set [environment].docker_image to a prebuilt image the "
                "platform has, or pass the image/images kwargs"
            )

    def _rules(self, policy: NetworkPolicy) -> dict[str, bool]:
        return network_rules(
            policy, public_rules=self._public_rules, host_services=self._host_services
        )

    def _spec(self, image: str) -> DSecContainerRunArgs:
        """The task's resources (after Harbor's overrides and enforcement modes) as limits."""
        cpus = self._effective_cpus
        return DSecContainerRunArgs(
            container_image=image,
            memory_limit_mb=self._effective_memory_mb or self._default_memory_mb,
            cpu_cores_limit=float(cpus) if cpus else self._default_cpus,
            disk_limit_mb=self._effective_storage_mb,
            ttl_running_stop=self._ttl_running_stop,
            network_rules=self._rules(self.network_policy),
            env=self._startup_env(),
            init_user="root",
            labels=self._labels,
        )

    @override
    async def start(self, force_build: bool) -> None:
        if force_build and (self.environment_dir / DOCKERFILE_NAME).exists():
            raise Unsupported(
                "force_build asks for a build of environment/Dockerfile, which DSec does not "
                "do: run without --force-build to use the task's docker_image"
            )
        if self._client is not None:  # started before: a fresh sandbox, the old one ended
            await self.stop(delete=True)
        image = self.image
        assert image is not None  # _validate_definition refused a task without one
        try:
            args = self._spec(image)
        except ValidationError as exc:  # e.g. an image ref the platform cannot name
            raise InvalidArgument(f"no DSec sandbox spec for this task: {exc}") from None
        # Kept until stop(), which Harbor calls also when start fails or is cancelled.
        self._client = DSecClient(self._url, self._api_key)
        sandbox = await self._client.run_container(args, timeout=self._create_timeout)
        self._sandbox = sandbox
        if self.task_env_config.workdir:  # as Docker's -w does: created if missing
            await sandbox.mkdir(self.task_env_config.workdir, parents=True)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    @override
    async def stop(self, delete: bool) -> None:
        """End the sandbox and the client; idempotent. DSec sandboxes of a trial are not
        kept: ``delete=False`` stops it too (its state goes with it). After a create that
        failed or was cancelled midway, the sandbox it may still have made is found by
        this environment's label and stopped."""
        sandbox, client = self._sandbox, self._client
        self._sandbox = self._client = None
        if client is None:
            return
        try:
            found = [sandbox] if sandbox else await client.list_sandboxes(labels=self._labels)
            for sb in found:
                with contextlib.suppress(SandboxNotFound):  # already gone: stopped
                    await sb.stop()
        finally:
            await client.close()

    @override
    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        await self.sandbox.update_network(self._rules(network_policy))

    @override
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        resolved = self._resolve_user(user)
        emit = _Emitter(self._output_callback())
        result = await self.sandbox.run_shell(
            command,
            timeout=timeout_sec or None,
            env=self._merge_env(env),
            workdir=effective_exec_cwd(cwd, self.task_env_config.workdir, None),
            user=None if resolved is None else str(resolved),
            on_stdout=emit.stdout,
            on_stderr=emit.stderr,
        )
        await emit.flush()
        if result.timed_out:
            # What Harbor's own Docker environment does on a timeout: raise.
            raise Timeout(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=result.stdout, stderr=result.stderr, return_code=result.exit_code)

    @override
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self.sandbox.write_stream(target_path, os.fspath(source_path))

    @override
    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self.sandbox.upload_dir(source_dir, target_dir)

    @override
    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "wb") as out:  # chunks come from the network, not the disk
            async for chunk in self.sandbox.read_stream(source_path):
                out.write(chunk)

    @override
    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self.sandbox.download_dir(source_dir, target_dir)

    @override
    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return await self._kind(path) == "directory"

    @override
    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return await self._kind(path) == "file"

    async def _kind(self, path: str) -> str | None:
        try:
            return (await self.sandbox.stat(path, follow=True)).type
        except FileNotFound:
            return None


class _Emitter:
    """Harbor's async output callback fed from the SDK's per-chunk sync callbacks
    (decoded incrementally, so a UTF-8 character split across chunks stays whole)."""

    def __init__(self, callback: Callable[[str, Any], Any] | None) -> None:
        self._callback = callback
        self._tasks: list[asyncio.Task[Any]] = []
        self._decoders = {
            "stdout": codecs.getincrementaldecoder("utf-8")("replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")("replace"),
        }
        self.stdout = self._sink("stdout") if callback else None
        self.stderr = self._sink("stderr") if callback else None

    def _sink(self, stream: str) -> Callable[[bytes], None]:
        def feed(data: bytes) -> None:
            text = self._decoders[stream].decode(data)
            if text and self._callback is not None:
                self._tasks.append(asyncio.ensure_future(self._callback(text, stream)))

        return feed

    async def flush(self) -> None:
        for stream, decoder in self._decoders.items():
            rest = decoder.decode(b"", final=True)
            if rest and self._callback is not None:
                self._tasks.append(asyncio.ensure_future(self._callback(rest, stream)))
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            try:
                await task
            except Exception:  # a failing log callback must not fail the command
                logging.getLogger(__name__).exception("Harbor output callback failed")
