"""Wire protocol between the edge and ``dsec-init``, the agent inside every sandbox.

Pure encoding and decoding, no I/O, so the client, tests and future session code share
one definition. The C side (``src/dsec/agent/dsec-init.c``) must agree byte for byte.

Framing (little-endian): ``u8 type, u32 payload length, payload``. Strings inside a
payload are ``u32 length + bytes``. One connection carries one operation, chosen by the
first frame the client sends:

- ``X`` exec: str user, u32 flags, u32 timeout_ms, u64 max_output, str cwd,
  u32 argc + strs, u32 envc + strs ("K=V"), and with the PTY flag u32 rows, u32 cols
  (the command then runs on a new terminal: one output stream, ``O``). The client may
  then send ``I`` (stdin bytes), ``C`` (close stdin), ``S`` (u32 signal for the whole
  process tree), ``T`` (u32 rows, u32 cols: resize the terminal). The agent answers
  ``P`` (u32 pid), ``O``/``E`` (stdout/stderr bytes, in arrival order) and finally
  ``Z`` (i32 exit code, u32 flags, u64 duration_ns); or ``F`` if the program never started.
- ``R`` read file: str user, u64 max_bytes, str path -> ``D`` chunks, then ``Y`` (u64 total).
- ``W`` write file: str user, u32 mode, u32 flags, str path; the client sends ``D`` chunks
  and ``C``; the agent answers ``Y`` (u64 bytes written).
- ``O`` file-system operation: str user, u32 op, u32 flags, u32 mode, u64 limit, str path,
  str path2 -> ``Y``; ``stat`` answers one entry record in ``Y``, ``list`` sends entry
  records in ``D`` frames and ends with ``Y`` (u64 count, u32 truncated). An entry record
  is u32 mode, u32 uid, u32 gid, u64 size, i64 mtime_ns, str name, str symlink target.
  Like ``R``/``W`` it runs as ``user`` inside the sandbox's mount namespace and root.
  With the KEEP flag (str key, str meta, u32 ring bytes follow) the agent owns the
  command ("kept": the edge's background processes): closing the connection does not
  kill it, its output goes to a bounded ring of numbered records (each an ``O``/``E``
  frame), and its exit status is held after the end, so a restarted edge finds it again:
- ``L`` list kept commands -> one ``D`` per command (str key, str meta, u32 pid, u32
  state 1 running / 2 exited and its ``Z`` delivered to a client / 3 exited and not yet
  delivered, the 16-byte ``Z`` payload, u64 first and next record
  number, i64 start ns since the epoch), then ``Y`` (u64 count).
- ``A`` attach: str key, u64 first record wanted -> ``P`` (u32 pid), ``B`` (u64 number of
  the first record that follows), the records, live output and ``Z`` as for an exec
  (stdin, signals and resizing work too). A previous client of that command is dropped.
- ``K`` forget: str key -> ``Y`` (u64 1 if a finished command was dropped).
- ``H`` ping -> ``Y`` (u64 0).   ``Q`` shutdown: the agent kills everything and exits.

Any operation may end with ``F``: i32 errno, then a UTF-8 message (rest of the payload).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# Operations (first frame from the client).
OP_EXEC = ord("X")
OP_READ = ord("R")
OP_WRITE = ord("W")
OP_PING = ord("H")
OP_FS = ord("O")
OP_SHUTDOWN = ord("Q")
OP_LIST = ord("L")
OP_ATTACH = ord("A")
OP_FORGET = ord("K")

# Client -> agent, after the first frame.
T_STDIN = ord("I")
T_CLOSE = ord("C")
T_SIGNAL = ord("S")
T_RESIZE = ord("T")

# Agent -> client (``D`` is also client -> agent during a write).
T_PID = ord("P")
T_STDOUT = ord("O")
T_STDERR = ord("E")
T_EXIT = ord("Z")
T_FAIL = ord("F")
T_DATA = ord("D")
T_DONE = ord("Y")
T_BASE = ord("B")

EXEC_FLAG_STDIN = 1
EXEC_FLAG_PTY = 2
EXEC_FLAG_KEEP = 4
KEEP_KEY_MAX = 64
KEEP_META_MAX = 4096
EXIT_FLAG_TIMED_OUT = 1
EXIT_FLAG_TRUNCATED = 2
WRITE_FLAG_MAKE_PARENTS = 1

# ``O`` sub-operations and flags.
FS_STAT = 1
FS_LIST = 2
FS_MKDIR = 3
FS_REMOVE = 4
FS_MOVE = 5
FS_CHMOD = 6
FS_SYMLINK = 7
FS_FLAG_PARENTS = 1
FS_FLAG_RECURSIVE = 2
FS_FLAG_FOLLOW = 4

HEADER = struct.Struct("<BI")
HEADER_SIZE = HEADER.size
#: Largest payload either side accepts in one frame (the agent enforces the same value).
MAX_PAYLOAD = 16 << 20
#: Data frames are at most this big; keeps both sides' buffers small.
CHUNK_SIZE = 64 << 10

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_EXIT = struct.Struct("<iIQ")
U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF


class ProtocolError(ValueError):
    """The peer sent bytes that are not a valid frame or payload."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One frame, ready to write (header and payload in one buffer so frames never interleave)."""
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(kind, len(payload)) + payload


def parse_header(header: bytes) -> tuple[int, int]:
    """``(type, payload length)`` of a 5-byte header; rejects oversized frames."""
    kind, length = HEADER.unpack(header)
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"frame of type {kind!r} announces {length} bytes (max {MAX_PAYLOAD})")
    return int(kind), int(length)


def pack_str(value: str | bytes) -> bytes:
    """A length-prefixed string; ``str`` is encoded like file names (UTF-8, surrogateescape)."""
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    if b"\0" in raw:
        raise ValueError(f"string contains a NUL byte: {raw[:60]!r}")
    return _U32.pack(len(raw)) + raw


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def _strs(values: Iterable[str | bytes]) -> bytes:
    items = [pack_str(v) for v in values]
    return _U32.pack(len(items)) + b"".join(items)


@dataclass(frozen=True)
class ExecRequest:
    """Everything the agent needs to start one command (validated by :func:`encode_exec`)."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str
    user: str
    timeout_ms: int
    max_output: int
    with_stdin: bool
    pty: tuple[int, int] | None = None
    """``(rows, cols)``: run on a new terminal instead of pipes."""
    keep: tuple[str, str, int] | None = None
    """``(key, meta, ring bytes)``: the agent owns the command (see ``L``/``A``/``K``)."""


def encode_exec(req: ExecRequest) -> bytes:
    """The ``X`` frame. Raises ``ValueError`` for values the agent would refuse."""
    if not req.argv:
        raise ValueError("argv must not be empty")
    if not 0 <= req.timeout_ms <= U32_MAX:
        raise ValueError(f"timeout_ms out of range: {req.timeout_ms}")
    if not 0 <= req.max_output <= U64_MAX:
        raise ValueError(f"max_output out of range: {req.max_output}")
    env = []
    for key, value in req.env.items():
        if not key or "=" in key:
            raise ValueError(f"invalid environment variable name: {key!r}")
        env.append(f"{key}={value}")
    flags = (
        (EXEC_FLAG_STDIN if req.with_stdin else 0)
        | (EXEC_FLAG_PTY if req.pty else 0)
        | (EXEC_FLAG_KEEP if req.keep else 0)
    )
    tail = b""
    if req.pty is not None:
        rows, cols = req.pty
        if not (0 <= rows <= 0xFFFF and 0 <= cols <= 0xFFFF):
            raise ValueError(f"terminal size out of range: {rows}x{cols}")
        tail = _U32.pack(rows) + _U32.pack(cols)
    if req.keep is not None:
        key, meta, ring = req.keep
        if not 0 < len(key.encode()) <= KEEP_KEY_MAX or len(meta.encode()) > KEEP_META_MAX:
            raise ValueError(f"kept command: key of 1-{KEEP_KEY_MAX} bytes, meta <= 4096")
        if not 0 <= ring <= U32_MAX:
            raise ValueError(f"ring size out of range: {ring}")
        tail += pack_str(key) + pack_str(meta) + _U32.pack(ring)
    payload = b"".join(
        (
            pack_str(req.user),
            _U32.pack(flags),
            _U32.pack(req.timeout_ms),
            _U64.pack(req.max_output),
            pack_str(req.cwd),
            _strs(req.argv),
            _strs(env),
            tail,
        )
    )
    return frame(OP_EXEC, payload)


def encode_attach(key: str, start: int) -> bytes:
    if not 0 <= start <= U64_MAX:
        raise ValueError(f"record number out of range: {start}")
    return frame(OP_ATTACH, pack_str(key) + _U64.pack(start))


def encode_forget(key: str) -> bytes:
    return frame(OP_FORGET, pack_str(key))


@dataclass(frozen=True)
class KeptCommand:
    """One ``D`` record of an ``L`` answer: a command the agent owns."""

    key: str
    meta: str
    pid: int
    running: bool
    status: ExitStatus | None
    delivered: bool
    """Its end (``Z``) reached a client in full (an edge saw it end)."""
    first: int
    """Number of the oldest output record the agent still holds."""
    next: int
    """Number the next output record will get (records so far)."""
    started_ns: int


_KEPT_TAIL = struct.Struct("<II16sQQq")


def decode_kept(payload: bytes) -> KeptCommand:
    view = memoryview(payload)
    pos = 0
    strs: list[str] = []
    try:
        for _ in range(2):
            (n,) = _U32.unpack_from(view, pos)
            pos += 4
            if pos + n > len(view):
                raise ProtocolError("kept command record is cut short")
            strs.append(bytes(view[pos : pos + n]).decode("utf-8", "replace"))
            pos += n
        pid, state, z, first, nxt, started = _KEPT_TAIL.unpack_from(view, pos)
    except struct.error as exc:
        raise ProtocolError(f"malformed kept command record: {exc}") from None
    if pos + _KEPT_TAIL.size != len(view) or state not in (1, 2, 3):
        raise ProtocolError("malformed kept command record")
    return KeptCommand(
        key=strs[0],
        meta=strs[1],
        pid=pid,
        running=state == 1,
        status=None if state == 1 else decode_exit(z),
        delivered=state == 2,
        first=first,
        next=nxt,
        started_ns=started,
    )


def encode_read(path: str, *, user: str, max_bytes: int) -> bytes:
    if not 0 <= max_bytes <= U64_MAX:
        raise ValueError(f"max_bytes out of range: {max_bytes}")
    return frame(OP_READ, pack_str(user) + _U64.pack(max_bytes) + pack_str(path))


def encode_write(path: str, *, user: str, mode: int, make_parents: bool) -> bytes:
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"mode out of range: {mode:#o}")
    flags = WRITE_FLAG_MAKE_PARENTS if make_parents else 0
    return frame(OP_WRITE, pack_str(user) + _U32.pack(mode) + _U32.pack(flags) + pack_str(path))


def encode_fs(
    op: int,
    path: str,
    *,
    user: str,
    flags: int = 0,
    mode: int = 0,
    limit: int = 0,
    path2: str = "",
) -> bytes:
    """The ``O`` frame of a file-system operation."""
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"mode out of range: {mode:#o}")
    if not 0 <= limit <= U64_MAX:
        raise ValueError(f"limit out of range: {limit}")
    payload = b"".join(
        (
            pack_str(user),
            _U32.pack(op),
            _U32.pack(flags),
            _U32.pack(mode),
            _U64.pack(limit),
            pack_str(path),
            pack_str(path2),
        )
    )
    return frame(OP_FS, payload)


def encode_resize(rows: int, cols: int) -> bytes:
    if not (1 <= rows <= 0xFFFF and 1 <= cols <= 0xFFFF):
        raise ValueError(f"terminal size out of range: {rows}x{cols}")
    return frame(T_RESIZE, _U32.pack(rows) + _U32.pack(cols))


@dataclass(frozen=True)
class Entry:
    """One file-system entry as the agent reports it (``name`` is relative in listings)."""

    name: str
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    target: str


_ENTRY_HEAD = struct.Struct("<IIIQq")


def decode_entries(payload: bytes) -> list[Entry]:
    """Entry records packed one after another (a ``D`` frame of a listing, or a stat)."""
    out: list[Entry] = []
    view = memoryview(payload)
    pos = 0
    try:
        while pos < len(view):
            mode, uid, gid, size, mtime = _ENTRY_HEAD.unpack_from(view, pos)
            pos += _ENTRY_HEAD.size
            names = []
            for _ in range(2):
                (n,) = _U32.unpack_from(view, pos)
                pos += 4
                if pos + n > len(view):
                    raise ProtocolError("entry record is cut short")
                names.append(bytes(view[pos : pos + n]).decode("utf-8", "surrogateescape"))
                pos += n
            out.append(Entry(names[0], mode, uid, gid, size, mtime, names[1]))
    except struct.error as exc:
        raise ProtocolError(f"malformed entry record: {exc}") from None
    return out


def encode_signal(signo: int) -> bytes:
    if not 1 <= signo <= 64:
        raise ValueError(f"invalid signal number: {signo}")
    return frame(T_SIGNAL, _U32.pack(signo))


def encode_data_frames(kind: int, data: bytes | memoryview) -> Iterable[bytes]:
    """Split data into ``kind`` frames of at most :data:`CHUNK_SIZE` bytes."""
    view = memoryview(data)
    for start in range(0, len(view), CHUNK_SIZE):
        yield frame(kind, bytes(view[start : start + CHUNK_SIZE]))


@dataclass(frozen=True)
class ExitStatus:
    """Payload of ``Z``: how a command ended."""

    exit_code: int
    timed_out: bool
    truncated: bool
    duration_ns: int


def decode_exit(payload: bytes) -> ExitStatus:
    if len(payload) != _EXIT.size:
        raise ProtocolError(f"exit frame has {len(payload)} bytes, expected {_EXIT.size}")
    code, flags, duration = _EXIT.unpack(payload)
    return ExitStatus(
        exit_code=code,
        timed_out=bool(flags & EXIT_FLAG_TIMED_OUT),
        truncated=bool(flags & EXIT_FLAG_TRUNCATED),
        duration_ns=duration,
    )


def decode_failure(payload: bytes) -> tuple[int, str]:
    """Payload of ``F``: ``(errno, message)``."""
    if len(payload) < 4:
        raise ProtocolError("failure frame shorter than 4 bytes")
    (err,) = _I32.unpack_from(payload)
    return int(err), payload[4:].decode("utf-8", "replace")


def decode_u32(payload: bytes) -> int:
    if len(payload) != 4:
        raise ProtocolError(f"expected a u32 payload, got {len(payload)} bytes")
    return int(_U32.unpack(payload)[0])


def decode_u64(payload: bytes) -> int:
    if len(payload) != 8:
        raise ProtocolError(f"expected a u64 payload, got {len(payload)} bytes")
    return int(_U64.unpack(payload)[0])


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole frames back."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buf += data
        out: list[tuple[int, bytes]] = []
        while len(self._buf) >= HEADER_SIZE:
            kind, length = parse_header(bytes(self._buf[:HEADER_SIZE]))
            end = HEADER_SIZE + length
            if len(self._buf) < end:
                break
            out.append((kind, bytes(self._buf[HEADER_SIZE:end])))
            del self._buf[:end]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame still buffered."""
        return len(self._buf)
