"""envd, the in-sandbox API of E2B, served for every sandbox by the platform.

The SDK names the sandbox with ``E2b-Sandbox-Id`` and proves access with the
``X-Access-Token`` we issued at create (our per-sandbox data-path token). Process and
filesystem services speak Connect (dsec.compat.e2b.connect); ``/files`` and
``/health`` are plain HTTP. Everything goes through our DataPlane, so protected paths,
limits, activity (idle TTL) and audit are those of our own data path.

A cluster apiserver has no data plane: it relays envd to the sandbox's edge, which
serves these routes itself (dsec.compat.e2b.forward), so this is the only envd.

Commands start as our background processes: they are listed, reconnected to by pid,
and outlive the stream that started them, as in envd. E2B runs ``/bin/bash -l -c``;
an image without bash (busybox) gets ``/bin/sh -l -c`` instead.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import posixpath
import stat as statmod
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse, Response, StreamingResponse

from dsec.api.exec import MAX_OUTPUT_BYTES, CommandArgs
from dsec.api.files import FileInfo
from dsec.apiserver.filestreams import nonempty
from dsec.apiserver.limits import ApiLimits, set_body_limit
from dsec.compat.e2b import connect as c
from dsec.compat.e2b.access import Access
from dsec.compat.e2b.mapping import HOME
from dsec.compat.e2b.watch import POLL, Watcher, Watchers, snapshot
from dsec.edge.dataplane import DataPlane
from dsec.errors import DSecError, FileNotFound, ProcessNotFound
from dsec.sessions.processes import ManagedProcess

# sh runs bash when the image has it, else itself, with E2B's arguments.
SHELL_SHIM = ["/bin/sh", "-c", 'command -v bash >/dev/null && exec bash "$@"; exec sh "$@"', "sh"]
KEEPALIVE = 30.0
STDOUT = 1
FILE_TYPES = {"file": "FILE_TYPE_FILE", "directory": "FILE_TYPE_DIRECTORY"}
UPLOAD_CHUNK = 1 << 20


def resolve(path: object, what: str = "path") -> str:
    """An absolute, normalised path; relative ones are below the user's home."""
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise c.ConnectError("invalid_argument", f"{what} must be a non-empty path")
    full = path if path.startswith("/") else posixpath.join(HOME, path)
    return posixpath.normpath(full).replace("//", "/")


def _user(request: Request) -> str | None:
    """The user of E2B's ``Authorization: Basic base64(user:)``; None = the default."""
    value = request.headers.get("authorization", "")
    scheme, _, cred = value.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        name = base64.b64decode(cred, validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise c.ConnectError("invalid_argument", "bad Authorization header") from None
    return None if name in ("", "user") else name


def entry(info: FileInfo, path: str) -> dict[str, Any]:
    kind = "symlink" if info.type == "symlink" else info.type
    out: dict[str, Any] = {
        "name": posixpath.basename(path) or "/",
        "type": FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
        "path": path,
        "size": str(info.size),
        "mode": info.mode,
        "permissions": statmod.filemode(info.mode | _type_bits(info.type)),
        "owner": str(info.uid),
        "group": str(info.gid),
        "modifiedTime": info.mtime.astimezone(UTC).isoformat().replace("+00:00", "Z"),
    }
    if info.type == "symlink":
        out["type"] = "FILE_TYPE_FILE"
        out["isSymlink"] = True
        if info.target is not None:
            out["symlinkTarget"] = info.target
    return out


def _type_bits(kind: str) -> int:
    return {"directory": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}.get(kind, statmod.S_IFREG)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _pid(body: dict[str, Any]) -> int:
    selector = body.get("process")
    pid = selector.get("pid") if isinstance(selector, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise c.ConnectError("invalid_argument", "process.pid is required (tags are not supported)")
    return pid


def _e2b_config(command: str | list[str]) -> dict[str, Any]:
    argv = [command] if isinstance(command, str) else list(command)
    if argv[: len(SHELL_SHIM)] == SHELL_SHIM:
        argv = ["/bin/bash", *argv[len(SHELL_SHIM) :]]
    return {"cmd": argv[0], "args": argv[1:], "envs": {}}


class Envd:
    def __init__(self, access: Access, plane: DataPlane, limits: ApiLimits) -> None:
        self.access = access
        self.plane = plane
        self.limits = limits
        self.watchers = Watchers(self.plane)

    async def sandbox(self, request: Request) -> str:
        h = request.headers
        return await self.access.envd(
            h.get("e2b-sandbox-id"), h.get("x-access-token"), h.get("x-api-key")
        )

    def find(self, sandbox_id: str, pid: int) -> ManagedProcess:
        for info in self.plane.processes(sandbox_id):
            if info.pid == pid:
                return self.plane.process(sandbox_id, info.id)
        raise ProcessNotFound(f"process with pid {pid} not found")

    async def stat(self, sid: str, path: str) -> dict[str, Any]:
        return entry(await self.plane.stat(sid, path), path)

    # -- process ----------------------------------------------------------------------
    async def start(self, request: Request, body: dict[str, Any]) -> ManagedProcess:
        sid = await self.sandbox(request)
        config = body.get("process")
        if not isinstance(config, dict) or not isinstance(config.get("cmd"), str):
            raise c.ConnectError("invalid_argument", "process.cmd is required")
        if body.get("pty"):
            raise c.ConnectError("unimplemented", "PTY is not supported through E2B")
        cmd, args = config["cmd"], config.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise c.ConnectError("invalid_argument", "process.args must be strings")
        argv = [*SHELL_SHIM, *args] if cmd in ("/bin/bash", "bash") else [cmd, *args]
        envs = config.get("envs") or {}
        cwd = resolve(config["cwd"], "cwd") if config.get("cwd") else HOME
        try:
            command = CommandArgs(
                command=argv,
                env=envs,
                workdir=cwd,
                user=_user(request),
                keep_stdin=bool(body.get("stdin")),
                timeout=86400,
                max_output_bytes=MAX_OUTPUT_BYTES,
            )
        except ValueError as exc:
            raise c.ConnectError("invalid_argument", str(exc).splitlines()[0]) from None
        return await self.plane.start(sid, command, background=True)

    async def events(
        self, proc: ManagedProcess, *, start: bool, keepalive: float = KEEPALIVE
    ) -> AsyncIterator[bytes]:
        """The process's events as envelopes: start, data as it comes (with
        keepalives), end; never cut while the process runs."""
        if start:
            yield c.message_envelope({"event": {"start": {"pid": proc.pid}}})
        chunks = proc.output().__aiter__()
        while True:
            nxt = asyncio.ensure_future(chunks.__anext__())
            try:
                while True:
                    done, _ = await asyncio.wait({nxt}, timeout=keepalive)
                    if done:
                        break
                    yield c.message_envelope({"event": {"keepalive": {}}})
                fd, data = nxt.result()
            except StopAsyncIteration:
                break
            finally:
                if not nxt.done():
                    nxt.cancel()
            key = "stdout" if fd == STDOUT else "stderr"
            yield c.message_envelope({"event": {"data": {key: _b64(data)}}})
        try:
            exit_info = await proc.wait()
        except DSecError as exc:
            yield c.end_stream(c.as_connect_error(exc))
            return
        code = exit_info.exit_code
        status = "signal: killed" if code == 137 else f"exit status {code}"
        end: dict[str, Any] = {"exitCode": code, "exited": code < 128, "status": status}
        if exit_info.timed_out:
            end["error"] = "the command timed out"
        elif exit_info.truncated:
            end["error"] = f"output beyond {MAX_OUTPUT_BYTES} bytes was dropped"
        yield c.message_envelope({"event": {"end": end}})
        yield c.end_stream()

    async def list_processes(self, request: Request, _body: dict[str, Any]) -> dict[str, Any]:
        sid = await self.sandbox(request)
        procs = [
            {"config": _e2b_config(p.command), "pid": p.pid}
            for p in self.plane.processes(sid)
            if p.state == "running"
        ]
        return {"processes": procs}

    async def send_input(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        proc = self.find(await self.sandbox(request), _pid(body))
        data = body.get("input")
        raw = data.get("stdin", "") if isinstance(data, dict) else ""
        try:
            payload = base64.b64decode(raw, validate=True)
        except (binascii.Error, TypeError):
            raise c.ConnectError("invalid_argument", "input.stdin must be base64") from None
        await proc.write_stdin(payload)
        return {}

    async def close_stdin(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        proc = self.find(await self.sandbox(request), _pid(body))
        await proc.write_stdin(b"", close=True)
        return {}

    async def send_signal(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        proc = self.find(await self.sandbox(request), _pid(body))
        signal = body.get("signal")
        if signal in ("SIGNAL_SIGKILL", 9):
            await proc.kill()
        elif signal in ("SIGNAL_SIGTERM", 15):
            await proc.send_signal(15)
        else:
            raise c.ConnectError("invalid_argument", "signal must be SIGKILL or SIGTERM")
        return {}

    # -- filesystem -------------------------------------------------------------------
    async def fs_stat(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        sid = await self.sandbox(request)
        return {"entry": await self.stat(sid, resolve(body.get("path")))}

    async def make_dir(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        sid = await self.sandbox(request)
        path = resolve(body.get("path"))
        with contextlib.suppress(FileNotFound):
            await self.plane.stat(sid, path)
            raise c.ConnectError("already_exists", f"{path} already exists")
        await self.plane.mkdir(sid, path, parents=True, mode=0o755)
        return {"entry": await self.stat(sid, path)}

    async def move(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        sid = await self.sandbox(request)
        src, dst = resolve(body.get("source"), "source"), resolve(body.get("destination"))
        await self.plane.move(sid, src, dst)
        return {"entry": await self.stat(sid, dst)}

    async def remove(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        sid = await self.sandbox(request)
        await self.plane.remove(sid, resolve(body.get("path")), recursive=True)
        return {}

    async def list_dir(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        sid = await self.sandbox(request)
        path = resolve(body.get("path"))
        depth = body.get("depth") or 1
        if not isinstance(depth, int) or depth < 1:
            raise c.ConnectError("invalid_argument", "depth must be a positive integer")
        listing = await self.plane.list_dir(sid, path, recursive=depth > 1)
        entries = []
        for info in listing.entries:
            rel = info.path.lstrip("/")
            if rel.count("/") >= depth:
                continue
            entries.append(entry(info, posixpath.join(path, rel)))
        return {"entries": entries}

    async def watcher(self, request: Request, body: dict[str, Any]) -> Watcher:
        sid = await self.sandbox(request)
        w = Watcher(
            sid,
            resolve(body.get("path")),
            bool(body.get("recursive")),
            bool(body.get("includeEntry")),
        )
        info = await self.plane.stat(sid, w.path, follow=True)
        if info.type != "directory":
            raise c.ConnectError("invalid_argument", f"{w.path} is not a directory")
        return w

    async def create_watcher(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        return {"watcherId": await self.watchers.create(await self.watcher(request, body))}

    async def watcher_events(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        w = self.watchers.get(await self.sandbox(request), str(body.get("watcherId", "")))
        return {"events": await self.watchers.changes(w, entry)}

    async def remove_watcher(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        self.watchers.remove(await self.sandbox(request), str(body.get("watcherId", "")))
        return {}

    async def watch_stream(self, w: Watcher) -> AsyncIterator[bytes]:
        """Start, then each change as it is seen (and keepalives) until the client goes."""
        w.seen = await snapshot(self.plane, w)
        yield c.message_envelope({"start": {}})  # the oneof's members are fields here
        quiet = 0.0
        while True:
            await asyncio.sleep(POLL)
            try:
                events = await self.watchers.changes(w, entry)
            except DSecError as exc:
                yield c.end_stream(c.as_connect_error(exc))
                return
            quiet = 0.0 if events else quiet + POLL
            for ev in events:
                yield c.message_envelope({"filesystem": ev})
            if quiet >= KEEPALIVE:
                quiet = 0.0
                yield c.message_envelope({"keepalive": {}})

    # -- /files -----------------------------------------------------------------------
    async def read_file(self, request: Request) -> Response:
        sid = await self.sandbox(request)
        path = resolve(request.query_params.get("path"))
        chunks = await self.plane.read_stream(sid, path)
        return StreamingResponse(chunks, media_type="application/octet-stream")

    async def write_files(self, request: Request) -> Response:
        sid = await self.sandbox(request)
        set_body_limit(request, self.limits.max_stream_bytes, "file")
        query_path = request.query_params.get("path")
        ctype = request.headers.get("content-type", "")
        written: list[dict[str, str]] = []
        if ctype.startswith("multipart/form-data"):
            form = await request.form(max_files=1000, max_fields=1000)
            uploads = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not uploads:
                raise c.ConnectError("invalid_argument", "no file in the multipart body")
            for upload in uploads:
                name = query_path if len(uploads) == 1 and query_path else upload.filename
                path = resolve(name)
                await self._write(sid, path, _upload_chunks(upload))
                written.append({"name": posixpath.basename(path), "type": "file", "path": path})
        else:
            if request.headers.get("content-encoding"):
                raise c.ConnectError("unimplemented", "compressed uploads are not supported")
            path = resolve(query_path)
            await self._write(sid, path, request.stream())
            written.append({"name": posixpath.basename(path), "type": "file", "path": path})
        return JSONResponse(written)

    async def _write(self, sid: str, path: str, chunks: AsyncIterator[bytes]) -> None:
        parent = posixpath.dirname(path)
        if parent != "/":
            await self.plane.mkdir(sid, parent, parents=True, mode=0o755)
        await self.plane.write_stream(sid, path, nonempty(chunks), mode=0o644)


async def _upload_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(UPLOAD_CHUNK):
        yield chunk


def envd_error(exc: BaseException) -> Response:
    """A plain-HTTP envd error: ``{"code": status, "message"}``."""
    if isinstance(exc, c.ConnectError):
        status = c.HTTP_STATUS.get(exc.code, 500)
        message = exc.message
    elif isinstance(exc, DSecError):
        status = 400 if exc.status == 422 else exc.status
        message = exc.message
    else:
        raise exc
    return JSONResponse({"code": status, "message": message}, status_code=status)


def keepalive_of(request: Request) -> float:
    """The client's ``Keepalive-Ping-Interval`` (seconds, 1..KEEPALIVE), else KEEPALIVE."""
    try:
        asked = float(request.headers.get("keepalive-ping-interval", KEEPALIVE))
    except ValueError:
        return KEEPALIVE
    return min(max(asked, 1.0), KEEPALIVE)


def stream_error(exc: BaseException) -> Response:
    """A stream that fails before its first message: only the end-of-stream error."""
    err = c.as_connect_error(exc)
    return Response(c.end_stream(err), media_type=c.STREAM_CONTENT_TYPE)


Unary = Callable[[Request, dict[str, Any]], Awaitable[dict[str, Any]]]


def envd_router(envd: Envd) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def unary(path: str, method: Unary) -> None:
        async def handler(request: Request) -> Response:
            try:
                body = c.decode_json(await request.body())
                out = await method(request, body)
            except (c.ConnectError, DSecError) as exc:
                err = c.as_connect_error(exc)
                return Response(
                    c.error_body(err),
                    status_code=c.HTTP_STATUS.get(err.code, 500),
                    media_type=c.UNARY_CONTENT_TYPE,
                )
            return JSONResponse(out)

        router.add_api_route(path, handler, methods=["POST"])

    def stream(
        path: str,
        open_: Callable[[Request, dict[str, Any]], Awaitable[tuple[ManagedProcess, bool]]],
    ) -> None:
        async def handler(request: Request) -> Response:
            # The request is read and the call made before the response starts: once
            # it streams, Starlette's disconnect listener owns the receive channel.
            try:
                msg = c.decode_stream_request(await request.body())
                proc, first = await open_(request, msg)
            except (c.ConnectError, DSecError) as exc:
                return stream_error(exc)
            events = envd.events(proc, start=first, keepalive=keepalive_of(request))
            return StreamingResponse(events, media_type=c.STREAM_CONTENT_TYPE)

        router.add_api_route(path, handler, methods=["POST"])

    async def watch_dir(request: Request) -> Response:
        try:
            msg = c.decode_stream_request(await request.body())
            w = await envd.watcher(request, msg)
        except (c.ConnectError, DSecError) as exc:
            return stream_error(exc)
        return StreamingResponse(envd.watch_stream(w), media_type=c.STREAM_CONTENT_TYPE)

    router.add_api_route("/filesystem.Filesystem/WatchDir", watch_dir, methods=["POST"])
    unary("/filesystem.Filesystem/CreateWatcher", envd.create_watcher)
    unary("/filesystem.Filesystem/GetWatcherEvents", envd.watcher_events)
    unary("/filesystem.Filesystem/RemoveWatcher", envd.remove_watcher)

    async def open_start(request: Request, msg: dict[str, Any]) -> tuple[ManagedProcess, bool]:
        return await envd.start(request, msg), True

    async def open_connect(request: Request, msg: dict[str, Any]) -> tuple[ManagedProcess, bool]:
        proc = envd.find(await envd.sandbox(request), _pid(msg))
        return proc, True

    stream("/process.Process/Start", open_start)
    stream("/process.Process/Connect", open_connect)
    unary("/process.Process/List", envd.list_processes)
    unary("/process.Process/SendInput", envd.send_input)
    unary("/process.Process/CloseStdin", envd.close_stdin)
    unary("/process.Process/SendSignal", envd.send_signal)
    unary("/filesystem.Filesystem/Stat", envd.fs_stat)
    unary("/filesystem.Filesystem/MakeDir", envd.make_dir)
    unary("/filesystem.Filesystem/Move", envd.move)
    unary("/filesystem.Filesystem/Remove", envd.remove)
    unary("/filesystem.Filesystem/ListDir", envd.list_dir)

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=204)

    @router.get("/files")
    async def read_file(request: Request) -> Response:
        try:
            return await envd.read_file(request)
        except (c.ConnectError, DSecError) as exc:
            return envd_error(exc)

    @router.post("/files")
    async def write_file(request: Request) -> Response:
        try:
            return await envd.write_files(request)
        except (c.ConnectError, DSecError) as exc:
            return envd_error(exc)

    return router
