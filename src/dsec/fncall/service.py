"""The FnCall backend: stateless run_code / judge / call served from warm pools.

Why not one container per call: a crun create costs 9-15 ms and tops out near
110-120/s on this host. A call here takes a sandbox a zygote built in advance (fresh
namespaces, cgroups, overlay on a private tmpfs; see zygote.c), runs one or two
steps in it, and destroys it; the zygote replaces it off the caller's path.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dsec.api.events import AuditKind, EventKind
from dsec.api.fncall import (
    MAX_CODE_BYTES,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_STDIN_BYTES,
    CallRequest,
    CallResult,
    DSecFnCallRunArgs,
    JudgeRequest,
    JudgeResult,
    JudgeTest,
    LanguageInfo,
    PoolInfo,
    RunCodeRequest,
    RunCodeResult,
    RunStatus,
    StepResult,
    TestVerdict,
    Verdict,
    WarmPoolRequest,
)
from dsec.errors import InvalidArgument, LimitExceeded, PlatformUnavailable, Unsupported
from dsec.fncall import callstub
from dsec.fncall.languages import LANGUAGES, Language, language
from dsec.fncall.pool import Budget, WarmPool
from dsec.fncall.zygote import (
    F_CPU,
    F_EXECFAIL,
    F_OUTPUT,
    F_WALL,
    ExecOutcome,
    Runner,
    Zygote,
    cgroup_plan,
    seccomp_rules,
    write_config,
)
from dsec.images.images import Images
from dsec.resources.cgroups import CgroupHost
from dsec.security.audit import AuditSink
from dsec.supervise import keep_running

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ARTIFACT_MAX = 64 << 20
VERDICTS: dict[str, Verdict] = {
    "timeout": "TLE",
    "memory_limit": "MLE",
    "runtime_error": "RE",
    "compile_error": "CE",
    "output_limit": "OLE",
}


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


@dataclass
class FnCallConfig:
    """Bounds of the warm pools (env: DSEC_FNCALL_*)."""

    max_sandboxes: int = _env_int("DSEC_FNCALL_MAX_SANDBOXES", 256)
    max_ready: int = _env_int("DSEC_FNCALL_MAX_READY", 64)
    min_ready: int = _env_int("DSEC_FNCALL_MIN_READY", 2)
    shrink_s: float = float(os.environ.get("DSEC_FNCALL_SHRINK_S", "2"))
    idle_s: float = float(os.environ.get("DSEC_FNCALL_IDLE_S", "120"))
    acquire_timeout_s: float = 30.0
    # "shared": the image read-only and shared by the pool's sandboxes, fresh tmpfs /tmp
    # (the user is unprivileged, so that is all it could write anyway); "overlay": a
    # writable overlay per sandbox (slower: its caches start cold every call).
    shared_root: bool = os.environ.get("DSEC_FNCALL_ROOT", "shared") != "overlay"
    # "pool" (default): one empty network namespace per pool, loopback down, shared by
    # its sandboxes, with Landlock scoping between calls (see zygote.c); "call": one per
    # call (also what ``loopback=True`` asks for). Neither has any route out.
    netns_per_call: bool = os.environ.get("DSEC_FNCALL_NETNS", "pool") == "call"
    # Build sandboxes at SCHED_IDLE unless a call waits for one (zygote.c, pool.py):
    # a sandbox built beside a call no longer slows it down. "0" builds at normal.
    idle_build: bool = os.environ.get("DSEC_FNCALL_IDLE_BUILD", "1") != "0"


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _check_path(path: str) -> str:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\0" in path or len(path) > 255:
        raise InvalidArgument(
            f"file path {path[:80]!r} must be relative (to /tmp/work), without '..'"
        )
    return str(p)


def check_code(code: str, stdin: str = "", files: dict[str, str] | None = None) -> None:
    """Bad input is the caller's to fix: typed 422s, before any sandbox is taken."""
    if not code.strip():
        raise InvalidArgument("code is empty")
    if len(code.encode()) > MAX_CODE_BYTES:
        raise LimitExceeded(
            f"code is {len(code.encode())} bytes; the limit is {MAX_CODE_BYTES}",
            limit=MAX_CODE_BYTES,
        )
    if len(stdin.encode()) > MAX_STDIN_BYTES:
        raise LimitExceeded(f"stdin is larger than {MAX_STDIN_BYTES} bytes", limit=MAX_STDIN_BYTES)
    files = files or {}
    if len(files) > MAX_FILES:
        raise LimitExceeded(f"at most {MAX_FILES} files per call", limit=MAX_FILES)
    for path, text in files.items():
        _check_path(path)
        if len(text.encode()) > MAX_FILE_BYTES:
            raise LimitExceeded(f"file {path!r} is larger than {MAX_FILE_BYTES} bytes")


def compare(out: str, expected: str, comparator: str, tol: float) -> bool:
    if comparator == "exact":
        return out == expected
    a, b = out.split(), expected.split()
    if comparator == "whitespace" or len(a) != len(b):
        return a == b
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=tol, abs_tol=tol):
            return False
    return True


@dataclass
class _Run:
    status: RunStatus
    outcome: ExecOutcome | None
    compile: StepResult | None
    peak: int
    warm: bool
    collected: bytes | None = None
    artifact: bytes | None = None


def _step(o: ExecOutcome) -> StepResult:
    return StepResult(
        exit_code=o.exit_code,
        signal=o.signal,
        stdout=_decode(o.stdout),
        stderr=_decode(o.stderr),
        wall_time_s=o.wall_s,
        cpu_time_s=o.cpu_s,
    )


class FnCallService:
    def __init__(
        self,
        *,
        images: Images,
        cgroups: CgroupHost,
        run_dir: Path,
        edge_id: str,
        audit: AuditSink,
        config: FnCallConfig | None = None,
    ) -> None:
        self.images = images
        self.cgroups = cgroups
        self.run_dir = run_dir
        self.edge_id = edge_id
        self.audit = audit
        self.config = config or FnCallConfig()
        self.cgroup_root = f"dsec/{edge_id}.fncall"
        self.budget = Budget(self.config.max_sandboxes)
        self.pools: dict[str, WarmPool] = {}
        self._pool_layers: dict[str, list[str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._idle_task: asyncio.Task[None] | None = None
        self._rules: Path | None = None
        # Told how long each call waited for a warm sandbox (the platform's metrics).
        self.on_wait: Callable[[float], None] = lambda seconds: None

    async def start(self) -> None:
        """Remove what a crashed predecessor left (its zygotes died with it)."""
        await asyncio.to_thread(self.cgroups.kill_and_remove, f"/{self.cgroup_root}", timeout=2)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "stage").mkdir(exist_ok=True)
        (self.run_dir / "rootmnt").mkdir(exist_ok=True)
        self._rules = self.run_dir / "seccomp.rules"
        self._rules.write_text(seccomp_rules())
        self._idle_task = asyncio.create_task(keep_running("fncall-idle-pools", self._idle_loop))

    async def close(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
        for key in list(self.pools):
            await self._close_pool(key)
        await asyncio.to_thread(self.cgroups.kill_and_remove, f"/{self.cgroup_root}", timeout=2)
        self.cgroups.remove_if_empty("/dsec")

    # -- pools -----------------------------------------------------------------------

    async def pool_for(self, args: DSecFnCallRunArgs) -> WarmPool:
        if args.network_rules:
            raise Unsupported(
                "FnCall sandboxes have no network (network_rules must be empty); "
                "use a container sandbox for calls that need egress"
            )
        image = await self.images.resolve(args.image)
        lang = language(args.language)
        key = "-".join(
            [
                image.digest.split(":")[-1][:12],
                f"m{args.memory_limit_mb}",
                f"c{int(args.cpu_cores_limit * 1000)}",
                f"p{args.pids_limit}",
                "n1" if self._netns_per_call(args) else "n0",
                # A language whose interpreter the sandboxes pre-start has pools of its
                # own, per what that start fixes: the run's RLIMIT_CPU and environment.
                *(self._prestart_key(lang, args) if lang.prestart else []),
            ]
        )
        pool = self.pools.get(key)
        if pool is not None and not pool.closed and pool.zygote.alive:
            return pool
        async with self._locks.setdefault(key, asyncio.Lock()):
            pool = self.pools.get(key)
            if pool is not None and not pool.closed and pool.zygote.alive:
                return pool
            if pool is not None:  # its zygote died: replace the pool
                log.warning(
                    "FnCall pool %s lost its zygote (%s); restarting it", key, pool.last_error
                )
                await self._close_pool(key)
            return await self._new_pool(key, image.layers, args, lang)

    @staticmethod
    def _run_cpu_ms(args: DSecFnCallRunArgs) -> int:
        """The run step's CPU limit as Runner.exec sends it."""
        return max(1, int((args.cpu_time_s or args.timeout_s) * 1000))

    def _prestart_key(self, lang: Language, args: DSecFnCallRunArgs) -> list[str]:
        parts = [f"l{lang.name}", f"t{(self._run_cpu_ms(args) + 999) // 1000}"]
        if args.env:
            env = json.dumps(sorted(args.env.items())).encode()
            parts.append("e" + hashlib.sha256(env).hexdigest()[:10])
        return parts

    def _netns_per_call(self, args: DSecFnCallRunArgs) -> bool:
        return self.config.netns_per_call or args.loopback

    async def _new_pool(
        self, key: str, layers: list[str], args: DSecFnCallRunArgs, lang: Language
    ) -> WarmPool:
        mounts = self.images.mounts
        await mounts.prepare(layers, "eager")
        holder = _pool_holder(key)
        acquired: list[str] = []
        try:
            lowers = []
            for digest in reversed(layers):  # overlay wants the top layer first
                lowers.append(await mounts.acquire_async(digest, holder=holder))  # cancel-safe
                acquired.append(digest)
            memory = args.memory_limit_mb << 20
            plan = await asyncio.to_thread(
                cgroup_plan,
                self.cgroups,
                f"{self.cgroup_root}/{key}",
                memory,
                args.cpu_cores_limit,
                args.pids_limit,
            )
            conf = self.run_dir / f"{key}.conf"
            shared = self.run_dir / f"{key}.root"
            shared.mkdir(exist_ok=True)
            assert self._rules is not None
            write_config(
                conf,
                lowers=lowers,
                stage=self.run_dir / "stage",
                tmpfs_bytes=memory,
                plan=plan,
                rules=self._rules,
                rootmnt=self.run_dir / "rootmnt",
                shared=shared,
                shared_root=self.config.shared_root,
                newnet=self._netns_per_call(args),
                # the plain run step (a call with extra argv starts its own)
                prestart=(lang.source, lang.argv(lang.run), self._env(args), self._run_cpu_ms(args))
                if lang.prestart
                else None,
                idle=self.config.idle_build,
            )

            def zygote(pool: WarmPool) -> Zygote:
                return Zygote(
                    conf,
                    self.run_dir / f"{key}.log",
                    on_spawned=pool.on_spawned,
                    on_gone=pool.on_gone,
                    on_error=pool.on_error,
                )

            pool = WarmPool(
                key,
                zygote,
                plan,
                self.budget,
                min_ready=self.config.min_ready,
                max_ready=self.config.max_ready,
                shrink_s=self.config.shrink_s,
                args=args,
                idle=self.config.idle_build,
            )
            await pool.start()
        except BaseException:
            for digest in acquired:
                mounts.release(digest, holder=holder)
            raise
        self.pools[key] = pool
        self._pool_layers[key] = acquired
        return pool

    async def _close_pool(self, key: str) -> None:
        pool = self.pools.pop(key, None)
        if pool is None:
            return
        await pool.close()
        for digest in self._pool_layers.pop(key, []):
            self.images.mounts.release(digest, holder=_pool_holder(key))

    async def _idle_loop(self) -> None:
        while True:
            await asyncio.sleep(min(10.0, self.config.idle_s / 2))
            now = time.monotonic()
            for key, pool in list(self.pools.items()):
                if pool.in_use == 0 and now - pool.last_used > self.config.idle_s:
                    log.info("closing idle FnCall pool %s", key)
                    await self._close_pool(key)

    def pools_info(self) -> list[PoolInfo]:
        return [self._pool_info(key, p) for key, p in self.pools.items()]

    @staticmethod
    def _pool_info(key: str, p: WarmPool) -> PoolInfo:
        args = p.args
        return PoolInfo(
            key=key,
            image=args.image,
            memory_limit_mb=args.memory_limit_mb,
            cpu_cores_limit=args.cpu_cores_limit,
            ready=len(p.ready),
            starting=p.starting,
            in_use=p.in_use,
            target=p.target,
            created=p.created,
            destroyed=p.destroyed,
            misses=p.misses,
            warm_s=p.warm_s,
        )

    async def warm(self, req: WarmPoolRequest) -> PoolInfo:
        pool = await self.pool_for(req.args)
        if req.wait:
            await pool.warm(req.size, req.timeout_s)
        else:
            pool.grow(req.size)
        # The pool is reported from itself: it may have left ``self.pools`` meanwhile
        # (its zygote died and a concurrent call replaced it), which made a lookup by
        # key raise StopIteration (an untyped 500).
        if pool.closed or not pool.zygote.alive:
            raise PlatformUnavailable(
                f"FnCall pool {pool.key} went down while warming ({pool.last_error}); "
                "retry: the next call starts a new one"
            )
        return self._pool_info(pool.key, pool)

    @staticmethod
    def languages() -> list[LanguageInfo]:
        return [
            LanguageInfo(
                name=lang.name,
                aliases=list(lang.aliases),
                compiled=lang.compile is not None,
                needs=lang.needs,
            )
            for lang in LANGUAGES
        ]

    # -- one call --------------------------------------------------------------------

    def _env(self, args: DSecFnCallRunArgs) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        env.update(args.env)
        return env

    @staticmethod
    def _stats(pool: WarmPool, runner: Runner) -> tuple[int, int]:
        """(peak memory, OOM kills) of the sandbox's memory cgroup."""
        return pool.peak_memory(runner), pool.oom_kills(runner)

    def _reset_peak(self, pool: WarmPool, runner: Runner) -> None:
        d = pool.sandbox_cgroup(runner)
        if d is not None and not pool.plan.v2:
            with contextlib.suppress(OSError):
                (d / "memory.max_usage_in_bytes").write_text("0")

    async def _exec(
        self,
        pool: WarmPool,
        runner: Runner,
        argv: list[str],
        env: dict[str, str],
        stdin: bytes,
        *,
        cpu_s: float,
        wall_s: float,
        output_limit: int,
    ) -> ExecOutcome | None:
        """One step; None if the runner itself stopped answering (then it is killed)."""
        try:
            async with asyncio.timeout(wall_s + 5.0):  # no extra task, unlike wait_for
                return await runner.exec(
                    argv, env, stdin, cpu_s=cpu_s, wall_s=wall_s, output_limit=output_limit
                )
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pool.zygote.kill(runner.id)
            return None

    async def _run(
        self,
        pool: WarmPool,
        lang: Language,
        args: DSecFnCallRunArgs,
        code: str,
        *,
        stdin: str = "",
        files: dict[str, str] | None = None,
        argv: list[str] | None = None,
        artifact: bytes | None = None,
        compile_only: bool = False,
        collect: str | None = None,
    ) -> _Run:
        asked = time.perf_counter()
        runner, warm = await pool.acquire(self.config.acquire_timeout_s)
        self.on_wait(time.perf_counter() - asked)
        try:
            env = self._env(args)
            runner.put_file(lang.source, code.encode())
            for path, text in (files or {}).items():
                runner.put_file(_check_path(path), text.encode())
            compiled: StepResult | None = None
            if lang.compile and artifact is None:
                o = await self._exec(
                    pool,
                    runner,
                    lang.argv(lang.compile),
                    env,
                    b"",
                    cpu_s=args.compile_timeout_s,
                    wall_s=args.compile_timeout_s,
                    output_limit=args.output_limit_bytes,
                )
                if o is None:
                    return _Run("timeout", None, None, pool.peak_memory(runner), warm)
                self._check_exec(o, lang, args, lang.compile[0])
                compiled = _step(o)
                if o.exit_code != 0:
                    return _Run("compile_error", None, compiled, 0, warm)
                if compile_only:
                    assert lang.artifact is not None
                    data = await runner.get(lang.artifact, ARTIFACT_MAX)
                    return _Run("ok", None, compiled, 0, warm, artifact=data)
            elif artifact is not None and lang.artifact:
                runner.put_file(lang.artifact, artifact, 0o755)
            # OOM kills before the run: counted when the sandbox became ready, unless a
            # compile ran in it since (the zygote resets a fresh sandbox's peak).
            oom0 = runner.oom_kills
            if compiled is not None:
                self._reset_peak(pool, runner)
                oom0 = pool.oom_kills(runner)
            o = await self._exec(
                pool,
                runner,
                lang.argv(lang.run) + list(argv or []),
                env,
                stdin.encode(),
                cpu_s=args.cpu_time_s or args.timeout_s,
                wall_s=args.timeout_s,
                output_limit=args.output_limit_bytes,
            )
            peak, oom = self._stats(pool, runner)
            if o is None:
                return _Run("memory_limit" if oom > oom0 else "timeout", None, compiled, peak, warm)
            self._check_exec(o, lang, args, lang.run[0])
            status: RunStatus
            if o.flags & F_OUTPUT:
                status = "output_limit"
            elif oom > oom0:
                status = "memory_limit"
            elif o.flags & (F_WALL | F_CPU) or o.signal == signal.SIGXCPU:
                status = "timeout"
            elif o.exit_code == 0:
                status = "ok"
            else:
                status = "runtime_error"
            collected = await runner.get(collect, 64 << 20) if collect else None
            return _Run(status, o, compiled, peak, warm, collected=collected)
        finally:
            pool.release(runner)

    @staticmethod
    def _check_exec(o: ExecOutcome, lang: Language, args: DSecFnCallRunArgs, prog: str) -> None:
        if o.flags & F_EXECFAIL:
            raise InvalidArgument(
                f"language {lang.name!r} needs {prog!r}, which image {args.image!r} does not "
                f"have ({os.strerror(o.errno)})",
                language=lang.name,
                image=args.image,
            )

    def _result(self, call_id: str, r: _Run, t0: float) -> RunCodeResult:
        o = r.outcome
        return RunCodeResult(
            call_id=call_id,
            status=r.status,
            compile=r.compile,
            warm=r.warm,
            peak_memory_bytes=r.peak,
            latency_s=time.perf_counter() - t0,
            exit_code=o.exit_code if o else None,
            signal=o.signal if o else None,
            stdout=_decode(o.stdout) if o else "",
            stderr=_decode(o.stderr) if o else "",
            wall_time_s=o.wall_s if o else 0.0,
            cpu_time_s=o.cpu_s if o else 0.0,
        )

    def _audit(self, call_id: str, action: str, args: DSecFnCallRunArgs, **detail: object) -> None:
        self.audit.record(
            call_id,
            AuditKind.COMMAND,
            action,
            image=args.image,
            language=args.language,
            job_id=args.job_id,
            trajectory_id=args.trajectory_id,
            **detail,
        )

    def _limit_event(self, call_id: str, status: str, args: DSecFnCallRunArgs) -> None:
        if status in ("memory_limit", "output_limit"):
            self.audit.event(
                call_id,
                EventKind.RESOURCE_LIMIT,
                limit=status,
                memory_limit_mb=args.memory_limit_mb,
                job_id=args.job_id,
            )

    async def run_code(self, req: RunCodeRequest) -> RunCodeResult:
        t0 = time.perf_counter()
        lang = language(req.args.language)
        check_code(req.code, req.stdin, req.files)
        pool = await self.pool_for(req.args)
        call_id = "fc-" + secrets.token_hex(8)
        r = await self._run(
            pool, lang, req.args, req.code, stdin=req.stdin, files=req.files, argv=req.argv
        )
        res = self._result(call_id, r, t0)
        self._limit_event(call_id, res.status, req.args)
        self._audit(
            call_id,
            "run_code",
            req.args,
            status=res.status,
            wall_time_s=round(res.wall_time_s, 4),
            code_bytes=len(req.code),
        )
        return res

    async def call(self, req: CallRequest) -> CallResult:
        """A pickled function (cloudpickle) run by a stub in the image's python3."""
        t0 = time.perf_counter()
        args = req.args.model_copy(update={"language": "python"})
        try:
            payload = base64.b64decode(req.payload_b64, validate=True)
        except ValueError:
            raise InvalidArgument("payload_b64 is not base64") from None
        if len(payload) > MAX_FILE_BYTES:
            raise LimitExceeded(f"the pickled call is larger than {MAX_FILE_BYTES} bytes")
        pool = await self.pool_for(args)
        call_id = "fc-" + secrets.token_hex(8)
        files = callstub.files(payload)
        r = await self._run(
            pool,
            language("python"),
            args,
            callstub.stub(req.python),
            files=files,
            collect=callstub.RESULT,
        )
        res = self._result(call_id, r, t0)
        self._audit(call_id, "call", args, status=res.status)
        if r.collected is not None and r.collected.startswith(callstub.VERSION_MISMATCH):
            raise InvalidArgument(
                f"the image's Python ({_decode(r.collected).split(' ', 1)[1]}) differs from the "
                f"caller's ({req.python}); pickled functions need the same version",
                image=args.image,
            )
        value = base64.b64encode(r.collected).decode() if r.collected else None
        return CallResult(**res.model_dump(), result_b64=value)

    async def judge(self, req: JudgeRequest) -> JudgeResult:
        t0 = time.perf_counter()
        lang = language(req.args.language)
        check_code(req.code, "", req.files)
        for t in req.tests:
            if len(t.stdin.encode()) > MAX_STDIN_BYTES:
                raise LimitExceeded(f"a test's stdin is larger than {MAX_STDIN_BYTES} bytes")
        pool = await self.pool_for(req.args)
        call_id = "fj-" + secrets.token_hex(8)
        artifact: bytes | None = None
        compiled: StepResult | None = None
        if lang.compile:
            c = await self._run(pool, lang, req.args, req.code, files=req.files, compile_only=True)
            compiled = c.compile
            if c.status != "ok" or c.artifact is None:
                res = JudgeResult(
                    call_id=call_id,
                    verdict="CE",
                    passed=0,
                    total=len(req.tests),
                    compile=compiled,
                    wall_time_s=time.perf_counter() - t0,
                    tests=[TestVerdict(verdict="CE", status="compile_error") for _ in req.tests],
                )
                self._audit(call_id, "judge", req.args, verdict="CE", tests=len(req.tests))
                return res
            artifact = c.artifact
        cpus = os.cpu_count() or 1
        width = max(1, min(len(req.tests), 32, int(2 * cpus / req.args.cpu_cores_limit) or 1))
        pool.grow(width)
        sem = asyncio.Semaphore(width)
        failed = asyncio.Event()

        async def one(test: JudgeTest) -> TestVerdict | None:
            async with sem:
                if req.stop_on_failure and failed.is_set():
                    return None
                r = await self._run(
                    pool,
                    lang,
                    req.args,
                    req.code,
                    stdin=test.stdin,
                    files=req.files,
                    artifact=artifact,
                )
            o = r.outcome
            out = _decode(o.stdout) if o else ""
            verdict: Verdict
            if r.status == "ok":
                ok = compare(out, test.expected, req.comparator, req.float_tolerance)
                verdict = "AC" if ok else "WA"
            else:
                verdict = VERDICTS[r.status]
            if verdict != "AC":
                failed.set()
            return TestVerdict(
                verdict=verdict,
                status=r.status,
                exit_code=o.exit_code if o else None,
                wall_time_s=o.wall_s if o else 0.0,
                cpu_time_s=o.cpu_s if o else 0.0,
                peak_memory_bytes=r.peak,
                stdout=out[:4096],
                stderr=_decode(o.stderr)[:4096] if o else "",
            )

        runs = [asyncio.ensure_future(one(t)) for t in req.tests]
        try:
            done = await asyncio.gather(*runs)
        except BaseException:  # one test's error ends the judge: the others stop too
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        tests = [t for t in done if t is not None]
        passed = sum(t.verdict == "AC" for t in tests)
        first_bad = next((t.verdict for t in tests if t.verdict != "AC"), None)
        if first_bad is None and len(tests) < len(req.tests):
            first_bad = "WA"
        res = JudgeResult(
            call_id=call_id,
            verdict=first_bad or "AC",
            passed=passed,
            total=len(req.tests),
            compile=compiled,
            tests=tests,
            wall_time_s=time.perf_counter() - t0,
        )
        self._audit(
            call_id, "judge", req.args, verdict=res.verdict, passed=passed, tests=len(req.tests)
        )
        return res


def _pool_holder(key: str) -> str:
    """Who holds a warm pool's layers, for the layer trace (dsec.images.mounts)."""
    return f"fncall pool {key}"
