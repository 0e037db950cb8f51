"""The edge's data path: sessions, processes, streaming, files, archives and tokens.

It sits beside the lifecycle (``Edge``) and talks to each sandbox's agent. State is small
and in memory: per sandbox, the open sessions (an id, a user and a lock; the shell state
itself lives in the sandbox, see ``dsec.sessions.shell``) and the commands started on the
data path. Everything of a sandbox is dropped when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import stat
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from dsec.api.events import AuditKind
from dsec.api.exec import CommandArgs, ProcessInfo, SessionArgs, SessionInfo
from dsec.api.files import FileInfo, FileList, FileType
from dsec.api.sandbox import DataPathInfo, SandboxState
from dsec.backends.base import Capability, SandboxRecord
from dsec.edge.edge import Edge
from dsec.edge.tokens import Scope, TokenSigner
from dsec.errors import (
    BackendError,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    ProcessNotFound,
    SessionNotFound,
)
from dsec.sessions import archive
from dsec.sessions import protocol as p
from dsec.sessions.agent_client import AgentClient, ExecStream
from dsec.sessions.processes import ManagedProcess, new_process_id
from dsec.sessions.shell import session_argv, state_path

log = logging.getLogger(__name__)

MAX_FINISHED = 64
#: Output the agent holds per background process for a re-attaching edge (the newest).
KEPT_RING_BYTES = 1 << 20
RESTORE_TIMEOUT = 5.0
MAX_SESSIONS = 256
# A live-view token only has to open one WebSocket (the page asks for a new one on
# every connect): short-lived, so a copied URL is soon worthless.
VIEW_TOKEN_TTL = 600.0
DEFAULT_LIST_LIMIT = 10_000
# Files of a backend without a session agent pass through the edge whole.
BUFFERED_FILE_MAX = 64 << 20


@dataclass
class _Session:
    id: str
    sandbox_id: str
    user: str
    workdir: str
    created_at: datetime
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    commands: int = 0

    def info(self) -> SessionInfo:
        return SessionInfo(
            id=self.id,
            sandbox_id=self.sandbox_id,
            user=self.user,
            created_at=self.created_at,
            commands=self.commands,
            busy=self.lock.locked(),
        )


@dataclass
class _Box:
    sessions: dict[str, _Session] = field(default_factory=dict)
    processes: dict[str, ManagedProcess] = field(default_factory=dict)


_TYPES: dict[int, FileType] = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "directory",
    stat.S_IFLNK: "symlink",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "char",
    stat.S_IFBLK: "block",
}


FS_OPS = {
    p.FS_STAT: "stat",
    p.FS_LIST: "list",
    p.FS_MKDIR: "mkdir",
    p.FS_REMOVE: "remove",
    p.FS_MOVE: "move",
    p.FS_CHMOD: "chmod",
    p.FS_SYMLINK: "symlink",
}


def file_info(entry: p.Entry) -> FileInfo:
    return FileInfo(
        path=entry.name,
        type=_TYPES.get(stat.S_IFMT(entry.mode), "unknown"),
        mode=stat.S_IMODE(entry.mode),
        size=entry.size,
        mtime=datetime.fromtimestamp(entry.mtime_ns / 1e9, UTC),
        uid=entry.uid,
        gid=entry.gid,
        target=entry.target if stat.S_ISLNK(entry.mode) else None,
    )


def check_path(path: str, what: str = "path") -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path or len(path) > 4096:
        raise InvalidArgument(
            f"{what} must be an absolute path without NUL bytes (<= 4096 chars), "
            f"got {str(path)[:200]!r}"
        )
    return path


class DataPlane:
    def __init__(self, edge: Edge, signer: TokenSigner, url: str) -> None:
        self.edge = edge
        self.signer = signer
        self.url = url.rstrip("/")
        self._boxes: dict[str, _Box] = {}
        self._forgets: set[asyncio.Task[None]] = set()
        # adopted paused sandboxes: their agents are frozen, so their processes are
        # re-attached when they run again
        self._pending: set[str] = set()
        self._restores: set[asyncio.Task[None]] = set()
        edge.add_stop_listener(self._forget)
        edge.thaw_listeners.append(self._thawed)
        edge.pause_listeners.append(self._paused)

    # -- tokens ---------------------------------------------------------------------------
    async def data_path(self, sandbox_id: str, *, scope: Scope = "full") -> DataPathInfo:
        """A fresh token for a sandbox that exists (any state: reads of a stopped one
        fail later with sandbox_not_running, which is the clearer error); ``scope="view"``:
        one that opens only the live view, for VIEW_TOKEN_TTL (dsec.edge.tokens)."""
        await self.edge.get(sandbox_id)
        ttl = VIEW_TOKEN_TTL if scope == "view" else None
        token = self.signer.mint(sandbox_id, scope=scope, ttl=ttl)
        return DataPathInfo(
            url=self.url,
            token=token.value,
            expires_at=datetime.fromtimestamp(token.expires_at, UTC),
        )

    def authorize(self, sandbox_id: str, token: str, *, scope: Scope = "full") -> None:
        self.signer.verify(token, sandbox_id, scope=scope)

    # -- plumbing -------------------------------------------------------------------------
    def _forget(self, sandbox_id: str, reason: str) -> None:
        box = self._boxes.pop(sandbox_id, None)
        if box is not None:
            for proc in box.processes.values():
                proc.detach(f"the sandbox is ending ({reason})")

    def _box(self, sandbox_id: str) -> _Box:
        return self._boxes.setdefault(sandbox_id, _Box())

    def _target(self, sandbox_id: str) -> tuple[SandboxRecord, AgentClient]:
        rec = self._running(sandbox_id)
        return rec, self.edge.backend_of(rec, Capability.SESSIONS).agent(rec)

    def _running(self, sandbox_id: str) -> SandboxRecord:
        """The running record of a sandbox with sessions (typed Unsupported if it has
        none), without building its agent client: the command path builds it once."""
        rec = self.edge.running_record(sandbox_id)
        self.edge.backend_of(rec, Capability.SESSIONS)
        return rec

    def _touch(self, sandbox_id: str) -> None:
        self.edge.mark_active(sandbox_id)  # also keeps the idle deadline durable

    # -- sessions -------------------------------------------------------------------------
    async def open_session(self, sandbox_id: str, args: SessionArgs) -> SessionInfo:
        rec = self._running(sandbox_id)
        box = self._box(sandbox_id)
        if len(box.sessions) >= MAX_SESSIONS:
            raise InvalidArgument(
                f"sandbox {sandbox_id} has {MAX_SESSIONS} open sessions; close some first"
            )
        sess = _Session(
            id="s" + secrets.token_hex(8),
            sandbox_id=sandbox_id,
            user=args.user or rec.default_user,
            workdir=args.workdir or rec.default_workdir,
            created_at=datetime.now(UTC),
        )
        # Write the initial state (environment, working directory) once, in the sandbox.
        init = CommandArgs(command=":", env=args.env, user=sess.user, workdir=sess.workdir)
        proc = await self._spawn(rec, init, session=sess, first=True, background=False)
        status = await proc.wait()
        if status.exit_code != 0:
            err = b"".join(data for _, data in proc.drain()).decode(errors="replace")
            raise BackendError(f"cannot start a shell session: {err.strip() or status}")
        box.sessions[sess.id] = sess
        self._save_sessions(rec.id)
        return sess.info()

    def _save_sessions(self, sandbox_id: str) -> None:
        """Keep the sandbox's sessions in its durable record (live restore: a restarted
        edge knows them again; their state itself is a file in the sandbox)."""
        rec = self.edge.find(sandbox_id)
        box = self._boxes.get(sandbox_id)
        if rec is None or rec.state is not SandboxState.RUNNING:
            return
        rec.sessions = {
            s.id: {"user": s.user, "workdir": s.workdir, "created_at": s.created_at.isoformat()}
            for s in (box.sessions.values() if box is not None else ())
        }
        self.edge.state.save_state(rec)

    def _restore_sessions(self, rec: SandboxRecord) -> int:
        saved = rec.sessions
        box = self._box(rec.id)
        for sid, item in saved.items():
            if sid in box.sessions:
                continue
            try:
                box.sessions[sid] = _Session(
                    id=str(sid),
                    sandbox_id=rec.id,
                    user=str(item["user"]),
                    workdir=str(item["workdir"]),
                    created_at=datetime.fromisoformat(str(item["created_at"])),
                )
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("live restore of %s: session %s unreadable: %s", rec.id, sid, exc)
        return len(box.sessions)

    def _session(self, sandbox_id: str, session_id: str) -> _Session:
        sess = self._box(sandbox_id).sessions.get(session_id)
        if sess is None:
            raise SessionNotFound(f"no session {session_id!r} in sandbox {sandbox_id}")
        return sess

    async def close_session(self, sandbox_id: str, session_id: str) -> SessionInfo:
        sess = self._session(sandbox_id, session_id)
        del self._box(sandbox_id).sessions[session_id]
        self._save_sessions(sandbox_id)
        _, agent = self._target(sandbox_id)
        with contextlib.suppress(NotFound):
            await agent.fs(p.FS_REMOVE, state_path(session_id), user=sess.user)
        return sess.info()

    def sessions(self, sandbox_id: str) -> list[SessionInfo]:
        self.edge.running_record(sandbox_id)
        return [s.info() for s in self._box(sandbox_id).sessions.values()]

    # -- processes ------------------------------------------------------------------------
    async def start(
        self,
        sandbox_id: str,
        args: CommandArgs,
        *,
        background: bool,
        pty: tuple[int, int] | None = None,
    ) -> ManagedProcess:
        """Start a command; a session command waits for the session's previous one."""
        rec = self._running(sandbox_id)
        sess = None
        if args.session is not None:
            sess = self._session(sandbox_id, args.session)
            if not isinstance(args.command, str):
                raise InvalidArgument("a session runs shell command strings, not argv lists")
        return await self._spawn(rec, args, session=sess, background=background, pty=pty)

    async def _spawn(
        self,
        rec: SandboxRecord,
        args: CommandArgs,
        *,
        session: _Session | None,
        background: bool,
        first: bool = False,
        pty: tuple[int, int] | None = None,
    ) -> ManagedProcess:
        backend = self.edge.backend_of(rec, Capability.SESSIONS)
        agent = backend.agent(rec)
        command = args.command
        if session is not None:
            assert isinstance(command, str)
            argv = session_argv(session.id, command, save=not background)
            # After the first command the state file is the environment: unset sticks.
            env = backend.command_env(rec, args.env) if first else dict(args.env)
            cwd = session.workdir
            user = session.user
        else:
            argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
            env = backend.command_env(rec, args.env)
            cwd = args.workdir or rec.default_workdir
            user = args.user or rec.default_user
        locked = session is not None and not background
        process_id = new_process_id()
        keep = None
        if background:  # the agent owns it: it outlives this edge (live restore)
            meta = {
                "command": command,
                "session": None if session is None else session.id,
                "user": user,
            }
            text = json.dumps(meta)
            if len(text) > p.KEEP_META_MAX:  # ASCII (json escapes the rest): chars = bytes
                meta["command"] = str(command)[:1024]
                text = json.dumps(meta)
            keep = (process_id, text, KEPT_RING_BYTES)
        if locked:
            assert session is not None
            await session.lock.acquire()
        try:
            stream = await self.edge.call_running(
                rec.id,
                lambda _rec: agent.start(
                    argv,
                    env=env,
                    cwd=cwd,
                    user=user,
                    timeout=args.timeout,
                    max_output=args.max_output_bytes,
                    with_stdin=args.keep_stdin or args.stdin is not None or pty is not None,
                    pty=pty,
                    keep=keep,
                ),
            )
        except BaseException:
            if locked:
                assert session is not None
                session.lock.release()
            raise
        if session is not None:
            session.commands += 0 if first else 1
        proc = self._follow(
            rec,
            stream,
            agent=agent,
            process_id=process_id,
            command=command,
            session=session,
            background=background,
            kept=keep is not None,
            release=session.lock.release if locked and session is not None else None,
        )
        self.edge.audit.record(
            rec.id,
            AuditKind.COMMAND,
            "process_start",
            process=proc.id,
            command=command,
            session=None if session is None else session.id,
            user=user,
            background=background,
            pty=pty is not None,
        )
        if args.stdin is not None:
            await proc.write_stdin(args.stdin.encode(), close=not args.keep_stdin)
        return proc

    def _follow(
        self,
        rec: SandboxRecord,
        stream: ExecStream,
        *,
        agent: AgentClient,
        process_id: str,
        command: str | list[str],
        session: _Session | str | None,
        background: bool,
        kept: bool,
        release: Callable[[], None] | None = None,
        started_at: datetime | None = None,
        ended_before: bool = False,
    ) -> ManagedProcess:
        """The edge's handle of a started (or re-attached) command."""
        box = self._box(rec.id)
        audit = self.edge.audit

        def ended(proc: ManagedProcess) -> None:
            if ended_before:  # an edge saw it end (and put that on record) before
                self._prune(box, agent)
                return
            self.edge.command_finished(rec.id)
            exit_info = proc.exit
            self.edge.metrics.command_ended(str(rec.spec.backend), exit_info)
            audit.record(
                rec.id,
                AuditKind.COMMAND,
                "process_end",
                process=proc.id,
                **(exit_info.model_dump() if exit_info else {"error": str(proc.error)}),
            )
            if exit_info is not None:
                self.edge.limits.after_exec(
                    rec,
                    exit_code=exit_info.exit_code,
                    timed_out=exit_info.timed_out,
                    truncated=exit_info.truncated,
                    command=proc.command,
                    process=proc.id,
                )
            if release is not None:
                release()
            if not proc.background:
                box.processes.pop(proc.id, None)
            else:
                self._prune(box, agent)

        proc = ManagedProcess(
            stream,
            sandbox_id=rec.id,
            command=command,
            session=session.id if isinstance(session, _Session) else session,
            background=background,
            on_activity=lambda: self._touch(rec.id),
            on_exit=ended,
            process_id=process_id,
            started_at=started_at,
            kept=kept,
        )
        box.processes[proc.id] = proc
        return proc

    def _prune(self, box: _Box, agent: AgentClient) -> None:
        finished = [p for p in box.processes.values() if not p.running]
        finished.sort(key=lambda proc: proc.ended_monotonic or 0.0)
        for proc in finished[: max(0, len(finished) - MAX_FINISHED)]:
            box.processes.pop(proc.id, None)
            if proc.kept:  # collected: the agent may drop its status and output too
                task = asyncio.get_running_loop().create_task(self._agent_forget(agent, proc.id))
                self._forgets.add(task)
                task.add_done_callback(self._forgets.discard)

    @staticmethod
    async def _agent_forget(agent: AgentClient, key: str) -> None:
        with contextlib.suppress(BackendError, NotFound, InvalidArgument):
            await agent.forget(key)

    # -- live restore ---------------------------------------------------------------------
    async def restore(self, sandbox_ids: list[str]) -> dict[str, int]:
        """Re-attach to the background processes the agents of re-adopted sandboxes own
        (same ids, output from the oldest chunk still held, exit status of those that
        ended while no edge was there), and know their sessions again. Returns counts:
        running, exited, failed (processes) and sessions."""
        counts = {"running": 0, "exited": 0, "failed": 0, "sessions": 0}
        await asyncio.gather(*(self._restore_box(sid, counts) for sid in sandbox_ids))
        if any(counts.values()):
            log.info("live restore: re-attached background processes %s", counts)
        return counts

    async def _restore_box(
        self, sandbox_id: str, counts: dict[str, int], before_ns: int | None = None
    ) -> None:
        """``before_ns``: only processes started before then (wall clock), so none that
        this edge started itself is taken over twice."""
        before_ns = time.time_ns() if before_ns is None else before_ns
        rec = self.edge.record(sandbox_id)
        counts["sessions"] += self._restore_sessions(rec)
        if rec.state is not SandboxState.RUNNING:
            self._pending.add(sandbox_id)  # paused (frozen: its agent cannot answer now)
            return
        backend = self.edge.backends.get(rec.kind)
        if backend is None or Capability.SESSIONS not in backend.capabilities_of(rec):
            return  # no agent to ask: nothing of it to follow again
        agent = backend.agent(rec)
        try:
            async with asyncio.timeout(RESTORE_TIMEOUT):
                kept = await agent.kept()
        except (BackendError, NotFound, InvalidArgument, TimeoutError) as exc:
            log.warning("live restore of %s: cannot list its processes: %s", sandbox_id, exc)
            counts["failed"] += 1
            return
        box = self._box(sandbox_id)
        for k in sorted(kept, key=lambda k: k.started_ns):
            known = box.processes.get(k.key)
            if (known is not None and not known.suspended) or k.started_ns >= before_ns:
                continue
            if rec.state is not SandboxState.RUNNING:  # it ended meanwhile
                return
            try:
                meta = json.loads(k.meta) if k.meta else {}
                if not isinstance(meta, dict):
                    meta = {}
                async with asyncio.timeout(RESTORE_TIMEOUT):
                    stream = await agent.attach(k.key, 0)
            except (BackendError, NotFound, InvalidArgument, ValueError, TimeoutError) as exc:
                log.warning("live restore of %s/%s: %s", sandbox_id, k.key, exc)
                counts["failed"] += 1
                continue
            command = meta.get("command", "")
            session = meta.get("session")
            self._follow(
                rec,
                stream,
                agent=agent,
                process_id=k.key,
                command=command if isinstance(command, str | list) else str(command),
                session=session if isinstance(session, str) else None,
                background=True,
                kept=True,
                started_at=datetime.fromtimestamp(k.started_ns / 1e9, UTC),
                # The agent says the end went out to a client, not that the edge that
                # got it lived to record it: the record itself decides (exactly once).
                ended_before=k.delivered
                and self.edge.audit.has_record(
                    rec.id, AuditKind.COMMAND, "process_end", process=k.key
                ),
            )
            counts["running" if k.running else "exited"] += 1

    async def _paused(self, sandbox_id: str) -> None:
        """A sandbox was paused: if its backend's reclaim ends every agent connection
        (a microVM saved to a file), stop following its background processes now, so
        that none is reported failed, and follow them again once it runs (``_thawed``,
        as after an edge restart: same ids, output from the oldest chunk held)."""
        rec = self.edge.find(sandbox_id)
        if rec is None or not self.edge.backend_of(rec).reclaim_drops_agent_links:
            return
        box = self._boxes.get(sandbox_id)
        if box is None:
            return
        procs = [p for p in box.processes.values() if p.kept and p.running]
        await asyncio.gather(*(p.suspend() for p in procs), return_exceptions=True)
        self._pending.add(sandbox_id)

    def _thawed(self, sandbox_id: str) -> None:
        if sandbox_id not in self._pending:
            return
        self._pending.discard(sandbox_id)
        counts = {"running": 0, "exited": 0, "failed": 0, "sessions": 0}
        task = asyncio.get_running_loop().create_task(
            self._restore_box(sandbox_id, counts, time.time_ns())
        )
        self._restores.add(task)
        task.add_done_callback(self._restores.discard)

    async def close(self) -> None:
        """Stop following the agents' processes without ending them (platform shutdown:
        what a sandbox runs lives on, and the next edge re-attaches)."""
        procs = [
            proc
            for box in self._boxes.values()
            for proc in box.processes.values()
            if proc.kept and proc.running
        ]
        await asyncio.gather(*(proc.suspend() for proc in procs), return_exceptions=True)
        for task in [*self._forgets, *self._restores]:
            task.cancel()

    def process(self, sandbox_id: str, process_id: str) -> ManagedProcess:
        self.edge.record(sandbox_id)
        proc = self._boxes.get(sandbox_id, _Box()).processes.get(process_id)
        if proc is None:
            raise ProcessNotFound(
                f"no process {process_id!r} in sandbox {sandbox_id} (finished foreground "
                "commands are not kept; background ones are kept until 64 newer ones ended)"
            )
        return proc

    def processes(self, sandbox_id: str) -> list[ProcessInfo]:
        self.edge.record(sandbox_id)
        procs = self._boxes.get(sandbox_id, _Box()).processes.values()
        return sorted((proc.info() for proc in procs), key=lambda i: i.started_at)

    # -- files ----------------------------------------------------------------------------
    async def _fs(
        self, sandbox_id: str, op: int, path: str, **kw: object
    ) -> tuple[list[p.Entry], bytes]:
        rec, agent = self._target(sandbox_id)
        check_path(path)
        detail = {k: v for k, v in kw.items() if k in ("path2", "mode")}
        self.edge.audit.record(
            sandbox_id, AuditKind.FILE, FS_OPS.get(op, str(op)), path=path, **detail
        )
        return await self.edge.call_running(
            sandbox_id,
            lambda _rec: agent.fs(op, path, user=rec.spec.init_user, **kw),  # type: ignore[arg-type]
        )

    async def stat(self, sandbox_id: str, path: str, *, follow: bool = False) -> FileInfo:
        _, tail = await self._fs(
            sandbox_id, p.FS_STAT, path, flags=p.FS_FLAG_FOLLOW if follow else 0
        )
        entries = p.decode_entries(tail)
        if len(entries) != 1:
            raise BackendError(f"the sandbox agent answered stat of {path!r} with {entries!r}")
        return file_info(entries[0])

    async def list_dir(
        self, sandbox_id: str, path: str, *, recursive: bool = False, limit: int | None = None
    ) -> FileList:
        if limit is not None and limit < 1:
            raise InvalidArgument(f"limit must be positive, got {limit}")
        entries, tail = await self._fs(
            sandbox_id,
            p.FS_LIST,
            path,
            flags=p.FS_FLAG_RECURSIVE if recursive else 0,
            limit=limit or DEFAULT_LIST_LIMIT,
        )
        truncated = len(tail) >= 12 and tail[8] != 0
        return FileList(entries=[file_info(e) for e in entries], truncated=truncated)

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool, mode: int) -> None:
        await self._fs(
            sandbox_id, p.FS_MKDIR, path, flags=p.FS_FLAG_PARENTS if parents else 0, mode=mode
        )

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool) -> None:
        await self._fs(sandbox_id, p.FS_REMOVE, path, flags=p.FS_FLAG_RECURSIVE if recursive else 0)

    async def move(self, sandbox_id: str, src: str, dst: str) -> None:
        await self._fs(sandbox_id, p.FS_MOVE, src, path2=check_path(dst, "dst"))

    async def chmod(self, sandbox_id: str, path: str, mode: int) -> None:
        await self._fs(sandbox_id, p.FS_CHMOD, path, mode=mode)

    def _without_agent(self, sandbox_id: str) -> bool:
        """Whether the sandbox's backend has files but no session agent (a full VM's
        guest agent): its file routes then go through the backend, buffered."""
        rec = self.edge.running_record(sandbox_id)
        caps = self.edge.backend_of(rec).capabilities_of(rec)
        return Capability.SESSIONS not in caps and Capability.FILES in caps

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's chunks; opened (and errors raised) before this returns."""
        if self._without_agent(sandbox_id):
            data = await self.edge.read_file(
                sandbox_id, check_path(path), max_bytes=BUFFERED_FILE_MAX
            )
            return _chunks([data] if data else [])
        rec, agent = self._target(sandbox_id)
        self.edge.audit.record(sandbox_id, AuditKind.FILE, "read_stream", path=path)
        stream = agent.read_stream(check_path(path), user=rec.spec.init_user)
        first = await self.edge.call_running(sandbox_id, lambda _rec: _first(stream))
        return _prepend(first, stream, lambda: self._touch(sandbox_id))

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int
    ) -> int:
        if self._without_agent(sandbox_id):
            data = bytearray()
            async for chunk in chunks:
                data += chunk
                if len(data) > BUFFERED_FILE_MAX:
                    raise LimitExceeded(
                        f"this sandbox's backend takes files of at most {BUFFERED_FILE_MAX} bytes",
                        max_bytes=BUFFERED_FILE_MAX,
                    )
            await self.edge.write_file(sandbox_id, check_path(path), bytes(data), mode=mode)
            return len(data)
        rec, agent = self._target(sandbox_id)
        self.edge.audit.record(sandbox_id, AuditKind.FILE, "write_stream", path=path)
        return await self.edge.call_running(
            sandbox_id,
            lambda _rec: agent.write_stream(
                check_path(path), chunks, user=rec.spec.init_user, mode=mode
            ),
        )

    async def download(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        rec, agent = self._target(sandbox_id)
        self.edge.audit.record(sandbox_id, AuditKind.FILE, "download", path=path)
        stream = archive.download(agent, check_path(path), user=rec.spec.init_user)
        first = await self.edge.call_running(sandbox_id, lambda _rec: _first(stream))
        return _prepend(first, stream, lambda: self._touch(sandbox_id))

    async def upload(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes]
    ) -> archive.UploadStats:
        rec, agent = self._target(sandbox_id)
        self.edge.audit.record(sandbox_id, AuditKind.FILE, "upload", path=path)
        return await self.edge.call_running(
            sandbox_id,
            lambda _rec: archive.upload(agent, check_path(path), chunks, user=rec.spec.init_user),
        )


async def _chunks(items: list[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def _first(stream: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def _prepend(
    first: bytes | None, rest: AsyncIterator[bytes], touch: Callable[[], None]
) -> AsyncIterator[bytes]:
    """``first`` then the rest of ``rest``; every chunk counts as sandbox activity."""
    try:
        if first is None:
            return
        yield first
        async for chunk in rest:
            touch()
            yield chunk
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
