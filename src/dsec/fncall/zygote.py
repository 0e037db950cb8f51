"""The host side of ``dsec-zygote`` (zygote.c): build it, start it, talk to its sandboxes.

One zygote process per warm pool builds sandboxes ahead of demand and hands each one's
control socket to us; we drive the sandbox's pid 1 ("runner") directly over that
socket with a small binary protocol (see the header of zygote.c).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec import native
from dsec.errors import BackendError
from dsec.resources import oom
from dsec.resources.cgroups import CgroupHost, Layout
from dsec.security import seccomp

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("zygote.c")
CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-Wl,--no-as-needed", "-lseccomp"]

F_WALL, F_CPU, F_OUTPUT, F_EXECFAIL = 1, 2, 4, 8
_RESULT = struct.Struct("<iiIIQQII")
_HDR = struct.Struct("<II")


def zygote_binary() -> Path:
    """The compiled zygote for the current source (compiled once per host and version)."""
    return native.binary(
        SOURCE, name="dsec-zygote", subdir="fncall", cflags=CFLAGS, what="the FnCall zygote"
    )


def seccomp_rules() -> str:
    """The platform's seccomp allow-list (dsec.security.seccomp.profile) as the zygote's
    rule lines. Calls the container backend sends to its listener fail with EPERM here:
    an FnCall sandbox lives milliseconds and has no listener."""
    prof = seccomp.profile()
    lines = [f"default {prof['defaultErrnoRet']}"]
    for rule in prof["syscalls"]:
        err = -1 if rule["action"] == "SCMP_ACT_ALLOW" else int(rule.get("errnoRet", seccomp.EPERM))
        args = " ".join(
            f"{a['index']} {a['op']} {a['value']} {a.get('valueTwo', 0)}"
            for a in rule.get("args", [])
        )
        lines.extend(f"{err} {name} {args}".rstrip() for name in rule["names"])
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CgroupPlan:
    """Where a pool's sandboxes' cgroups live and what is written into each."""

    dirs: list[Path]
    sets: list[tuple[int, str, str]]
    ends: list[tuple[int, str, str]]
    resets: list[tuple[int, str, str]]
    reuse: int  # emptied cgroups kept for the next sandbox (v1: peak resettable)
    memory_dir: Path | None  # pool dir of the memory controller (stats)
    v2: bool
    # A reused cgroup's leftover charge is reclaimed past this many bytes (zygote.c):
    # (controller index, usage file, file to write to reclaim, threshold).
    reclaim: tuple[int, str, str, int] | None = None


# The CPU bandwidth period of a FnCall sandbox. A sandbox that used up its quota is
# throttled until the period ends, its in-sandbox runner included, and the runner is
# what enforces the wall limit: with the default 100 ms, a call spinning on every core
# was killed up to ~100 ms past its limit (CI saw 553 ms for 500). 10 ms bounds that
# delay at ~10 ms for a negligible cost in bandwidth-timer wake-ups.
CPU_PERIOD_US = 10_000


def cpu_quota_us(cores: float) -> int:
    return max(1000, int(cores * CPU_PERIOD_US))


def reclaim_bytes(memory: int) -> int:
    """Leftover charge a reused cgroup may keep (shared page cache, reclaimable anyway):
    an eighth of the limit, at most 32 MiB."""
    return min(memory // 8, 32 << 20)


def cgroup_plan(host: CgroupHost, rel: str, memory: int, cores: float, pids: int) -> CgroupPlan:
    """The pool's cgroup directories (created here) and per-sandbox settings."""
    rel = rel.strip("/")
    if host.layout is Layout.V2 and host.v2 is not None:
        base = host.v2
        parts = rel.split("/")
        for i in range(len(parts)):
            d = base.joinpath(*parts[: i + 1])
            d.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (d / "cgroup.subtree_control").write_text("+memory +cpu +pids")
        v2sets = [
            (0, "memory.max", str(memory)),
            (0, "memory.swap.max", "0"),
            (0, "cpu.max", f"{cpu_quota_us(cores)} {CPU_PERIOD_US}"),
            (0, "pids.max", str(pids)),
        ]
        return CgroupPlan([base / rel], v2sets, [], [], 0, base / rel, True)
    dirs: list[Path] = []
    reclaim: tuple[int, str, str, int] | None = None
    sets: list[tuple[int, str, str]] = []
    ends: list[tuple[int, str, str]] = []
    resets: list[tuple[int, str, str]] = []
    mem_dir: Path | None = None
    for ctrl in ("memory", "cpu", "pids"):
        mount = host.v1.get(ctrl)
        if mount is None:
            continue
        d = mount / rel
        d.mkdir(parents=True, exist_ok=True)
        i = len(dirs)
        dirs.append(d)
        if ctrl == "memory":
            mem_dir = d
            sets.append((i, "memory.limit_in_bytes", str(memory)))
            if (d / "memory.memsw.limit_in_bytes").exists():
                sets.append((i, "memory.memsw.limit_in_bytes", str(memory)))
            sets.append((i, "memory.swappiness", "0"))
            ends.append((i, "memory.force_empty", "0"))
            resets.append((i, "memory.max_usage_in_bytes", "0"))
            reclaim = (i, "memory.usage_in_bytes", "memory.force_empty", reclaim_bytes(memory))
        elif ctrl == "cpu":
            sets.append((i, "cpu.cfs_period_us", str(CPU_PERIOD_US)))
            sets.append((i, "cpu.cfs_quota_us", str(cpu_quota_us(cores))))
        else:
            sets.append((i, "pids.max", str(pids)))
    return CgroupPlan(dirs, sets, ends, resets, 256, mem_dir, False, reclaim)


def write_config(
    path: Path,
    *,
    lowers: list[Path],
    stage: Path,
    tmpfs_bytes: int,
    plan: CgroupPlan,
    rules: Path,
    rootmnt: Path,
    shared: Path,
    shared_root: bool = True,
    uid: int = 65534,
    newnet: bool = True,
    prestart: tuple[str, list[str], dict[str, str], int] | None = None,
    idle: bool = False,
) -> None:
    """``prestart``: (source file, argv, environment, CPU limit in ms) of the step each
    sandbox starts ahead of its call (zygote.c, prestart()); one value per line, so a
    value with a newline turns it off. ``idle``: build sandboxes at SCHED_IDLE (the
    caller then switches a runner to normal when a call takes it: ``Runner.activate``)."""
    lines = [f"lower {p}" for p in lowers]
    lines += [f"stage {stage}", f"tmpfs_bytes {tmpfs_bytes}", f"uid {uid}", f"newnet {int(newnet)}"]
    lines.append(f"idle {int(idle)}")
    # each sandbox's OOM bias, set by the zygote before the sandbox runs (its own stays)
    lines.append(f"oom_score_adj {oom.FNCALL_OOM_SCORE_ADJ}")
    lines += [f"cg {d}" for d in plan.dirs]
    lines += [f"cgset {i} {f} {v}" for i, f, v in plan.sets]
    lines += [f"cgend {i} {f} {v}" for i, f, v in plan.ends]
    lines += [f"cgreset {i} {f} {v}" for i, f, v in plan.resets]
    lines.append(f"reuse {plan.reuse}")
    if plan.reclaim is not None:
        lines.append("cgreclaim " + " ".join(str(v) for v in plan.reclaim))
    lines += [f"rootmnt {rootmnt}", f"shared {shared}", f"rootmode {int(shared_root)}"]
    lines.append(f"seccomp {rules}")
    if prestart is not None:
        src, argv, env, cpu_ms = prestart
        values = [src, *argv, *(f"{k}={v}" for k, v in env.items())]
        if not any("\n" in v for v in values):
            lines.append(f"prestart_cpu_ms {cpu_ms}")
            lines.append(f"prestart_src {src}")
            lines += [f"prestart_arg {a}" for a in argv]
            lines += [f"prestart_env {k}={v}" for k, v in env.items()]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class ExecOutcome:
    exit_code: int | None
    signal: int | None
    flags: int
    errno: int
    wall_s: float
    cpu_s: float
    stdout: bytes
    stderr: bytes


class Runner:
    """A ready sandbox: its pid 1 on the other end of ``sock``. Closing the socket
    destroys the sandbox (pid 1 exits; the kernel kills its pid namespace).

    Requests that need no answer ('F') wait in ``_out`` and leave with the next one
    that does, in one write: the runner wakes once per step, not once per part."""

    def __init__(
        self, sid: int, name: str, sock: socket.socket, pid: int = 0, base_memory: int = 0
    ) -> None:
        self.id = sid
        self.name = name
        self.sock = sock
        self.pid = pid  # pid 1 of the sandbox as the platform sees it (0: not known)
        self.idle = False  # built at SCHED_IDLE (zygote.c): activate() on take
        self.oom_kills = 0  # its memory cgroup's OOM kills when it became ready
        self.base_memory = base_memory  # what its reused memory cgroup had charged
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._out: list[bytes] = []

    async def wait_ready(self) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(sock=self.sock)
        hdr = await self.reader.readexactly(_HDR.size)
        if _HDR.unpack(hdr)[0] != ord("R"):
            raise BackendError("sandbox runner sent a bad hello")

    def _send(self, tag: str, *parts: bytes) -> None:
        self._out.append(_HDR.pack(ord(tag), sum(len(p) for p in parts)))
        self._out.extend(parts)

    def _flush(self) -> None:
        assert self.writer is not None
        out, self._out = self._out, []
        self.writer.write(b"".join(out))

    def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._send("F", struct.pack("<I", mode), os.fsencode(path), b"\0", data)

    async def _reply(self, tag: str) -> bytes:
        assert self.reader is not None and self.writer is not None
        self._flush()
        await self.writer.drain()
        kind, length = _HDR.unpack(await self.reader.readexactly(_HDR.size))
        if kind != ord(tag):
            raise BackendError(f"sandbox runner sent {kind!r}, expected {tag!r}")
        return await self.reader.readexactly(length)

    async def exec(
        self,
        argv: list[str],
        env: dict[str, str],
        stdin: bytes,
        *,
        cpu_s: float,
        wall_s: float,
        output_limit: int,
    ) -> ExecOutcome:
        strings = b"".join(os.fsencode(s) + b"\0" for s in argv)
        strings += b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())
        head = struct.pack(
            "<6I",
            max(1, int(cpu_s * 1000)),
            max(1, int(wall_s * 1000)),
            output_limit,
            len(argv),
            len(env),
            len(stdin),
        )
        self._send("X", head, strings, stdin)
        body = await self._reply("r")
        ex, sig, flags, err, wall_us, cpu_us, out_len, err_len = _RESULT.unpack_from(body)
        out = body[_RESULT.size : _RESULT.size + out_len]
        errb = body[_RESULT.size + out_len : _RESULT.size + out_len + err_len]
        return ExecOutcome(
            None if ex < 0 else ex, sig or None, flags, err, wall_us / 1e6, cpu_us / 1e6, out, errb
        )

    async def get(self, path: str, max_bytes: int) -> bytes | None:
        self._send("G", os.fsencode(path), struct.pack("<I", max_bytes))
        body = await self._reply("g")
        return body[4:] if body[:4] == b"\x01\0\0\0" else None

    def activate(self) -> None:
        """A call takes this sandbox: its pid 1 leaves the zygote's SCHED_IDLE."""
        if self.idle:
            _set_policy(self.pid, os.SCHED_OTHER)

    def close(self) -> None:
        """Destroy the sandbox; its teardown is background work (SCHED_IDLE) again."""
        if self.idle:
            _set_policy(self.pid, os.SCHED_IDLE)
        if self.writer is not None:
            self.writer.close()
        else:
            self.sock.close()


_SCHED_PARAM = os.sched_param(0)


def _set_policy(pid: int, policy: int) -> None:
    if pid > 0:
        with contextlib.suppress(OSError):  # gone already: nothing left to schedule
            os.sched_setscheduler(pid, policy, _SCHED_PARAM)


class Zygote:
    """One ``dsec-zygote`` process and its SOCK_SEQPACKET control socket."""

    def __init__(
        self,
        config: Path,
        log_path: Path,
        *,
        on_spawned: Callable[[int, str, socket.socket, int, int], None],
        on_gone: Callable[[int], None],
        on_error: Callable[[str], None],
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.on_spawned = on_spawned
        self.on_gone = on_gone
        self.on_error = on_error
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self._hello: asyncio.Future[None] | None = None
        self.alive = False

    async def start(self) -> None:
        binary = await asyncio.to_thread(zygote_binary)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # On the loop's own thread, not a worker thread: the zygote's parent-death
        # signal follows the thread that started it.
        self.proc = self._popen(binary, theirs)
        theirs.close()
        ours.setblocking(False)
        self.sock = ours
        loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        loop.add_reader(ours.fileno(), self._readable)
        self.alive = True
        try:
            await asyncio.wait_for(asyncio.shield(self._hello), 10)
        except (TimeoutError, BackendError):
            await self.close()
            raise BackendError(f"the FnCall zygote did not start: {self.log_tail()}") from None

    def _popen(self, binary: Path, theirs: socket.socket) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as logf:
            return subprocess.Popen(
                [str(binary), str(self.config), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                pass_fds=(theirs.fileno(),),
            )

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:].strip()
        except OSError:
            return ""

    def _readable(self) -> None:
        assert self.sock is not None
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self.sock, 512, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            if not msg:
                self._dead()
                return
            text = msg.decode(errors="replace")
            kind, _, rest = text.partition(" ")
            if kind == "R" and fds:
                sid, name, pid, base = [*rest.split(" "), "0", "0"][:4]
                sock = socket.socket(fileno=fds[0])
                self.on_spawned(int(sid), name, sock, int(pid), int(base))
            elif kind == "D":
                self.on_gone(int(rest))
            elif kind == "H":
                if self._hello is not None and not self._hello.done():
                    self._hello.set_result(None)
            else:
                for fd in fds:
                    os.close(fd)
                self.on_error(rest or text)

    def _dead(self) -> None:
        if not self.alive:
            return
        self.alive = False
        if self.sock is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(BackendError("zygote exited"))
        self.on_error(f"zygote exited: {self.log_tail()}")

    def command(self, text: str) -> None:
        if self.sock is None or not self.alive:
            return
        try:
            self.sock.send(text.encode())
        except BlockingIOError:
            asyncio.get_running_loop().call_later(0.001, self.command, text)
        except OSError as exc:
            log.warning("zygote command %r failed: %s", text, exc)

    def spawn(self, n: int) -> None:
        if n > 0:
            self.command(f"S {n}")

    def kill(self, sid: int) -> None:
        self.command(f"K {sid}")

    def urgent(self, on: bool) -> None:
        """Build at normal priority while someone waits for a sandbox (zygote.c "P")."""
        self.command(f"P {int(on)}")

    async def close(self) -> None:
        """Kill every sandbox, remove their cgroups, wait for the zygote to exit."""
        self.command("Q")
        if self.sock is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.alive = False
        if self.proc is not None:
            proc = self.proc
            try:
                await asyncio.to_thread(proc.wait, 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self.sock is not None:
            self.sock.close()
