"""Blocking twins of the data-path handles (sessions, streams, processes, terminal, files).

Each method runs its async twin in ``dsec.sdk._portal`` and returns its result, so the
semantics (and the wire protocol) are exactly those of ``dsec.sdk.datapath``.
"""

from __future__ import annotations

import os
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

from dsec.api.exec import ExitInfo, ProcessInfo, SessionInfo
from dsec.api.files import FileInfo, FileList
from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxInfo
from dsec.sdk._portal import Portal
from dsec.sdk.datapath import (
    CommandResult,
    CommandStream,
    OutputCallback,
    OutputChunk,
    Process,
    Pty,
    Session,
)

if TYPE_CHECKING:
    from dsec.sdk.client import DSecClient, Sandbox
    from dsec.sdk.sync import DSecSyncClient
    from dsec.sdk.trajectory import SyncTrajectory

T = TypeVar("T")


class SyncCommandStream:
    """``for chunk in stream``; ``result`` after the loop; ``close()`` kills the command."""

    def __init__(self, portal: Portal, stream: CommandStream) -> None:
        self._portal = portal
        self._stream = stream
        self._iter = portal.iterate(stream)

    @property
    def result(self) -> ExitInfo | None:
        return self._stream.result

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> OutputChunk:
        return next(self._iter)

    def wait(self) -> ExitInfo:
        return self._portal.call(self._stream.wait())

    def close(self) -> None:
        self._portal.call(self._stream.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncProcess:
    def __init__(self, portal: Portal, process: Process) -> None:
        self._portal = portal
        self._process = process

    @property
    def id(self) -> str:
        return self._process.id

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def info(self) -> ProcessInfo:
        return self._process.info

    def __repr__(self) -> str:
        return f"Sync{self._process!r}"

    def refresh(self) -> ProcessInfo:
        return self._portal.call(self._process.refresh())

    def output(self, *, start: int = 0) -> Iterator[OutputChunk]:
        return self._portal.iterate(self._process.output(start=start))

    def wait(self) -> ExitInfo:
        return self._portal.call(self._process.wait())

    def collect(self) -> CommandResult:
        return self._portal.call(self._process.collect())

    def write_stdin(self, data: bytes | str) -> None:
        self._portal.call(self._process.write_stdin(data))

    def close_stdin(self) -> None:
        self._portal.call(self._process.close_stdin())

    def send_signal(self, sig: int | str) -> None:
        self._portal.call(self._process.send_signal(sig))

    def interrupt(self) -> None:
        self._portal.call(self._process.interrupt())

    def terminate(self) -> None:
        self._portal.call(self._process.terminate())

    def kill(self) -> ExitInfo | None:
        return self._portal.call(self._process.kill())


class SyncSession:
    def __init__(self, portal: Portal, session: Session) -> None:
        self._portal = portal
        self._session = session

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def info(self) -> SessionInfo:
        return self._session.info

    def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult:
        """Callbacks run on the SDK's helper thread; keep them quick."""
        return self._portal.call(
            self._session.run(
                command,
                timeout=timeout,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
            )
        )

    def stream(
        self, command: str, *, timeout: float | None = None, max_output_bytes: int | None = None
    ) -> SyncCommandStream:
        async def make() -> CommandStream:
            return self._session.stream(command, timeout=timeout, max_output_bytes=max_output_bytes)

        return SyncCommandStream(self._portal, self._portal.call(make()))

    def start(
        self,
        command: str,
        *,
        stdin: bool = False,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
    ) -> SyncProcess:
        process = self._portal.call(
            self._session.start(
                command, stdin=stdin, timeout=timeout, max_output_bytes=max_output_bytes
            )
        )
        return SyncProcess(self._portal, process)

    def close(self) -> None:
        self._portal.call(self._session.close())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncPty:
    def __init__(self, portal: Portal, pty: Pty) -> None:
        self._portal = portal
        self._pty = pty

    @property
    def exit(self) -> ExitInfo | None:
        return self._pty.exit

    def read(self) -> bytes:
        return self._portal.call(self._pty.read())

    def write(self, data: bytes | str) -> None:
        self._portal.call(self._pty.write(data))

    def resize(self, rows: int, cols: int) -> None:
        self._portal.call(self._pty.resize(rows, cols))

    def close(self) -> None:
        self._portal.call(self._pty.close())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncSandboxDataMixin:
    """Blocking twins of ``SandboxDataMixin`` for ``SyncSandbox``."""

    _client: DSecSyncClient
    info: SandboxInfo
    _async_handle: Sandbox | None = None

    def _a(self) -> Sandbox:
        from dsec.sdk.client import Sandbox

        client: DSecClient = self._client._async_client()
        if self._async_handle is None or self._async_handle.info is not self.info:
            self._async_handle = Sandbox(client, self.info)
        return self._async_handle

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._client._portal().call(coro)

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
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        trajectory: SyncTrajectory | None = None,
    ) -> CommandResult:
        """Run ``command`` through ``/bin/sh -c`` in a fresh process (see the async twin)."""
        return self._run(
            self._a().run_shell(
                command,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                trajectory=None if trajectory is None else trajectory.inner,
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
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        trajectory: SyncTrajectory | None = None,
    ) -> CommandResult:
        """Run an argv directly, without a shell."""
        return self._run(
            self._a().exec(
                argv,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                trajectory=None if trajectory is None else trajectory.inner,
            )
        )

    def stream(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
    ) -> SyncCommandStream:
        sandbox = self._a()

        async def make() -> CommandStream:
            return sandbox.stream(
                command,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                max_output_bytes=max_output_bytes,
            )

        return SyncCommandStream(self._client._portal(), self._run(make()))

    def start(
        self,
        command: str | Sequence[str],
        *,
        stdin: bool = False,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
    ) -> SyncProcess:
        process = self._run(
            self._a().start(
                command,
                stdin=stdin,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                max_output_bytes=max_output_bytes,
            )
        )
        return SyncProcess(self._client._portal(), process)

    def process(self, process_id: str) -> SyncProcess:
        return SyncProcess(self._client._portal(), self._run(self._a().process(process_id)))

    def processes(self) -> list[ProcessInfo]:
        return self._run(self._a().processes())

    def session(
        self,
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
    ) -> SyncSession:
        session = self._run(self._a().session(env=env, workdir=workdir, user=user))
        return SyncSession(self._client._portal(), session)

    def sessions(self) -> list[SessionInfo]:
        return self._run(self._a().sessions())

    def get_session(self, session_id: str) -> SyncSession:
        session = self._run(self._a().get_session(session_id))
        return SyncSession(self._client._portal(), session)

    def pty(
        self,
        *,
        rows: int = 24,
        cols: int = 80,
        command: str | None = None,
        term: str = "xterm-256color",
    ) -> SyncPty:
        pty = self._run(self._a().pty(rows=rows, cols=cols, command=command, term=term))
        return SyncPty(self._client._portal(), pty)

    # -- snapshot -----------------------------------------------------------------------
    def snapshot(self, ref: str, *, timeout: float | None = 600.0) -> ImageInfo:
        """Save this running VM as the VM image ``ref`` (see ``Sandbox.snapshot``)."""
        return self._run(self._a().snapshot(ref, timeout=timeout))

    # -- computer use -------------------------------------------------------------------
    def screenshot(self) -> bytes:
        """The screen as PNG bytes (read from the VM's display adapter)."""
        return self._run(self._a().screenshot())

    def mouse_move(self, x: int, y: int) -> None:
        self._run(self._a().mouse_move(x, y))

    def left_click(self, x: int | None = None, y: int | None = None) -> None:
        self._run(self._a().left_click(x, y))

    def right_click(self, x: int | None = None, y: int | None = None) -> None:
        self._run(self._a().right_click(x, y))

    def middle_click(self, x: int | None = None, y: int | None = None) -> None:
        self._run(self._a().middle_click(x, y))

    def double_click(self, x: int | None = None, y: int | None = None) -> None:
        self._run(self._a().double_click(x, y))

    def scroll(self, direction: Literal["up", "down"] = "down", amount: int = 1) -> None:
        self._run(self._a().scroll(direction, amount))

    def write(self, text: str) -> None:
        """Type ``text`` on the VM's keyboard (US layout, ASCII)."""
        self._run(self._a().write(text))

    def press(self, keys: str | Sequence[str]) -> None:
        """Press one key ("enter") or a chord (["ctrl", "c"])."""
        self._run(self._a().press(keys))

    def read_file(self, path: str) -> bytes:
        return self._run(self._a().read_file(path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self._run(self._a().read_text(path, encoding))

    def read_stream(self, path: str) -> Iterator[bytes]:
        return self._client._portal().iterate(self._a().read_stream(path))

    def write_file(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0o644,
        trajectory: SyncTrajectory | None = None,
    ) -> None:
        """Create or replace a file atomically; a str is written as UTF-8."""
        traj = None if trajectory is None else trajectory.inner
        self._run(self._a().write_file(path, data, mode=mode, trajectory=traj))

    def write_stream(self, path: str, source: str | os.PathLike[str], *, mode: int = 0o644) -> None:
        """Write a file from a local file, without buffering it."""
        self._run(self._a().write_stream(path, source, mode=mode))

    def stat(self, path: str, *, follow: bool = False) -> FileInfo:
        return self._run(self._a().stat(path, follow=follow))

    def exists(self, path: str) -> bool:
        return self._run(self._a().exists(path))

    def list_dir(self, path: str, *, recursive: bool = False, limit: int | None = None) -> FileList:
        return self._run(self._a().list_dir(path, recursive=recursive, limit=limit))

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        self._run(self._a().mkdir(path, parents=parents, mode=mode))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._run(self._a().remove(path, recursive=recursive))

    def move(self, src: str, dst: str) -> None:
        self._run(self._a().move(src, dst))

    def chmod(self, path: str, mode: int) -> None:
        self._run(self._a().chmod(path, mode))

    def upload_dir(self, local_dir: str | os.PathLike[str], remote_dir: str) -> dict[str, Any]:
        return self._run(self._a().upload_dir(local_dir, remote_dir))

    def download_tar(self, remote_dir: str) -> Iterator[bytes]:
        return self._client._portal().iterate(self._a().download_tar(remote_dir))

    def download_dir(self, remote_dir: str, local_dir: str | os.PathLike[str]) -> None:
        self._run(self._a().download_dir(remote_dir, local_dir))
