"""libdsec, blocking: ``DSecSyncClient`` and ``SyncSandbox``, twins of the async API.

For scripts, notebooks and thread-based rollout workers. Requests and parsing come from
``dsec.sdk._protocol`` exactly as for the async client; only the sending differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Self, TypeVar

import httpx

from dsec.errors import DSecError, InvalidArgument, SandboxNotFound
from dsec.model import (
    DSecContainerRunArgs,
    ExecResult,
    HealthInfo,
    ImageInfo,
    SandboxInfo,
    SandboxState,
)
from dsec.sdk import _http
from dsec.sdk import _protocol as proto
from dsec.sdk._upload import UploadProgress, UploadSource, open_upload
from dsec.sdk.client import DEFAULT_TIMEOUT

T = TypeVar("T")


class DSecSyncClient:
    """Blocking client of a DSec platform; same arguments and methods as ``DSecClient``."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_connections: int = 256,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._settings = _http.ClientSettings(
            url, api_key, timeout=timeout, max_connections=max_connections
        )
        self._transport = transport
        self._http: httpx.Client | None = None

    @property
    def url(self) -> str:
        return self._settings.url

    def __repr__(self) -> str:
        return f"DSecSyncClient(url={self.url!r})"

    # ---- connection ------------------------------------------------------------------

    def open(self) -> None:
        """Open the connection pool and check that the platform answers."""
        self._client()
        self.health()

    def close(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            http.close()

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _client(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(**self._settings.http_kwargs(), transport=self._transport)
        return self._http

    def _send(self, call: proto.Call[T]) -> T:
        kwargs = _http.request_kwargs(call)
        if call.upload is not None:
            kwargs["content"] = iter(call.upload)
        try:
            resp = self._client().request(**kwargs)
        except httpx.HTTPError as exc:
            raise _http.transport_error(exc, self.url) from exc
        finally:
            if call.upload is not None:
                call.upload.close()
        return _http.finish(call, resp)

    # ---- platform and sandboxes ------------------------------------------------------

    def health(self) -> HealthInfo:
        return self._send(proto.health())

    def run_container(self, args: DSecContainerRunArgs, timeout: float = 120) -> SyncSandbox:
        """Create a container sandbox and return once it runs (or raise a typed error)."""
        return SyncSandbox(self, self._send(proto.create_sandbox(args, timeout)))

    def get(self, sandbox_id: str) -> SyncSandbox:
        return SyncSandbox(self, self._send(proto.get_sandbox(sandbox_id)))

    def list_sandboxes(
        self,
        labels: Mapping[str, str] | None = None,
        states: Iterable[SandboxState | str] | None = None,
    ) -> list[SyncSandbox]:
        """Sandboxes with all ``labels`` in any of ``states`` (default: the live ones)."""
        return [SyncSandbox(self, i) for i in self._send(proto.list_sandboxes(labels, states))]

    def stop_sandbox(self, sandbox_id: str) -> SandboxInfo:
        """Stop a sandbox by id without fetching it first; returns its final state."""
        return self._send(proto.stop_sandbox(sandbox_id))

    # ---- images ------------------------------------------------------------------------

    def list_images(self) -> list[ImageInfo]:
        return self._send(proto.list_images())

    def get_image(self, ref: str) -> ImageInfo:
        return self._send(proto.get_image(ref))

    def build_image(
        self,
        recipe: str,
        *,
        name: str | None = None,
        rebuild: bool = False,
        timeout: float | None = None,
    ) -> ImageInfo:
        """Build a built-in image (``busybox`` or ``debian-python``); cached unless rebuild."""
        return self._send(proto.build_image(recipe, name=name, rebuild=rebuild, timeout=timeout))

    def import_image(
        self,
        ref: str,
        source: UploadSource,
        fmt: str = "auto",
        *,
        progress: UploadProgress | None = None,
        timeout: float | None = None,
    ) -> ImageInfo:
        """Stream an archive (path or binary file object) or a directory (tarred on the fly)."""
        upload, is_dir = open_upload(source, progress=progress)
        try:
            call = proto.import_image(ref, upload, "tar" if is_dir else fmt, timeout=timeout)
        except BaseException:
            upload.close()
            raise
        return self._send(call)

    def remove_image(self, ref: str) -> ImageInfo:
        return self._send(proto.remove_image(ref))


class SyncSandbox:
    """A handle on one sandbox. ``info`` is its last known state (see ``refresh``)."""

    def __init__(self, client: DSecSyncClient, info: SandboxInfo) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> SandboxState:
        return self.info.state

    def __repr__(self) -> str:
        return f"SyncSandbox(id={self.id!r}, state={self.state.value!r}, image={self.info.image!r})"

    def refresh(self) -> SandboxInfo:
        self.info = self._client._send(proto.get_sandbox(self.id))
        return self.info

    def run_shell(
        self,
        command: str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run ``command`` through ``/bin/sh -c``; ``timeout`` kills it (no limit if None)."""
        if not isinstance(command, str):
            raise InvalidArgument("run_shell takes a string; use exec() for an argv list")
        return self._client._send(
            proto.exec_command(
                self.id,
                command,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
            )
        )

    def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run an argv directly, without a shell."""
        if isinstance(argv, str):
            raise InvalidArgument("exec takes an argv list; use run_shell() for a string")
        return self._client._send(
            proto.exec_command(
                self.id,
                list(argv),
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
            )
        )

    def read_file(self, path: str) -> bytes:
        return self._client._send(proto.read_file(self.id, path))

    def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Create or replace a file; a str is written as UTF-8."""
        self._client._send(proto.write_file(self.id, path, data, mode=mode))

    def stop(self) -> SandboxInfo:
        """Terminate the sandbox (idempotent) and return its final state."""
        self.info = self._client._send(proto.stop_sandbox(self.id))
        return self.info

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop()
        except SandboxNotFound:
            pass
        except DSecError:
            if et is None:
                raise
            # Keep the exception that ended the block; a failed stop must not mask it.
