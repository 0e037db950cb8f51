"""The SDK side of the data path: commands, sessions, processes, terminals and files.

After creation the SDK talks to the sandbox's edge directly (``SandboxInfo.data_path``:
URL + per-sandbox token, renewed before it expires) over one multiplexed WebSocket per
edge for commands and file metadata, and over HTTP for file contents and archives. With
``DSecClient(data_path="proxy")`` the same calls go to the apiserver with the API key.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import tarfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self
from urllib.parse import urlencode

import httpx
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from dsec.api.datapath import EDGE_PREFIX, STDERR, STDOUT
from dsec.api.desktop import ComputerAction
from dsec.api.exec import (
    CommandArgs,
    ExecResult,
    ExitInfo,
    ProcessInfo,
    SessionArgs,
    SessionInfo,
    signal_number,
)
from dsec.api.fields import parse_image_ref
from dsec.api.files import FileInfo, FileList
from dsec.api.images import ImageInfo
from dsec.api.sandbox import DataPathInfo, SandboxInfo
from dsec.errors import (
    DSecError,
    FileNotFound,
    InvalidArgument,
    NotFound,
    PlatformUnavailable,
    SessionNotFound,
    Unauthenticated,
    Unsupported,
    error_from_payload,
)
from dsec.sdk import _http
from dsec.sdk import _protocol as proto
from dsec.sdk._protocol import Call, exec_command, invalid, sandbox_path
from dsec.sdk._rpc import MAX_FRAME, RpcClient, ws_url
from dsec.sdk._upload import open_upload

if TYPE_CHECKING:
    from dsec.sdk.client import DSecClient
    from dsec.sdk.trajectory import Trajectory

DataPathMode = Literal["direct", "proxy"]
OutputCallback = Callable[[bytes], object]
#: Renew a token this long before it expires.
RENEW_BEFORE = timedelta(seconds=60)
_TAR_CHUNK = 1 << 20


class CommandResult(ExecResult):
    """An ``ExecResult`` that also keeps the exact bytes (output need not be UTF-8)."""

    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """A piece of a command's output, in the order the command wrote it."""

    stream: Literal["stdout", "stderr"]
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


def _chunk(stream: int, data: bytes) -> OutputChunk:
    return OutputChunk("stderr" if stream == STDERR else "stdout", data)


def _result(exit_info: Any, out: list[bytes], err: list[bytes]) -> CommandResult:
    info = ExitInfo.model_validate(exit_info)
    stdout, stderr = b"".join(out), b"".join(err)
    return CommandResult(
        exit_code=info.exit_code,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        duration=info.duration,
        timed_out=info.timed_out,
        truncated=info.truncated,
        stdout_bytes=stdout,
        stderr_bytes=stderr,
    )


def command_args(command: str | Sequence[str], **fields: Any) -> dict[str, Any]:
    """Validated ``CommandArgs`` as JSON-ready dict (typed errors before any I/O)."""
    values = {k: v for k, v in fields.items() if v is not None}
    values["command"] = command if isinstance(command, str) else list(command)
    if "env" in values:
        values["env"] = dict(values["env"])
    try:
        return CommandArgs.model_validate(values).model_dump(exclude_defaults=True)
    except ValidationError as exc:
        raise invalid(exc) from None


class DataPathClient:
    """Per ``DSecClient``: tokens, one RPC connection per edge, one HTTP pool per edge."""

    def __init__(self, client: DSecClient, mode: DataPathMode) -> None:
        if mode not in ("direct", "proxy"):
            raise InvalidArgument(f"data_path must be 'direct' or 'proxy', not {mode!r}")
        self._client = client
        self.mode = mode
        self._infos: dict[str, DataPathInfo] = {}
        self.legacy = False
        """The server has no data path (an older platform): the classic calls use the
        apiserver's HTTP routes; sessions, streams and the new file calls are Unsupported."""
        self.agentless: set[str] = set()
        """Sandboxes whose backend has no session agent (a full VM): their one-shot
        commands use the exec route (output callbacks are called once it ended)."""
        self._rpcs: dict[str, RpcClient] = {}
        self._https: dict[str, httpx.AsyncClient] = {}

    def remember(self, info: SandboxInfo) -> None:
        if info.data_path is not None:
            self._infos[info.id] = info.data_path

    async def route(self, sandbox_id: str, *, renew: bool = False) -> tuple[str, str | None]:
        """``(edge URL, token)``; the token is None in proxy mode (the API key is used)."""
        if self.mode == "proxy":
            return self._client.url, None
        info = self._infos.get(sandbox_id)
        if renew or info is None or info.expires_at - datetime.now(UTC) < RENEW_BEFORE:
            if self.legacy:
                raise _no_data_path()
            try:
                info = await self._client._send(
                    Call(
                        "POST",
                        sandbox_path(sandbox_id) + "/token",
                        lambda r: DataPathInfo.model_validate_json(r.content),
                    )
                )
            except NotFound as exc:
                if type(exc) is not NotFound:  # SandboxNotFound and friends: a real answer
                    raise
                self.legacy = True  # no such route: a platform without a data path
                raise _no_data_path() from None
            self._infos[sandbox_id] = info
        return info.url, info.token

    def _headers(self, token: str | None) -> dict[str, str]:
        headers = {"User-Agent": f"libdsec/{_http.SDK_VERSION}"}
        key = token if token is not None else self._client._settings.api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _rpc(self, url: str, token: str | None = None) -> RpcClient:
        rpc = self._rpcs.get(url)
        if rpc is None:
            rpc = RpcClient(url, self._headers(None) if self.mode == "proxy" else {})
            self._rpcs[url] = rpc
        if token is not None and self.mode != "proxy":
            # An edge refuses a socket without a credential at the handshake; the
            # latest token of any of its sandboxes opens it (the next connect uses it).
            rpc.set_credential(token)
        return rpc

    def api_rpc(self, path: str, *, max_size: int | None = MAX_FRAME) -> RpcClient:
        """A connection to the apiserver itself with the API key, for calls that name no
        sandbox (FnCall's ``FNCALL_RPC_PATH``); closed with the others."""
        key = self._client.url + path
        rpc = self._rpcs.get(key)
        if rpc is None:
            rpc = RpcClient(self._client.url, self._headers(None), path=path, max_size=max_size)
            self._rpcs[key] = rpc
        return rpc

    async def call(
        self,
        sandbox_id: str,
        op: str,
        args: dict[str, Any],
        on_data: Callable[[int, bytes], None] | None = None,
    ) -> Any:
        sandbox_path(sandbox_id)  # a malformed id fails here, like on the control path
        url, token = await self.route(sandbox_id)
        try:
            rpc = self._rpc(url, token)
            return await rpc.call(op, sandbox_id, args, token=token, on_data=on_data)
        except Unauthenticated:
            if token is None:
                raise
            # The token expired in flight (clock skew, long idle): renew once and retry.
            url, token = await self.route(sandbox_id, renew=True)
            rpc = self._rpc(url, token)
            return await rpc.call(op, sandbox_id, args, token=token, on_data=on_data)

    def _http(self, url: str) -> httpx.AsyncClient:
        http = self._https.get(url)
        if http is None:
            kwargs = self._client._settings.http_kwargs(16)
            kwargs["base_url"] = url
            kwargs["headers"] = {"User-Agent": f"libdsec/{_http.SDK_VERSION}"}
            http = httpx.AsyncClient(**kwargs)
            self._https[url] = http
        return http

    async def http_request(
        self,
        sandbox_id: str,
        method: str,
        suffix: str,
        *,
        params: list[tuple[str, str | int | float | bool | None]] | None = None,
        content: Any = None,
        json_body: Any = None,
        stream: bool = False,
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        url, token = await self.route(sandbox_id)
        http = self._http(url)
        request = http.build_request(
            method,
            f"{EDGE_PREFIX}/{sandbox_id}{suffix}",
            params=params,
            content=content,
            json=json_body,
            headers=self._headers(token),
            timeout=timeout if timeout is not None else http.timeout,
        )
        try:
            resp = await http.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise _http.transport_error(exc, url) from exc
        if resp.status_code >= 400:
            if stream:
                await resp.aread()
                await resp.aclose()
            _http.raise_for_error(resp)
        return resp

    async def pty_connection(self, sandbox_id: str, query: dict[str, Any]) -> ClientConnection:
        url, token = await self.route(sandbox_id)
        target = ws_url(url, f"{EDGE_PREFIX}/{sandbox_id}/pty") + "?" + urlencode(query)
        try:
            return await connect(
                target,
                additional_headers=self._headers(token),
                compression=None,
                max_size=MAX_FRAME,
            )
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            if isinstance(exc, InvalidStatus):
                raise PlatformUnavailable(f"the edge refused the terminal: {exc}") from exc
            raise PlatformUnavailable(f"cannot open a terminal at {target}: {exc}") from exc

    async def close(self) -> None:
        rpcs, self._rpcs = self._rpcs, {}
        https, self._https = self._https, {}
        for rpc in rpcs.values():
            await rpc.close()
        for http in https.values():
            await http.aclose()


def _no_data_path() -> Unsupported:
    return Unsupported(
        "this platform has no data path (sessions, streaming, terminals and file "
        "operations need a newer platform); run_shell, exec, read_file and write_file "
        "still work through the API"
    )


async def legacy_run(
    client: DSecClient,
    sandbox_id: str,
    args: dict[str, Any],
    on_stdout: OutputCallback | None,
    on_stderr: OutputCallback | None,
) -> CommandResult:
    """A command through the apiserver's HTTP exec route (platforms without a data path)."""
    call = exec_command(
        sandbox_id,
        args["command"],
        timeout=args.get("timeout"),
        env=args.get("env"),
        workdir=args.get("workdir"),
        user=args.get("user"),
        stdin=args.get("stdin"),
        max_output_bytes=args.get("max_output_bytes"),
    )
    res = await client._send(call)
    if on_stdout is not None and res.stdout:
        on_stdout(res.stdout.encode())
    if on_stderr is not None and res.stderr:
        on_stderr(res.stderr.encode())
    return CommandResult(
        **res.model_dump(), stdout_bytes=res.stdout.encode(), stderr_bytes=res.stderr.encode()
    )


class _Streamer:
    """Output callbacks or a queue, fed by the RPC reader in arrival order."""

    def __init__(
        self,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        *,
        keep: bool = True,
        queue: asyncio.Queue[OutputChunk | None] | None = None,
    ) -> None:
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self._on = {STDOUT: on_stdout, STDERR: on_stderr}
        self._keep = keep
        self._queue = queue

    def __call__(self, stream: int, data: bytes) -> None:
        if self._keep:
            (self.err if stream == STDERR else self.out).append(data)
        callback = self._on.get(stream)
        if callback is not None:
            callback(data)
        if self._queue is not None:
            self._queue.put_nowait(_chunk(stream, data))


class CommandStream:
    """Output of a foreground command as it runs: ``async for chunk in stream``.

    After the loop, ``result`` holds how it ended. Leaving the loop early (or ``aclose``)
    kills the command and its whole process tree.
    """

    def __init__(self, data: DataPathClient, sandbox_id: str, args: dict[str, Any]) -> None:
        self._queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        self._streamer = _Streamer(keep=False, queue=self._queue)
        self._task = asyncio.ensure_future(data.call(sandbox_id, "run", args, self._streamer))
        self._task.add_done_callback(lambda _t: self._queue.put_nowait(None))
        self.result: ExitInfo | None = None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> OutputChunk:
        item = await self._queue.get()
        if item is None:
            self.result = ExitInfo.model_validate(await self._task)
            raise StopAsyncIteration
        return item

    async def wait(self) -> ExitInfo:
        """Drain the rest of the output and return how the command ended."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def aclose(self) -> None:
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, DSecError):
                await self._task

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Process:
    """A command started with ``start``: stream its output (now or later), feed stdin,
    signal it, wait for it. Background commands outlive the connection that started them."""

    def __init__(self, data: DataPathClient, info: ProcessInfo) -> None:
        self._data = data
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def pid(self) -> int:
        return self.info.pid

    def __repr__(self) -> str:
        return f"Process(id={self.id!r}, pid={self.pid}, state={self.info.state!r})"

    async def _call(self, op: str, **args: Any) -> Any:
        return await self._data.call(self.info.sandbox_id, op, {"process": self.id, **args})

    async def refresh(self) -> ProcessInfo:
        self.info = ProcessInfo.model_validate(await self._call("process"))
        return self.info

    async def output(self, *, start: int = 0) -> AsyncIterator[OutputChunk]:
        """Every chunk from the ``start``-th on (all kept output first, then live)."""
        queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        task = asyncio.ensure_future(
            self._data.call(
                self.info.sandbox_id,
                "attach",
                {"process": self.id, "start": start},
                _Streamer(keep=False, queue=queue),
            )
        )
        task.add_done_callback(lambda _t: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            await task
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, DSecError):
                    await task

    async def wait(self) -> ExitInfo:
        return ExitInfo.model_validate(await self._call("wait"))

    async def collect(self) -> CommandResult:
        """Wait for the end and return all kept output with the exit status."""
        out: list[bytes] = []
        err: list[bytes] = []
        async for chunk in self.output():
            (err if chunk.stream == "stderr" else out).append(chunk.data)
        return _result((await self.wait()).model_dump(), out, err)

    async def write_stdin(self, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self._call("stdin", data=base64.b64encode(raw).decode())

    async def close_stdin(self) -> None:
        await self._call("stdin", close=True)

    async def send_signal(self, sig: int | str) -> None:
        """Signal the command's whole process tree (``"interrupt"``, ``"terminate"``, 9...)."""
        try:
            signal_number(sig)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        await self._call("signal", signal=sig)

    async def interrupt(self) -> None:
        await self.send_signal("interrupt")

    async def terminate(self) -> None:
        await self.send_signal("terminate")

    async def kill(self) -> ExitInfo | None:
        """SIGKILL the whole tree and wait for the end."""
        result = await self._call("kill")
        return None if result is None else ExitInfo.model_validate(result)


class Session:
    """A stateful shell: ``cd``, exported variables and ``umask`` carry from one command
    to the next. Commands of one session run one at a time, each as its own process tree
    (a timeout or kill ends that command, never the session). See ``dsec.sessions.shell``.
    """

    def __init__(self, data: DataPathClient, info: SessionInfo) -> None:
        self._data = data
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, sandbox={self.info.sandbox_id!r})"

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult:
        """Run in the session; ``on_stdout``/``on_stderr`` get output as it arrives."""
        args = command_args(
            _string(command),
            session=self.id,
            timeout=timeout,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
        )
        return await run_command(self._data, self.info.sandbox_id, args, on_stdout, on_stderr)

    def stream(
        self, command: str, *, timeout: float | None = None, max_output_bytes: int | None = None
    ) -> CommandStream:
        args = command_args(
            _string(command), session=self.id, timeout=timeout, max_output_bytes=max_output_bytes
        )
        return CommandStream(self._data, self.info.sandbox_id, args)

    async def start(
        self,
        command: str,
        *,
        stdin: bool = False,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
    ) -> Process:
        """A background command that starts from the session's state (and leaves it alone)."""
        args = command_args(
            _string(command),
            session=self.id,
            keep_stdin=stdin,
            timeout=timeout,
            max_output_bytes=max_output_bytes,
        )
        info = await self._data.call(self.info.sandbox_id, "start", args)
        return Process(self._data, ProcessInfo.model_validate(info))

    async def close(self) -> None:
        await self._data.call(self.info.sandbox_id, "session.close", {"session": self.id})

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(DSecError):
            await self.close()


def _string(command: object) -> str:
    if not isinstance(command, str):
        raise InvalidArgument("a session runs a shell command string")
    return command


async def run_command(
    data: DataPathClient,
    sandbox_id: str,
    args: dict[str, Any],
    on_stdout: OutputCallback | None = None,
    on_stderr: OutputCallback | None = None,
) -> CommandResult:
    streamer = _Streamer(on_stdout, on_stderr)
    exit_info = await data.call(sandbox_id, "run", args, streamer)
    return _result(exit_info, streamer.out, streamer.err)


class Pty:
    """An interactive terminal in the sandbox (WebSocket ``/v1/edge/.../pty``)."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self.exit: ExitInfo | None = None
        self.error: DSecError | None = None

    async def read(self) -> bytes:
        """Next screen output; ``b""`` once the shell has ended (see ``exit``)."""
        while True:
            try:
                message = await self._ws.recv()
            except ConnectionClosed:
                return b""
            if isinstance(message, bytes):
                return message
            ctl = json.loads(message)
            if ctl.get("type") == "exit":
                self.exit = ExitInfo.model_validate({k: v for k, v in ctl.items() if k != "type"})
            elif ctl.get("type") == "error":
                self.error = error_from_payload(0, ctl)
                raise self.error

    async def write(self, data: bytes | str) -> None:
        with contextlib.suppress(ConnectionClosed):  # the shell ended; read() says how
            await self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._ws.send(json.dumps({"type": "resize", "rows": rows, "cols": cols}))

    async def close(self) -> None:
        await self._ws.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SandboxDataMixin:
    """Data-path methods of ``Sandbox`` (commands, sessions, processes, terminal, files)."""

    _client: DSecClient

    @property
    def id(self) -> str:
        raise NotImplementedError

    @property
    def _data(self) -> DataPathClient:
        return self._client._data_path()

    # -- commands -------------------------------------------------------------------------
    async def run_shell(
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
        trajectory: Trajectory | None = None,
    ) -> CommandResult:
        """Run ``command`` through ``/bin/sh -c`` in a fresh process; ``timeout`` kills it.

        Fresh rather than a default session: concurrent calls never wait for or disturb
        each other and one call's ``cd``/``export`` cannot surprise the next; use
        :meth:`session` when state should carry over. With ``trajectory`` it is that
        trajectory's next logged, replayable step (``trajectory.run_shell(self, ...)``;
        output callbacks are not called).
        """
        if not isinstance(command, str):
            raise InvalidArgument("run_shell takes a string; use exec() for an argv list")
        if trajectory is not None:
            return await trajectory.run_shell(
                self,  # type: ignore[arg-type]
                command,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
            )
        args = command_args(
            command,
            timeout=timeout,
            env=env,
            workdir=workdir,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
        )
        return await self._run_or_legacy(args, on_stdout, on_stderr)

    async def _run_or_legacy(
        self,
        args: dict[str, Any],
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
    ) -> CommandResult:
        if not self._data.legacy and self.id not in self._data.agentless:
            try:
                return await run_command(self._data, self.id, args, on_stdout, on_stderr)
            except Unsupported as exc:
                if exc.details.get("capability") == "sessions":
                    self._data.agentless.add(self.id)
                elif not self._data.legacy:
                    raise
        return await legacy_run(self._client, self.id, args, on_stdout, on_stderr)

    async def exec(
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
        trajectory: Trajectory | None = None,
    ) -> CommandResult:
        """Run an argv directly, without a shell (``trajectory``: as its next step)."""
        if isinstance(argv, str):
            raise InvalidArgument("exec takes an argv list; use run_shell() for a string")
        if trajectory is not None:
            return await trajectory.exec(
                self,  # type: ignore[arg-type]
                argv,
                timeout=timeout,
                env=env,
                workdir=workdir,
                user=user,
                stdin=stdin,
                max_output_bytes=max_output_bytes,
            )
        args = command_args(
            list(argv),
            timeout=timeout,
            env=env,
            workdir=workdir,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
        )
        return await self._run_or_legacy(args, on_stdout, on_stderr)

    def stream(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
    ) -> CommandStream:
        """Output as it comes: ``async for chunk in sb.stream("make")``."""
        args = command_args(
            command,
            timeout=timeout,
            env=env,
            workdir=workdir,
            user=user,
            max_output_bytes=max_output_bytes,
        )
        return CommandStream(self._data, self.id, args)

    async def start(
        self,
        command: str | Sequence[str],
        *,
        stdin: bool = False,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
    ) -> Process:
        """Start a background command; its output is kept (up to ``max_output_bytes``)."""
        args = command_args(
            command,
            keep_stdin=stdin,
            timeout=timeout,
            env=env,
            workdir=workdir,
            user=user,
            max_output_bytes=max_output_bytes,
        )
        info = await self._data.call(self.id, "start", args)
        return Process(self._data, ProcessInfo.model_validate(info))

    async def process(self, process_id: str) -> Process:
        info = await self._data.call(self.id, "process", {"process": process_id})
        return Process(self._data, ProcessInfo.model_validate(info))

    async def processes(self) -> list[ProcessInfo]:
        """Commands started on the data path: running ones and recent background ones."""
        items = await self._data.call(self.id, "processes", {})
        return [ProcessInfo.model_validate(i) for i in items]

    async def session(
        self,
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
    ) -> Session:
        """A new stateful shell session (several per sandbox, each independent)."""
        try:
            args = SessionArgs.model_validate(
                {"env": dict(env or {}), "workdir": workdir, "user": user}
            )
        except ValidationError as exc:
            raise invalid(exc) from None
        info = await self._data.call(self.id, "session.open", args.model_dump())
        return Session(self._data, SessionInfo.model_validate(info))

    async def sessions(self) -> list[SessionInfo]:
        items = await self._data.call(self.id, "sessions", {})
        return [SessionInfo.model_validate(i) for i in items]

    async def get_session(self, session_id: str) -> Session:
        """An open session again by its id (another client's, or one from before a
        platform restart: sessions survive it). ``SessionNotFound`` if it is not open."""
        for info in await self.sessions():
            if info.id == session_id:
                return Session(self._data, info)
        raise SessionNotFound(f"no session {session_id!r} in sandbox {self.id}")

    async def pty(
        self,
        *,
        rows: int = 24,
        cols: int = 80,
        command: str | None = None,
        term: str = "xterm-256color",
    ) -> Pty:
        """An interactive terminal running ``command`` (default ``/bin/sh``)."""
        query: dict[str, Any] = {"rows": rows, "cols": cols, "term": term}
        if command is not None:
            query["command"] = command
        ws = await self._data.pty_connection(self.id, query)
        return Pty(ws)

    # -- snapshot (a full VM saved as a VM image) -----------------------------------------
    async def snapshot(self, ref: str, *, timeout: float | None = 600.0) -> ImageInfo:
        """Save this running VM (memory and disk, consistent: frozen across both) as the
        VM image ``ref`` ("name:tag"), which ``run_fullvm(vm_image=ref)`` starts from
        without booting, its processes still running. The VM runs on. ``AlreadyExists``
        (409) if ``ref`` names an image; ``Unsupported`` (501) on a backend without
        snapshots."""
        try:
            parse_image_ref(ref)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        resp = await self._data.http_request(
            self.id,
            "POST",
            "/snapshot",
            json_body={"ref": ref},
            timeout=httpx.Timeout(timeout) if timeout is not None else None,
        )
        return ImageInfo.model_validate_json(resp.content)

    # -- computer use (a sandbox with a display: the fullvm backend) ----------------------
    async def screenshot(self) -> bytes:
        """The screen as PNG bytes (read from the VM's display adapter)."""
        resp = await self._data.http_request(self.id, "GET", "/desktop/screenshot")
        return resp.content

    async def mouse_move(self, x: int, y: int) -> None:
        """Move the pointer to pixel (x, y) of the screen."""
        await self._computer("mouse_move", x=x, y=y)

    async def left_click(self, x: int | None = None, y: int | None = None) -> None:
        """Click (at (x, y) if given, else where the pointer is)."""
        await self._computer("left_click", x=x, y=y)

    async def right_click(self, x: int | None = None, y: int | None = None) -> None:
        await self._computer("right_click", x=x, y=y)

    async def middle_click(self, x: int | None = None, y: int | None = None) -> None:
        await self._computer("middle_click", x=x, y=y)

    async def double_click(self, x: int | None = None, y: int | None = None) -> None:
        await self._computer("double_click", x=x, y=y)

    async def scroll(self, direction: Literal["up", "down"] = "down", amount: int = 1) -> None:
        """Turn the wheel ``amount`` notches."""
        await self._computer("scroll", direction=direction, amount=amount)

    async def write(self, text: str) -> None:
        """Type ``text`` on the VM's keyboard (US layout, ASCII)."""
        await self._computer("write", text=text)

    async def press(self, keys: str | Sequence[str]) -> None:
        """Press one key ("enter") or a chord (["ctrl", "c"])."""
        await self._computer("press", keys=[keys] if isinstance(keys, str) else list(keys))

    async def _computer(self, action: str, **fields: Any) -> None:
        try:
            body = ComputerAction.model_validate({"action": action, **fields})
        except ValidationError as exc:
            raise InvalidArgument(f"{action}: {exc.errors()[0]['msg']}") from None
        await self._data.http_request(
            self.id,
            "POST",
            "/desktop/input",
            json_body=body.model_dump(mode="json", exclude_none=True),
        )

    # -- files ----------------------------------------------------------------------------
    async def read_file(self, path: str) -> bytes:
        if not self._data.legacy:
            try:
                return b"".join([chunk async for chunk in self.read_stream(path)])
            except Unsupported:
                if not self._data.legacy:
                    raise
        return await self._client._send(proto.read_file(self.id, path))

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read_file(path)).decode(encoding)

    async def read_stream(self, path: str) -> AsyncIterator[bytes]:
        """A file's content chunk by chunk (large files never sit in memory)."""
        resp = await self._data.http_request(
            self.id, "GET", "/files", params=[("path", _abs(path))], stream=True
        )
        try:
            async for chunk in resp.aiter_bytes():
                yield chunk
        finally:
            await resp.aclose()

    async def write_file(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0o644,
        trajectory: Trajectory | None = None,
    ) -> None:
        """Create or replace a file atomically; a str is written as UTF-8
        (``trajectory``: as its next logged, replayable step)."""
        if trajectory is not None:
            return await trajectory.write_file(self, path, data, mode=mode)  # type: ignore[arg-type]
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgument(f"data must be bytes or str, got {type(data).__name__}")
        if not self._data.legacy:
            try:
                await self._write(path, bytes(data), mode)
                return
            except Unsupported:
                if not self._data.legacy:
                    raise
        await self._client._send(proto.write_file(self.id, path, bytes(data), mode=mode))

    async def write_stream(
        self,
        path: str,
        source: AsyncIterable[bytes] | str | os.PathLike[str],
        *,
        mode: int = 0o644,
    ) -> None:
        """Write a file from async chunks or a local file path, without buffering it."""
        if isinstance(source, str | os.PathLike):
            upload, _ = open_upload(source)
            try:
                await self._write(path, upload.__aiter__(), mode)
            finally:
                upload.close()
        else:
            await self._write(path, source, mode)

    async def _write(self, path: str, content: Any, mode: int) -> None:
        if not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"mode must be a permission value such as 0o644, got {mode!r}")
        await self._data.http_request(
            self.id,
            "PUT",
            "/files",
            params=[("path", _abs(path)), ("mode", format(mode, "o"))],
            content=content,
            timeout=httpx.Timeout(None, connect=10.0),
        )

    async def stat(self, path: str, *, follow: bool = False) -> FileInfo:
        """Type, mode, size, times of ``path`` (the link itself unless ``follow``)."""
        info = await self._data.call(self.id, "fs.stat", {"path": _abs(path), "follow": follow})
        return FileInfo.model_validate(info)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def list_dir(
        self, path: str, *, recursive: bool = False, limit: int | None = None
    ) -> FileList:
        """Entries of a directory (paths relative to it); symlinks are never followed."""
        args: dict[str, Any] = {"path": _abs(path), "recursive": recursive}
        if limit is not None:
            args["limit"] = limit
        return FileList.model_validate(await self._data.call(self.id, "fs.list", args))

    async def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        await self._data.call(
            self.id, "fs.mkdir", {"path": _abs(path), "parents": parents, "mode": mode}
        )

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, an empty directory, or (``recursive``) a whole tree; links are
        removed, never followed."""
        await self._data.call(self.id, "fs.remove", {"path": _abs(path), "recursive": recursive})

    async def move(self, src: str, dst: str) -> None:
        await self._data.call(self.id, "fs.move", {"src": _abs(src), "dst": _abs(dst)})

    async def chmod(self, path: str, mode: int) -> None:
        await self._data.call(self.id, "fs.chmod", {"path": _abs(path), "mode": mode})

    async def upload_dir(
        self, local_dir: str | os.PathLike[str], remote_dir: str
    ) -> dict[str, Any]:
        """Copy a local directory's contents into ``remote_dir`` (a tar stream)."""
        upload, is_dir = open_upload(local_dir)
        if not is_dir:
            upload.close()
            raise InvalidArgument(f"{local_dir} is not a directory")
        try:
            resp = await self._data.http_request(
                self.id,
                "PUT",
                "/archive",
                params=[("path", _abs(remote_dir))],
                content=upload.__aiter__(),
                timeout=httpx.Timeout(None, connect=10.0),
            )
        finally:
            upload.close()
        result: dict[str, Any] = resp.json()
        return result

    async def download_tar(self, remote_dir: str) -> AsyncIterator[bytes]:
        """A sandbox directory (or file) as a tar stream."""
        resp = await self._data.http_request(
            self.id,
            "GET",
            "/archive",
            params=[("path", _abs(remote_dir))],
            stream=True,
            timeout=httpx.Timeout(None, connect=10.0),
        )
        try:
            async for chunk in resp.aiter_bytes(_TAR_CHUNK):
                yield chunk
        finally:
            await resp.aclose()

    async def download_dir(self, remote_dir: str, local_dir: str | os.PathLike[str]) -> None:
        """Copy a sandbox directory into ``local_dir`` (created if missing).

        Extraction uses tarfile's ``data`` filter and skips what it refuses: nothing
        lands outside ``local_dir``, whatever names or links the sandbox planted.
        """
        target = Path(local_dir)
        os.makedirs(target, exist_ok=True)
        read_fd, write_fd = os.pipe()
        loop = asyncio.get_running_loop()

        def extract() -> None:
            with os.fdopen(read_fd, "rb") as fh, tarfile.open(fileobj=fh, mode="r|") as tar:
                tar.extractall(target, filter=_inside_only)

        worker = loop.run_in_executor(None, extract)
        try:
            with os.fdopen(write_fd, "wb") as out:
                async for chunk in self.download_tar(remote_dir):
                    await loop.run_in_executor(None, out.write, chunk)
        finally:
            await worker


def _inside_only(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None  # a link or name that would leave the destination: skipped


def _abs(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise InvalidArgument(f"path must be an absolute path without NUL bytes, got {path!r}")
    return path
