"""Async client for ``dsec-init``, the agent that runs as pid 1 inside each sandbox.

The edge talks to each sandbox's agent over a unix socket on the host. Every operation
opens its own connection: the agent serves any number at once, a slow command never
blocks a file read, and closing a connection is how a caller abandons a command (the
agent then kills the command's whole process tree).

Agent failures arrive as an errno plus a message and are mapped to the typed errors of
:mod:`dsec.errors`, so callers see ``FileNotFound`` or ``PermissionDenied``, never a
bare ``OSError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import socket
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NoReturn, Self, TypeVar

from dsec.api.exec import ExecResult
from dsec.errors import (
    BackendError,
    Conflict,
    DSecError,
    FileNotFound,
    InvalidArgument,
    LimitExceeded,
    PermissionDenied,
)
from dsec.sessions import protocol as p

T = TypeVar("T")

__all__ = ["AgentClient", "AgentExecResult", "ExecStream"]

#: Extra time the client gives the agent beyond a command's own timeout before it
#: declares the agent broken (the agent enforces the timeout itself).
_AGENT_GRACE = 30.0
_STDOUT = 1
_STDERR = 2


@dataclass(frozen=True)
class AgentExecResult:
    """How a command ended and what it printed (both streams capped by ``max_output``)."""

    exit_code: int
    """Exit status, or 128 + signal number when a signal killed it (137 on timeout)."""
    stdout: bytes
    stderr: bytes
    duration: float
    """Seconds from start until the main process exited."""
    timed_out: bool
    truncated: bool
    """Output beyond ``max_output`` was read and dropped."""

    def as_exec_result(self) -> ExecResult:
        """The API's answer: text streams (undecodable bytes replaced)."""
        return ExecResult(
            exit_code=self.exit_code,
            stdout=self.stdout.decode(errors="replace"),
            stderr=self.stderr.decode(errors="replace"),
            duration=self.duration,
            timed_out=self.timed_out,
            truncated=self.truncated,
        )


def agent_error(err: int, message: str, *, reading: bool = False) -> DSecError:
    """Typed error for an ``F`` frame from the agent (``reading``: EFBIG means too big)."""
    details = {"errno": errno.errorcode.get(err, str(err))}
    if err == errno.ENOENT:
        return FileNotFound(message, **details)
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(message, **details)
    if err == errno.EFBIG and reading:
        return LimitExceeded(message, **details)
    if err in (
        errno.EISDIR,
        errno.ENOTDIR,
        errno.EINVAL,
        errno.ENAMETOOLONG,
        errno.EFBIG,
        errno.ELOOP,
        errno.ENOEXEC,
        errno.E2BIG,
        errno.EEXIST,
        errno.ENOTEMPTY,
        errno.EXDEV,
    ):
        return InvalidArgument(message, **details)
    if err == errno.EBUSY:
        return Conflict(message, **details)
    if err in (errno.ENOSPC, errno.EDQUOT):
        return LimitExceeded(f"{message} (sandbox disk is full or over quota)", **details)
    if err in (errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE):
        return LimitExceeded(f"{message} (sandbox process or memory limit reached)", **details)
    return BackendError(message, **details)


def _connect(path: str) -> socket.socket:
    """A connected unix socket to ``path``, without blocking. A unix connect completes
    at once or fails at once: then the socket is used right away, where
    ``open_unix_connection(path)`` waited a loop turn for writability first, on every
    command. A full backlog (a stalled or hostile agent) fails with EAGAIN, as libuv's
    connect did, and never blocks the loop."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


class _Connection:
    """One connection to the agent, carrying exactly one operation."""

    def __init__(
        self, path: Path, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, op: str
    ) -> None:
        self._path = path
        self._reader = reader
        self._writer = writer
        self._op = op

    @classmethod
    async def open(cls, path: Path, op: str) -> _Connection:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=_connect(str(path)))
        except OSError as exc:
            raise BackendError(
                f"sandbox agent is not reachable at {path}: {exc.strerror or exc}",
                socket=str(path),
            ) from exc
        return cls(path, reader, writer, op)

    def _lost(self, what: str, exc: BaseException | None = None) -> NoReturn:
        raise BackendError(
            f"sandbox agent at {self._path} {what} during {self._op}",
            socket=str(self._path),
        ) from exc

    def send(self, data: bytes) -> None:
        """Queue whole frames; one write call per frame keeps concurrent writers safe."""
        if self._writer.is_closing():
            self._lost("closed the connection")
        self._writer.write(data)

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self._lost("closed the connection", exc)

    async def read_frame(self) -> tuple[int, bytes]:
        try:
            kind, length = p.parse_header(await self._reader.readexactly(p.HEADER_SIZE))
            payload = await self._reader.readexactly(length) if length else b""
        except asyncio.IncompleteReadError as exc:
            self._lost("closed the connection", exc)
        except p.ProtocolError as exc:
            self._lost(f"sent an invalid frame ({exc})", exc)
        except (ConnectionError, OSError) as exc:
            self._lost(f"reset the connection ({exc})", exc)
        return kind, payload

    async def read_until_eof(self) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while await self._reader.read(p.CHUNK_SIZE):
                pass

    def unexpected(self, kind: int) -> NoReturn:
        self._lost(f"sent an unexpected frame {chr(kind)!r}")

    def answer(self, kind: int, body: bytes, expected: int) -> bytes:
        """The body of a reply that should be ``expected``: the agent's refusal raised
        as its typed error, anything else as a broken agent."""
        if kind == p.T_FAIL:
            raise agent_error(*p.decode_failure(body))
        if kind != expected:
            self.unexpected(kind)
        return body

    async def expect(self, expected: int) -> bytes:
        """Read the next frame as an ``answer`` of kind ``expected``."""
        return self.answer(*await self.read_frame(), expected)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()


async def _running(socket_path: Path, request: bytes, what: str) -> tuple[_Connection, int]:
    """Send ``request`` (an exec or an attach) on a new connection and read the pid of
    the program it runs, or raise the agent's reason; the connection is closed on any
    failure."""
    conn = await _Connection.open(socket_path, what)
    try:
        conn.send(request)
        return conn, p.decode_u32(await conn.expect(p.T_PID))
    except BaseException:
        await conn.close()
        raise


class _ExecStream:
    """A started command on its own connection.

    ``AgentClient.exec`` drives one to completion. Sessions and streaming (issue 3) use
    it directly: iterate :meth:`chunks` for output as it arrives, feed stdin with
    :meth:`write_stdin` / :meth:`close_stdin`, signal the whole process tree with
    :meth:`send_signal`; :meth:`aclose` before the end kills the tree.
    """

    def __init__(self, conn: _Connection, pid: int, base: int = 0) -> None:
        self._conn = conn
        self.pid = pid
        """Process id of the command inside the sandbox."""
        self.base = base
        """Number of the first output chunk this stream yields (0 unless re-attached)."""
        self.status: p.ExitStatus | None = None
        """Set once the command has ended (after :meth:`next_chunk` returned ``None``)."""

    @classmethod
    async def start(
        cls, socket_path: Path, request: p.ExecRequest, frame: bytes | None = None
    ) -> _ExecStream:
        """Send the request (``frame``: already encoded) and wait until the program runs
        (or raise why it cannot)."""
        if frame is None:
            frame = p.encode_exec(request)
        conn, pid = await _running(socket_path, frame, f"exec of {request.argv[0]!r}")
        return cls(conn, pid)

    @classmethod
    async def attach(cls, socket_path: Path, key: str, start: int) -> _ExecStream:
        """Follow a kept command again, its output from chunk ``start`` (or the oldest
        one the agent still holds: see :attr:`base`)."""
        try:
            request = p.encode_attach(key, start)
        except ValueError as exc:
            raise _invalid(exc) from None
        conn, pid = await _running(socket_path, request, f"attach to {key!r}")
        try:
            return cls(conn, pid, p.decode_u64(await conn.expect(p.T_BASE)))
        except BaseException:
            await conn.close()
            raise

    async def next_chunk(self) -> tuple[int, bytes] | None:
        """Next output chunk as ``(1, stdout bytes)`` or ``(2, stderr bytes)``; ``None``
        once the command has ended, with :attr:`status` set."""
        if self.status is not None:
            return None
        kind, body = await self._conn.read_frame()
        if kind == p.T_STDOUT:
            return _STDOUT, body
        if kind == p.T_STDERR:
            return _STDERR, body
        if kind == p.T_EXIT:
            self.status = p.decode_exit(body)
            return None
        self._conn.unexpected(kind)

    async def chunks(self) -> AsyncIterator[tuple[int, bytes]]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def write_stdin(self, data: bytes) -> None:
        """Send stdin bytes (the request must have had ``with_stdin``); waits for buffer room,
        which is how a command that reads slowly slows the writer down."""
        for chunk in p.encode_data_frames(p.T_STDIN, data):
            self._conn.send(chunk)
            await self._conn.drain()

    async def close_stdin(self) -> None:
        self._conn.send(p.frame(p.T_CLOSE))
        await self._conn.drain()

    async def send_signal(self, signo: int) -> None:
        """Deliver a signal to every process of the command's tree."""
        self._conn.send(p.encode_signal(signo))
        await self._conn.drain()

    async def resize(self, rows: int, cols: int) -> None:
        """Set the size of the command's terminal (commands started with ``pty``)."""
        try:
            data = p.encode_resize(rows, cols)
        except ValueError as exc:
            raise _invalid(exc) from None
        self._conn.send(data)
        await self._conn.drain()

    async def aclose(self) -> None:
        """Close the connection; a command still running is killed with its whole tree."""
        await self._conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _invalid(exc: ValueError) -> InvalidArgument:
    return InvalidArgument(str(exc))


class AgentClient:
    """Talks to one sandbox's agent through the host-side path of its unix socket."""

    def __init__(self, socket_path: Path) -> None:
        # Built several times per command: no copy of a Path we were given.
        self.socket_path = socket_path if isinstance(socket_path, Path) else Path(socket_path)

    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: str,
        timeout: float | None,
        max_output: int,
        stdin: bytes | None,
    ) -> AgentExecResult:
        """Run a command to completion and collect its output.

        ``env`` is the complete environment (the agent adds HOME, USER, LOGNAME and a
        default PATH only when missing); ``cwd`` "" means the user's home directory;
        ``timeout`` kills the whole process tree (``timed_out``, exit code 137);
        ``max_output`` caps stdout + stderr together, the rest is dropped (``truncated``).
        """
        request, frame = self._exec_request(argv, env, cwd, user, timeout, max_output, stdin)
        guard = None if timeout is None else timeout + _AGENT_GRACE
        out, err = bytearray(), bytearray()
        try:
            async with asyncio.timeout(guard):
                stream = await _ExecStream.start(self.socket_path, request, frame)
                async with stream:
                    feeder = None
                    if stdin is not None:
                        feeder = asyncio.create_task(_feed_stdin(stream, stdin))
                    try:
                        async for fd, data in stream.chunks():
                            (out if fd == _STDOUT else err).extend(data)
                    finally:
                        if feeder is not None:
                            feeder.cancel()
                            with contextlib.suppress(asyncio.CancelledError, DSecError):
                                await feeder
        except TimeoutError as exc:
            raise BackendError(
                f"sandbox agent at {self.socket_path} did not finish {argv[0]!r} "
                f"within {guard:.0f}s although the command timeout was {timeout}s",
                socket=str(self.socket_path),
            ) from exc
        status = stream.status
        assert status is not None
        return AgentExecResult(
            exit_code=status.exit_code,
            stdout=bytes(out),
            stderr=bytes(err),
            duration=status.duration_ns / 1e9,
            timed_out=status.timed_out,
            truncated=status.truncated,
        )

    async def start(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: str,
        timeout: float | None,
        max_output: int,
        with_stdin: bool,
        pty: tuple[int, int] | None = None,
        keep: tuple[str, str, int] | None = None,
    ) -> ExecStream:
        """Start a command and return its stream (output as it comes, stdin, signals).

        Closing the stream before the command ends kills its whole process tree, unless
        ``keep`` (key, meta, ring bytes) hands the command to the agent: it then runs on,
        and :meth:`attach` follows it again (also from a restarted edge).
        """
        request, frame = self._exec_request(
            argv, env, cwd, user, timeout, max_output, b"" if with_stdin else None, pty, keep
        )
        return await _ExecStream.start(self.socket_path, request, frame)

    async def attach(self, key: str, start: int = 0) -> ExecStream:
        """Follow a kept command again from output chunk ``start`` (see ``ExecStream.base``)."""
        return await _ExecStream.attach(self.socket_path, key, start)

    async def kept(self) -> list[p.KeptCommand]:
        """The commands the agent owns (running, or finished and not forgotten)."""
        kept, _ = await self._gather(
            p.frame(p.OP_LIST), "list of kept processes", lambda body: [p.decode_kept(body)]
        )
        return kept

    async def _gather(
        self, request: bytes, what: str, decode: Callable[[bytes], list[T]]
    ) -> tuple[list[T], bytes]:
        """Send one request and collect its answer: every D frame through ``decode``
        (a malformed one is a BackendError), until Y (its payload is returned) or F
        (the agent's typed error)."""
        conn = await _Connection.open(self.socket_path, what)
        try:
            conn.send(request)
            out: list[T] = []
            while True:
                kind, body = await conn.read_frame()
                if kind == p.T_DATA:
                    try:
                        out.extend(decode(body))
                    except p.ProtocolError as exc:
                        self._bad(exc)
                elif kind == p.T_DONE:
                    return out, body
                elif kind == p.T_FAIL:
                    raise agent_error(*p.decode_failure(body))
                else:
                    conn.unexpected(kind)
        finally:
            await conn.close()

    async def forget(self, key: str) -> bool:
        """Drop a finished kept command (its status and output); False if none was dropped."""
        try:
            request = p.encode_forget(key)
        except ValueError as exc:
            raise _invalid(exc) from None
        conn = await _Connection.open(self.socket_path, f"forget of {key!r}")
        try:
            conn.send(request)
            return p.decode_u64(await conn.expect(p.T_DONE)) == 1
        finally:
            await conn.close()

    @staticmethod
    def _exec_request(
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        user: str,
        timeout: float | None,
        max_output: int,
        stdin: bytes | None,
        pty: tuple[int, int] | None = None,
        keep: tuple[str, str, int] | None = None,
    ) -> tuple[p.ExecRequest, bytes]:
        """The request and its ``X`` frame; a value the agent would refuse is a typed
        error here, before any connection."""
        if not argv:
            raise InvalidArgument("argv must not be empty")
        if timeout is not None and not 0 < timeout < p.U32_MAX / 1000:
            raise InvalidArgument(f"timeout must be positive seconds or None, not {timeout}")
        if max_output < 0:
            raise InvalidArgument(f"max_output must not be negative, not {max_output}")
        request = p.ExecRequest(
            argv=list(argv),
            env=dict(env),
            cwd=cwd,
            user=user,
            timeout_ms=0 if timeout is None else max(1, math.ceil(timeout * 1000)),
            max_output=min(max_output, p.U64_MAX),
            with_stdin=stdin is not None,
            pty=pty,
            keep=keep,
        )
        try:
            return request, p.encode_exec(request)
        except ValueError as exc:
            raise _invalid(exc) from None

    async def read_file(self, path: str, *, user: str, max_bytes: int) -> bytes:
        """Read a file as ``user``; larger than ``max_bytes`` raises ``LimitExceeded``."""
        if max_bytes < 0:
            raise InvalidArgument(f"max_bytes must not be negative, not {max_bytes}")
        parts: list[bytes] = []
        size = 0
        async with contextlib.aclosing(
            self.read_stream(path, user=user, max_bytes=max_bytes)
        ) as chunks:
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise LimitExceeded(f"{path!r} is larger than {max_bytes} bytes")
                parts.append(chunk)
        return b"".join(parts)

    async def write_file(
        self, path: str, data: bytes, *, user: str, mode: int, make_parents: bool = True
    ) -> None:
        """Write a file as ``user``, atomically: readers see the old or the new content."""

        async def whole() -> AsyncIterator[bytes]:
            yield data

        await self.write_stream(path, whole(), user=user, mode=mode, make_parents=make_parents)

    async def read_stream(
        self, path: str, *, user: str, max_bytes: int = p.U64_MAX
    ) -> AsyncGenerator[bytes, None]:
        """Read a file as ``user`` chunk by chunk (never the whole file in memory).

        The file is opened before the first chunk is yielded, so a missing file raises at
        the first ``__anext__``; abandoning the iterator closes the agent connection.
        """
        try:
            request = p.encode_read(path, user=user, max_bytes=max_bytes)
        except ValueError as exc:
            raise _invalid(exc) from None
        conn = await _Connection.open(self.socket_path, f"read of {path!r}")
        try:
            conn.send(request)
            size = 0
            while True:
                kind, body = await conn.read_frame()
                if kind == p.T_DATA:
                    size += len(body)
                    yield body
                elif kind == p.T_DONE:
                    if p.decode_u64(body) != size:
                        conn.unexpected(kind)
                    return
                elif kind == p.T_FAIL:
                    raise agent_error(*p.decode_failure(body), reading=True)
                else:
                    conn.unexpected(kind)
        finally:
            await conn.close()

    async def write_stream(
        self,
        path: str,
        chunks: AsyncIterable[bytes],
        *,
        user: str,
        mode: int,
        make_parents: bool = True,
    ) -> int:
        """Write a file as ``user`` from chunks as they come; atomic like ``write_file``.

        Returns the number of bytes written. If ``chunks`` raises, nothing is replaced.
        """
        try:
            request = p.encode_write(path, user=user, mode=mode, make_parents=make_parents)
        except ValueError as exc:
            raise _invalid(exc) from None
        conn = await _Connection.open(self.socket_path, f"write of {path!r}")
        total = 0
        try:
            conn.send(request)
            reply = asyncio.create_task(conn.read_frame())
            try:
                try:
                    async for data in chunks:
                        if reply.done():
                            break
                        total += len(data)
                        for chunk in p.encode_data_frames(p.T_DATA, data):
                            conn.send(chunk)
                        await conn.drain()
                    else:
                        conn.send(p.frame(p.T_CLOSE))
                        await conn.drain()
                except BackendError:
                    if not reply.done():
                        raise
                kind, body = await reply
            finally:
                if not reply.done():
                    reply.cancel()
                with contextlib.suppress(asyncio.CancelledError, DSecError):
                    await reply
            if p.decode_u64(conn.answer(kind, body, p.T_DONE)) != total:
                conn.unexpected(kind)
            return total
        finally:
            await conn.close()

    async def fs(
        self,
        op: int,
        path: str,
        *,
        user: str,
        flags: int = 0,
        mode: int = 0,
        limit: int = 0,
        path2: str = "",
    ) -> tuple[list[p.Entry], bytes]:
        """One ``O`` operation: ``(entries sent in D frames, payload of the final Y)``."""
        try:
            request = p.encode_fs(
                op, path, user=user, flags=flags, mode=mode, limit=limit, path2=path2
            )
        except ValueError as exc:
            raise _invalid(exc) from None
        return await self._gather(request, f"file operation on {path!r}", p.decode_entries)

    def _bad(self, exc: Exception) -> NoReturn:
        raise BackendError(
            f"sandbox agent at {self.socket_path} sent a malformed reply: {exc}",
            socket=str(self.socket_path),
        )

    async def ping(self, timeout: float = 1.0) -> None:
        """Check that the agent answers; raises ``BackendError`` if it does not in time."""
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(timeout):
                conn = await _Connection.open(self.socket_path, "ping")
                conn.send(p.frame(p.OP_PING))
                kind, _ = await conn.read_frame()
                if kind != p.T_DONE:
                    conn.unexpected(kind)
        except TimeoutError as exc:
            raise BackendError(
                f"sandbox agent is not reachable at {self.socket_path}: "
                f"no answer to ping within {timeout}s",
                socket=str(self.socket_path),
            ) from exc
        finally:
            if conn is not None:
                await conn.close()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the agent to kill every process in the sandbox and exit (ends the sandbox)."""
        conn = await _Connection.open(self.socket_path, "shutdown")
        try:
            conn.send(p.frame(p.OP_SHUTDOWN))
            await conn.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await conn.read_until_eof()
        finally:
            await conn.close()


async def _feed_stdin(stream: _ExecStream, data: bytes) -> None:
    await stream.write_stdin(data)
    await stream.close_stdin()


ExecStream = _ExecStream
"""Public name of a started command's stream (see :meth:`AgentClient.start`)."""
