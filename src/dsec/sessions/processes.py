"""Commands started on the data path: output kept for readers, stdin, signals, waiting.

A ``ManagedProcess`` owns the agent connection of one command. A pump task reads the
command's output as it comes and appends it to a log that any number of readers follow
from any offset, so a background process can be streamed "later" and a foreground one
as it runs. Memory is bounded by the command's output cap (the agent drops and flags
everything beyond it); a foreground process's log is trimmed as its reader consumes it.

A *kept* process (``kept=True``: the edge's background processes) belongs to the agent
inside the sandbox, which holds its output in a bounded ring of numbered chunks and its
exit status after the end. The edge only follows it: a restarted edge re-attaches
(:meth:`ManagedProcess.reattached`) with the same id, and the chunk numbers stay the same,
so a client reads on from the offset it had. :meth:`suspend` stops following without
ending anything (a platform going down while its sandboxes live on).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from dsec.api.exec import ExitInfo, ProcessInfo
from dsec.errors import DSecError, InvalidArgument, SandboxNotRunning
from dsec.sessions.agent_client import ExecStream

__all__ = ["ManagedProcess", "new_process_id"]


def new_process_id() -> str:
    return "p" + secrets.token_hex(8)


class ManagedProcess:
    def __init__(
        self,
        stream: ExecStream,
        *,
        sandbox_id: str,
        command: str | list[str],
        session: str | None,
        background: bool,
        on_activity: Callable[[], None] | None = None,
        on_exit: Callable[[ManagedProcess], None] | None = None,
        process_id: str | None = None,
        started_at: datetime | None = None,
        kept: bool = False,
    ) -> None:
        self.id = process_id or new_process_id()
        self.sandbox_id = sandbox_id
        self.command = command
        self.session = session
        self.background = background
        self.kept = kept
        """The agent owns the process: it outlives this edge (see the module doc)."""
        self.started_at = started_at or datetime.now(UTC)
        self._suspended = False
        self.ended_monotonic: float | None = None
        self._stream = stream
        self._on_activity = on_activity
        self._on_exit = on_exit
        self._log: list[tuple[int, bytes]] = []
        # index of _log[0] in the whole output (trimmed chunks before it, or chunks a
        # re-attached stream starts after)
        self._base = stream.base
        self._bytes = 0
        self._changed = asyncio.Event()
        self.exit: ExitInfo | None = None
        self.error: DSecError | None = None
        self._done = asyncio.Event()
        self._detached: str | None = None
        self._pump = asyncio.create_task(self._run(), name=f"dsec-process-{self.id}")

    @property
    def pid(self) -> int:
        return self._stream.pid

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def info(self) -> ProcessInfo:
        state = "running" if self.running else ("failed" if self.error else "exited")
        return ProcessInfo(
            id=self.id,
            sandbox_id=self.sandbox_id,
            session=self.session,
            command=self.command,
            pid=self.pid,
            state=state,
            background=self.background,
            started_at=self.started_at,
            exit=self.exit,
            error=None if self.error is None else self.error.message,
            output_bytes=self._bytes,
        )

    async def _run(self) -> None:
        try:
            async for chunk in self._stream.chunks():
                self._log.append(chunk)
                self._bytes += len(chunk[1])
                self._changed.set()
                if self._on_activity is not None:
                    self._on_activity()
            status = self._stream.status
            assert status is not None
            self.exit = ExitInfo(
                exit_code=status.exit_code,
                timed_out=status.timed_out,
                truncated=status.truncated,
                duration=status.duration_ns / 1e9,
            )
        except DSecError as exc:
            self.error = SandboxNotRunning(
                f"the sandbox stopped or its agent died while the command ran: {exc.message}"
            )
        except asyncio.CancelledError:
            self.error = SandboxNotRunning(self._detached or "the command was abandoned")
        finally:
            self.ended_monotonic = time.monotonic()
            if self.exit is not None:
                # It ended and said how: whoever waits (the reply to the client) goes
                # first; closing the agent connection and the bookkeeping (on_exit: the
                # audit record, the detectors) follow in this task a loop iteration or
                # two later, off the command's critical path (nothing is skipped).
                self._done.set()
                self._changed.set()
            try:
                await self._stream.aclose()
            finally:  # also when cancelled while closing: the end is still on record
                self._done.set()
                self._changed.set()
                if not self._suspended:
                    if self._on_activity is not None:
                        self._on_activity()
                    if self._on_exit is not None:
                        self._on_exit(self)

    async def output(
        self, start: int = 0, *, trim: bool = False
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Chunks ``(stream, bytes)`` from chunk index ``start`` on, live until the end.

        ``trim`` drops what was read (the single reader of a foreground command), so a
        long-running stream holds at most what the reader has not consumed yet.
        """
        index = max(start, self._base)
        while True:
            while index - self._base < len(self._log):
                chunk = self._log[index - self._base]
                index += 1
                if trim:
                    del self._log[: index - self._base]
                    self._base = index
                yield chunk
            if self._done.is_set():
                return
            self._changed.clear()
            await self._changed.wait()

    async def wait(self) -> ExitInfo:
        await self._done.wait()
        if self.exit is None:
            assert self.error is not None
            raise self.error
        return self.exit

    async def write_stdin(self, data: bytes, *, close: bool = False) -> None:
        if not self.running:
            raise InvalidArgument(f"process {self.id} has ended; its stdin is closed")
        if data:
            await self._stream.write_stdin(data)
        if close:
            await self._stream.close_stdin()

    async def send_signal(self, signo: int) -> None:
        if self.running:
            await self._stream.send_signal(signo)

    async def resize(self, rows: int, cols: int) -> None:
        if self.running:
            await self._stream.resize(rows, cols)

    async def kill(self, timeout: float = 5.0) -> ExitInfo | None:
        """Kill the whole process tree and wait for the end (exit code 137)."""
        if self.running:
            with contextlib.suppress(DSecError):
                await self._stream.send_signal(9)
            try:
                async with asyncio.timeout(timeout):
                    await self._done.wait()
            except TimeoutError:
                await self.abandon()
        return self.exit

    def detach(self, reason: str) -> None:
        """Stop following the command (its sandbox is ending); no waiting."""
        if self.running:
            self._detached = reason
            self._pump.cancel()

    @property
    def suspended(self) -> bool:
        """Not followed any more, though it runs on in its sandbox (see ``suspend``)."""
        return self._suspended

    async def suspend(self) -> None:
        """Stop following a kept process without ending it or reporting an end (the edge
        shuts down; the agent keeps the process, its output and its status)."""
        if self.running:
            self._suspended = True
            self._detached = "the platform shut down (the process runs on in its sandbox)"
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    def drain(self) -> list[tuple[int, bytes]]:
        """The output kept so far (for errors of short internal commands)."""
        return list(self._log)

    async def abandon(self) -> None:
        """Drop the agent connection; the agent then kills the whole tree."""
        if self.running:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
