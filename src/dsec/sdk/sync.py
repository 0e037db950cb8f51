"""libdsec, blocking: ``DSecSyncClient`` and ``SyncSandbox``, twins of the async API.

For scripts, notebooks and thread-based rollout workers. Requests and parsing come from
``dsec.sdk._protocol`` exactly as for the async client; only the sending differs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Self, TypeVar
from urllib.parse import quote

import httpx

from dsec.api.events import AuditKind, AuditRecord
from dsec.api.health import HealthInfo
from dsec.api.images import ImageConfigSpec, ImageInfo, PullResult
from dsec.api.sandbox import SandboxInfo, SandboxState, SandboxStats
from dsec.api.spec import DSecContainerRunArgs, DSecFullVMRunArgs, DSecMicroVMRunArgs, RunArgs
from dsec.api.verify import VerifyMode, VerifyResult
from dsec.errors import DSecError, InvalidArgument, SandboxNotFound
from dsec.sdk import _http
from dsec.sdk import _protocol as proto
from dsec.sdk._batch import SyncBatchMixin
from dsec.sdk._portal import Portal
from dsec.sdk._upload import UploadProgress, UploadSource, open_upload
from dsec.sdk.client import DEFAULT_TIMEOUT, DSecClient
from dsec.sdk.cluster import SyncClusterMixin
from dsec.sdk.datapath import DataPathMode
from dsec.sdk.fncall import SyncFnCallMixin
from dsec.sdk.iam import SyncIAMMixin
from dsec.sdk.layers import SyncLayersMixin
from dsec.sdk.rl import SyncJobsMixin, SyncSandboxRLMixin
from dsec.sdk.rollouts import SyncRolloutsMixin
from dsec.sdk.security import SyncSecurityMixin
from dsec.sdk.sync_datapath import SyncSandboxDataMixin
from dsec.sdk.trajectory import SyncTrajectoryMixin

T = TypeVar("T")


class DSecSyncClient(
    SyncLayersMixin,
    SyncSecurityMixin,
    SyncFnCallMixin,
    SyncTrajectoryMixin,
    SyncJobsMixin,
    SyncRolloutsMixin,
    SyncBatchMixin,
    SyncClusterMixin,
    SyncIAMMixin,
):
    """Blocking client of a DSec platform; same arguments and methods as ``DSecClient``."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_connections: int = 256,
        transport: httpx.BaseTransport | None = None,
        data_path: DataPathMode = "direct",
    ) -> None:
        self._settings = _http.ClientSettings(
            url, api_key, timeout=timeout, max_connections=max_connections
        )
        self._transport = transport
        self._http: httpx.Client | None = None
        self._data_mode: DataPathMode = data_path
        self._portal_obj: Portal | None = None
        self._aclient: DSecClient | None = None

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

    def follow_audit(
        self,
        *,
        job: str | None = None,
        sandbox: str | None = None,
        trajectory: str | None = None,
        kinds: Iterable[AuditKind | str] | None = None,
        since_seq: int = 0,
    ) -> Iterator[AuditRecord]:
        """``for r in client.follow_audit(job="ppo-7")``: DSecClient.follow_audit's
        records, read in this client's event-loop thread; stop by leaving the loop."""
        stream = self._async_client().follow_audit(
            job=job, sandbox=sandbox, trajectory=trajectory, kinds=kinds, since_seq=since_seq
        )
        return self._portal().iterate(stream)

    def _portal(self) -> Portal:
        if self._portal_obj is None:
            self._portal_obj = Portal()
        return self._portal_obj

    def _async_client(self) -> DSecClient:
        """The async client whose data path the sync handles drive (in the portal)."""
        if self._aclient is None:
            self._aclient = DSecClient(
                self._settings.url,
                self._settings.api_key,
                timeout=self._settings.timeout,
                data_path=self._data_mode,
            )
        return self._aclient

    def close(self) -> None:
        aclient, self._aclient = self._aclient, None
        portal, self._portal_obj = self._portal_obj, None
        if portal is not None:
            if aclient is not None:
                portal.call(aclient.close())
            portal.close()
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

    def stats(self, sandbox_id: str | None = None) -> list[SandboxStats]:
        """Memory, CPU time, disk and idle time of every live sandbox (or of
        ``sandbox_id`` only), read now (``dsec top``); CPU use is the change of
        ``cpu_seconds`` between two calls."""
        return self._send(proto.stats(sandbox_id))

    def run_sandbox(
        self,
        args: RunArgs,
        timeout: float = 120,
        *,
        idempotency_key: str | None = None,
    ) -> SyncSandbox:
        """Create a sandbox of the backend ``args`` names (``DSecContainerRunArgs``,
        ``DSecMicroVMRunArgs``, ``DSecFullVMRunArgs``) and return once it runs, or raise
        a typed error: ``Unsupported`` (501) for a backend the platform does not run.

        With ``idempotency_key`` the create is safe to retry: the same key and spec give
        the sandbox the first attempt made (``IdempotencyKeyReused`` for another spec)."""
        info = self._send(proto.create_sandbox(args, timeout, idempotency_key))
        return SyncSandbox(self, info)

    def run_container(
        self,
        args: DSecContainerRunArgs,
        timeout: float = 120,
        *,
        idempotency_key: str | None = None,
    ) -> SyncSandbox:
        """Create a container sandbox and return once it runs (or raise a typed error).

        With ``idempotency_key`` the create is safe to retry: the same key and spec give
        the sandbox the first attempt made (``IdempotencyKeyReused`` for another spec)."""
        return self.run_sandbox(args, timeout, idempotency_key=idempotency_key)

    def run_microvm(
        self,
        args: DSecMicroVMRunArgs,
        timeout: float = 300,
        *,
        idempotency_key: str | None = None,
    ) -> SyncSandbox:
        """Create a microVM sandbox (QEMU, booted from the same EROFS layers as a
        container) and return once its agent answers. The handle is the container
        handle: commands, sessions, files, verify, pause. ``Unsupported`` (501) when no
        edge runs microVMs; ``SandboxInfo.accelerator`` says whether it runs under KVM
        or TCG (software: expect a boot of seconds, not milliseconds)."""
        return self.run_sandbox(args, timeout, idempotency_key=idempotency_key)

    def run_fullvm(
        self,
        args: DSecFullVMRunArgs,
        timeout: float = 300,
        *,
        idempotency_key: str | None = None,
    ) -> SyncSandbox:
        """Create a full VM (QEMU q35) from a VM image (``import_vm``) and return once
        its guest agent answers. Commands and files go through the QEMU guest agent;
        the screen and input through ``screenshot``, ``mouse_move``, ``left_click``,
        ``write``, ``press`` ...; sessions, streams and terminals are ``Unsupported``."""
        return self.run_sandbox(args, timeout, idempotency_key=idempotency_key)

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

    def compose_image(
        self, ref: str, layers: list[str], config: ImageConfigSpec | None = None
    ) -> ImageInfo:
        """Tag layers already on the platform (digests, bottom first) as image ``ref``
        with ``config`` (env, workdir, user, cmd ...): a Dockerfile build's last step."""
        return self._send(proto.compose_image(ref, layers, config))

    def pull_image(
        self,
        ref: str,
        *,
        username: str | None = None,
        password: str | None = None,
        streaming: bool = True,
        timeout: float | None = None,
    ) -> PullResult:
        """Pull ``[registry[:port]/]path[:tag][@sha256:..]`` from its OCI registry onto
        the platform (credentials: these, else the platform's credentials file)."""
        return self._send(
            proto.pull_image(
                ref, username=username, password=password, streaming=streaming, timeout=timeout
            )
        )

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

    def import_vm(
        self,
        ref: str,
        disk: str | os.PathLike[str],
        *,
        kernel: str | os.PathLike[str] | None = None,
        initrd: str | os.PathLike[str] | None = None,
        cmdline: str | None = None,
        timeout: float | None = None,
    ) -> ImageInfo:
        """A VM image from a disk file (raw or qcow2, no backing file), and for a
        direct kernel boot a kernel, an initrd and its command line; each file is
        stored content-addressed (a file the platform has is sent again, and kept once)."""
        digests: list[str | None] = []
        for path in (disk, kernel, initrd):
            if path is None:
                digests.append(None)
                continue
            upload, is_dir = open_upload(path)
            if is_dir:
                upload.close()
                raise InvalidArgument(f"{path} is a directory, not a VM image file")
            try:
                call = proto.add_vm_blob(upload, timeout=timeout)
            except BaseException:
                upload.close()
                raise
            digests.append(self._send(call).digest)
        assert digests[0] is not None
        return self._send(
            proto.register_vm(
                ref, digests[0], kernel=digests[1], initrd=digests[2], cmdline=cmdline
            )
        )

    def remove_image(self, ref: str) -> ImageInfo:
        return self._send(proto.remove_image(ref))


class SyncSandbox(SyncSandboxDataMixin, SyncSandboxRLMixin):
    """A handle on one sandbox. ``info`` is its last known state (see ``refresh``).

    Commands, sessions, processes, the terminal and files: see ``SyncSandboxDataMixin``.
    """

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

    def vnc_url(self) -> str:
        """The dashboard page showing this sandbox's screen live (noVNC over the edge's
        VNC WebSocket; a sandbox with a display: the fullvm backend). A browser opens
        it after logging in to the dashboard once (``/ui?api_key=...``)."""
        return f"{self._client.url.rstrip('/')}/ui/desktop/{quote(self.id, safe='')}"

    def refresh(self) -> SandboxInfo:
        self.info = self._client._send(proto.get_sandbox(self.id))
        return self.info

    def stop(self) -> SandboxInfo:
        """Terminate the sandbox (idempotent) and return its final state."""
        self.info = self._client._send(proto.stop_sandbox(self.id))
        return self.info

    def update_network(self, rules: Mapping[str, bool]) -> dict[str, bool]:
        """Replace this sandbox's egress rules with ``rules`` (REPLACE, not merge: a
        service left out is denied from now on), e.g. ``{"pypi": True}`` for a setup
        phase, then ``{}`` for the solve phase. New connections follow the new rules at
        once; connections already open go on. The sandbox must have been created with
        ``network_rules`` (even ``{"pypi": False}``). Returns the rules in force."""
        reply = self._client._send(proto.update_network(self.id, rules))
        return reply.network_rules

    def verify(
        self,
        command: str | Sequence[str],
        *,
        graded: Sequence[str] | None = None,
        mode: VerifyMode = "fresh",
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
    ) -> VerifyResult:
        """Grade this sandbox's work in a verifier the agent cannot reach.

        The verifier is built from the pristine image layers and the spec's
        ``protected`` paths; the agent's files reach it only as read-only snapshots of
        ``graded`` (default: the spec's workdir, or the usual work directories), links
        leaving a graded tree refused. ``mode="fresh"`` (default) stops this sandbox
        first, so nothing the grader does can flow back to it; ``"isolated"`` freezes
        it for the step and lets it go on. ``passed`` is the grader's exit status 0;
        ``results`` holds the files it wrote to ``$DSEC_RESULT_DIR``. Run the agent's
        code from a grader through ``$DSEC_UNTRUSTED CMD...`` (unprivileged, cannot
        see the protected paths). A string runs through ``/bin/sh -c`` from ``/``; the
        user defaults to root, the timeout to 600 s."""
        return self._client._send(
            proto.verify_command(
                self.id,
                command if isinstance(command, str) else list(command),
                graded=graded,
                mode=mode,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
            )
        )

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
