"""Dockerfile builds without a Docker daemon, on the platform's own sandboxes.

Each ``RUN`` runs in a container sandbox of this platform, created through the normal
API: the caller's quota, the sandbox limits and the build's egress rules apply
(``network_rules``; empty = loopback only), so a build is governed like an agent. Its
changes become one EROFS layer with ``pack_diff``; ``COPY``/``ADD`` write the context's
files into a sandbox the same way and pack them. After every such step the layers so
far are tagged as a cache image (``dsec-build-cache:<key>``, ``compose_image``), which
the next step's sandbox starts from and which a rebuild finds again: the cache key of
a step is the hash of (its parent's key, the instruction after substitution, the
build's env/workdir/user, and for COPY the content hash of the files it copies).

ENV, WORKDIR, USER, CMD, ENTRYPOINT, LABEL and EXPOSE go into the final image's config;
sandboxes created from it get its environment and working directory. ARG values come
from ``build_args`` or the Dockerfile's defaults and are substituted like ENV.

Parsing: ``dockerfile-parse`` (PyPI, maintained by the containerbuildsystem project,
used by OSBS/atomic-reactor): instructions with their line numbers, continuation
lines, and its ``WordSplitter`` for quoting and ``$VAR``/``${VAR}`` expansion (it
does not do ``${VAR:-default}``, so that is refused rather than expanded wrongly).
What is not supported (multi-stage builds, ``COPY --from``, ``ADD`` of URLs and
archives, ``VOLUME``, ``ONBUILD`` ...) is refused with an InvalidArgument naming the line.

The one place a ``FROM`` reference is resolved is :func:`resolve_base`.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from dsec.api.fields import ENV_KEY_RE, names_registry
from dsec.api.images import ImageConfigSpec, ImageInfo
from dsec.api.spec import DSecContainerRunArgs
from dsec.errors import ImageBuildError, ImageNotFound, InvalidArgument, NotFound, Unsupported

if TYPE_CHECKING:
    from dsec.sdk.client import DSecClient, Sandbox

CACHE_IMAGE = "dsec-build-cache"
CACHE_LAYER = "dsec-build"
RUN_TIMEOUT = 1800.0
MAX_COPY_BYTES = 1 << 30
SUPPORTED = (
    *("FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "CMD", "ENTRYPOINT"),
    *("ARG", "LABEL", "EXPOSE", "MAINTAINER"),
)
_MODIFIER_RE = re.compile(r"\$\{[^}]*:[-+]")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")


@dataclass
class StepReport:
    line: int
    instruction: str
    cached: bool
    seconds: float
    layer: str | None = None


@dataclass
class BuildResult:
    image: ImageInfo
    steps: list[StepReport]
    seconds: float

    @property
    def cached_steps(self) -> int:
        return sum(1 for s in self.steps if s.cached)

    @property
    def layer_steps(self) -> int:
        return sum(1 for s in self.steps if s.layer is not None)


@dataclass
class _State:
    image_ref: str  # what the next step's sandbox starts from
    layers: list[str]
    key: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    exposed: list[str] = field(default_factory=list)
    args: dict[str, str] = field(default_factory=dict)
    global_args: dict[str, str] = field(default_factory=dict)  # ARGs before FROM
    made_dirs: set[str] = field(default_factory=lambda: {"/"})

    def config(self) -> ImageConfigSpec:
        return ImageConfigSpec(
            env=dict(self.env),
            workdir=self.workdir,
            user=self.user,
            cmd=self.cmd,
            entrypoint=self.entrypoint,
            labels=dict(self.labels),
            exposed_ports=list(self.exposed),
        )

    def subst(self) -> dict[str, str]:
        return {**self.args, **self.env}


async def resolve_base(client: DSecClient, ref: str) -> ImageInfo:
    """What ``FROM ref`` names: an image on the platform (``busybox:latest``), or a
    registry reference not here yet, which the platform pulls (as a run spec naming
    it would). A plain local name that is missing stays a clear ImageNotFound."""
    try:
        return await client.get_image(ref)
    except ImageNotFound:
        if not names_registry(ref):
            raise
    return (await client.pull_image(ref)).image


def _parse(text: str) -> list[dict[str, Any]]:
    try:
        from dockerfile_parse import DockerfileParser
    except ImportError:  # pragma: no cover - a dependency of dsec
        raise Unsupported("Dockerfile builds need dockerfile-parse (pip install dsec)") from None
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()), env_replace=False)
    return list(parser.structure)


def _words(value: str, subst: Mapping[str, str]) -> list[str]:
    from dockerfile_parse.util import WordSplitter

    return [w for w in WordSplitter(value, args=dict(subst), envs={}).split() if w is not None]


def _expand(value: str, subst: Mapping[str, str]) -> str:
    from dockerfile_parse.util import WordSplitter

    return str(WordSplitter(value, args=dict(subst), envs={}).dequote())


def _fail(line: int, message: str) -> InvalidArgument:
    return InvalidArgument(f"Dockerfile line {line}: {message}", line=line)


def _json_form(value: str) -> list[str] | None:
    text = value.strip()
    if not text.startswith("["):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if isinstance(doc, list) and all(isinstance(x, str) for x in doc):
        return doc
    return None


def _key_values(value: str, subst: Mapping[str, str], line: int) -> dict[str, str]:
    """``ENV``/``LABEL``/``ARG`` forms: ``k=v k2="v 2"`` or the legacy ``ENV k v``."""
    words = _words(value, subst)
    if words and "=" not in words[0]:
        if len(words) < 2:
            raise _fail(line, f"expected key=value, got {value!r}")
        head = value.strip().split(None, 1)
        return {head[0]: _expand(head[1], subst)}
    out: dict[str, str] = {}
    for word in words:
        key, sep, val = word.partition("=")
        if not sep or not key:
            raise _fail(line, f"expected key=value, got {word!r}")
        out[key] = val
    return out


def _abs_dir(state: _State, path: str) -> str:
    joined = PurePosixPath(state.workdir) / path
    parts: list[str] = []
    for part in joined.parts[1:]:
        if part == "..":
            if parts:
                parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/" + "/".join(parts)


def _context_files(context: Path, src: str, line: int) -> Iterator[tuple[Path, str]]:
    """(host path, path relative to the copy root) of what ``src`` names in the
    context; nothing outside the context, no symlink that leads out of it."""
    root = context.resolve()
    target = (root / src.lstrip("/")).resolve()
    if target != root and root not in target.parents:
        raise _fail(line, f"{src!r} is outside the build context")
    if not target.exists():
        raise _fail(line, f"{src!r} is not in the build context")
    if target.is_file():
        yield target, target.name
        return
    for dirpath, dirnames, filenames in os.walk(target):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames) + [d for d in dirnames if (base / d).is_symlink()]:
            path = base / name
            real = path.resolve()
            if real != root and root not in real.parents:
                raise _fail(line, f"{path.relative_to(root)} links outside the build context")
            if real.is_file():
                yield real, str(path.relative_to(target))
        for d in dirnames:
            if not any((base / d).iterdir()):
                yield base / d, str((base / d).relative_to(target)) + "/"


@dataclass
class _Copy:
    files: list[tuple[Path, str, int]]  # host file, destination in the image, mode
    dirs: list[str]
    digest: str
    chown: str | None


def _plan_copy(state: _State, value: str, context: Path, line: int, instruction: str) -> _Copy:
    words = _json_form(value) or _words(value, state.subst())
    chown: str | None = None
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--chown="):
            chown = flag.split("=", 1)[1]
        else:
            raise _fail(line, f"{instruction} {flag.split('=', 1)[0]} is not supported")
    if len(words) < 2:
        raise _fail(line, f"{instruction} needs a source and a destination")
    *srcs, dest = words
    for src in srcs:
        if "://" in src:
            raise _fail(line, f"{instruction} of a URL is not supported; RUN a download")
        if instruction == "ADD" and src.endswith(ARCHIVE_SUFFIXES):
            raise _fail(line, "ADD of a local archive is not supported; COPY it and RUN tar")
        if any(c in src for c in "*?["):
            raise _fail(line, f"wildcards in {instruction} sources are not supported")
    dest_abs = _abs_dir(state, dest)
    into_dir = dest.endswith("/") or len(srcs) > 1
    files: list[tuple[Path, str, int]] = []
    dirs: list[str] = []
    h = hashlib.sha256()
    total = 0
    for src in srcs:
        target = (context.resolve() / src.lstrip("/")).resolve()
        is_dir = target.is_dir()
        for host, rel in _context_files(context, src, line):
            where = f"{dest_abs.rstrip('/')}/{rel}" if is_dir or into_dir else dest_abs
            if rel.endswith("/"):
                dirs.append(where.rstrip("/"))
                h.update(f"d {where}\n".encode())
                continue
            st = host.stat()
            total += st.st_size
            if total > MAX_COPY_BYTES:
                raise _fail(line, f"{instruction} copies more than {MAX_COPY_BYTES} bytes")
            files.append((host, where, stat.S_IMODE(st.st_mode)))
            h.update(f"f {where} {stat.S_IMODE(st.st_mode):o} ".encode())
            h.update(_file_digest(host).encode() + b"\n")
        if is_dir:
            dirs.append(dest_abs)
    return _Copy(files, dirs, h.hexdigest(), chown)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while data := fh.read(1 << 20):
            h.update(data)
    return h.hexdigest()


class DockerfileBuild:
    """One build: parse, then the steps in order (see the module docstring)."""

    def __init__(
        self,
        client: DSecClient,
        dockerfile: str,
        context: Path,
        ref: str,
        *,
        build_args: Mapping[str, str] | None = None,
        network_rules: Mapping[str, bool] | None = None,
        no_cache: bool = False,
        memory_limit_mb: int = 1024,
        run_timeout: float = RUN_TIMEOUT,
        on_step: Callable[[StepReport], None] | None = None,
    ) -> None:
        self.client = client
        self.text = dockerfile
        self.context = context
        self.ref = ref
        self.build_args = dict(build_args or {})
        self.network_rules = dict(network_rules or {})
        self.no_cache = no_cache
        self.memory_limit_mb = memory_limit_mb
        self.run_timeout = run_timeout
        self.on_step = on_step
        self.steps: list[StepReport] = []

    async def run(self) -> BuildResult:
        t0 = time.perf_counter()
        instructions = _parse(self.text)
        self._check(instructions)
        state: _State | None = None
        pre_args: dict[str, str] = {}
        for ins in instructions:
            name = str(ins["instruction"]).upper()
            value = str(ins["value"])
            line = int(ins["startline"]) + 1
            s0 = time.perf_counter()
            if name == "ARG" and state is None:
                pre_args.update(self._arg(value, pre_args, line))
                continue
            if name == "FROM":
                state = await self._from(value, pre_args, line)
                self._report(line, name, True, s0, None)
                continue
            assert state is not None  # _check: FROM comes first
            layer = await self._step(state, name, value, line)
            self._report(line, name, layer is None or layer[1], s0, layer[0] if layer else None)
        assert state is not None
        if state.workdir not in state.made_dirs:
            s0 = time.perf_counter()
            line = int(instructions[-1]["endline"]) + 1
            made = await self._layer_step(state, f"WORKDIR {state.workdir}", line, ["true"])
            self._report(line, "WORKDIR", made[1], s0, made[0])
        image = await self.client.compose_image(self.ref, state.layers, state.config())
        return BuildResult(image=image, steps=self.steps, seconds=time.perf_counter() - t0)

    def _report(self, line: int, name: str, cached: bool, t0: float, layer: str | None) -> None:
        step = StepReport(line, name, cached, time.perf_counter() - t0, layer)
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)

    def _check(self, instructions: list[dict[str, Any]]) -> None:
        if not instructions:
            raise InvalidArgument("the Dockerfile has no instructions")
        froms = 0
        for ins in instructions:
            name = str(ins["instruction"]).upper()
            line = int(ins["startline"]) + 1
            if name not in SUPPORTED:
                raise _fail(
                    line,
                    f"{name} is not supported (supported: {', '.join(SUPPORTED)})",
                )
            if name == "FROM":
                froms += 1
                if froms > 1:
                    raise _fail(line, "multi-stage builds (a second FROM) are not supported")
            elif name != "ARG" and froms == 0:
                raise _fail(line, f"{name} before FROM")

    def _arg(self, value: str, known: Mapping[str, str], line: int) -> dict[str, str]:
        name, sep, default = value.strip().partition("=")
        if not name or any(c.isspace() for c in name):
            raise _fail(line, f"bad ARG {value!r}")
        if name in self.build_args:
            return {name: self.build_args[name]}
        if sep:
            return {name: _expand(default, known)}
        return {name: known[name]} if name in known else {}

    async def _from(self, value: str, pre_args: Mapping[str, str], line: int) -> _State:
        words = _words(value, pre_args)
        if words and words[0].startswith("--"):
            raise _fail(line, f"FROM {words[0]} is not supported")
        if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
            raise _fail(line, f"expected FROM image [AS name], got {value!r}")
        if words[0] == "scratch":
            raise _fail(line, "FROM scratch is not supported: start from an image")
        try:
            base = await resolve_base(self.client, words[0])
        except NotFound as exc:
            raise _fail(line, exc.message) from None
        cfg = base.config
        env = cfg.get("env")
        state = _State(
            image_ref=base.ref,
            layers=list(base.layers),
            key=hashlib.sha256(f"from {base.digest}".encode()).hexdigest(),
            env={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
            global_args=dict(pre_args),
        )
        workdir = cfg.get("workdir")
        if isinstance(workdir, str) and workdir.startswith("/"):
            state.workdir = workdir
            state.made_dirs.add(workdir)
        user = cfg.get("user")
        if isinstance(user, str) and user:
            state.user = user
        for key in ("cmd", "entrypoint"):
            val = cfg.get(key)
            if isinstance(val, list):
                setattr(state, key, [str(v) for v in val])
        return state

    async def _step(
        self, state: _State, name: str, value: str, line: int
    ) -> tuple[str, bool] | None:
        """Apply one instruction; (layer digest, cached) for a layer step, else None."""
        subst = state.subst()
        if name not in ("RUN", "CMD", "ENTRYPOINT") and _MODIFIER_RE.search(value):
            raise _fail(line, "${VAR:-default} and ${VAR:+alt} are not supported")
        if name == "ARG":
            state.args.update(self._arg(value, {**state.global_args, **subst}, line))
        elif name == "ENV":
            env = _key_values(value, subst, line)
            for key in env:
                if not ENV_KEY_RE.match(key):
                    raise _fail(line, f"invalid environment variable name {key!r}")
            state.env.update(env)
        elif name == "LABEL":
            state.labels.update(_key_values(value, subst, line))
        elif name == "MAINTAINER":
            state.labels["maintainer"] = value.strip()
        elif name == "EXPOSE":
            state.exposed += _words(value, subst)
        elif name == "WORKDIR":
            state.workdir = _abs_dir(state, _expand(value.strip(), subst))
        elif name == "USER":
            state.user = _expand(value.strip(), subst)
        elif name in ("CMD", "ENTRYPOINT"):
            argv = _json_form(value)
            setattr(state, name.lower(), argv if argv is not None else ["/bin/sh", "-c", value])
        elif name == "RUN":
            argv = _json_form(value)
            if argv is None:
                argv = ["/bin/sh", "-c", value]
            elif not argv:
                raise _fail(line, "RUN [] has no command")
            return await self._layer_step(state, f"RUN {json.dumps(argv)}", line, argv)
        elif name in ("COPY", "ADD"):
            plan = await asyncio.to_thread(_plan_copy, state, value, self.context, line, name)
            text = f"{name} {plan.digest} chown={plan.chown}"
            return await self._layer_step(state, text, line, None, plan)
        return None

    async def _layer_step(
        self,
        state: _State,
        text: str,
        line: int,
        argv: list[str] | None,
        copy: _Copy | None = None,
    ) -> tuple[str, bool]:
        doc = {
            "parent": state.key,
            "step": text,
            "env": state.env,
            "args": state.args,
            "workdir": state.workdir,
            "user": state.user,
        }
        key = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
        cache_ref = f"{CACHE_IMAGE}:{key[:48]}"
        cached = None if self.no_cache else await self._cached(cache_ref)
        if cached is not None and cached.layers[: len(state.layers)] == state.layers:
            digest, hit = cached.layers[-1], True
        else:
            digest, hit = await self._execute(state, key, line, argv, copy), False
            await self.client.compose_image(cache_ref, [*state.layers, digest], state.config())
        state.layers.append(digest)
        state.key = key
        state.image_ref = cache_ref
        state.made_dirs.add(state.workdir)
        return digest, hit

    async def _cached(self, ref: str) -> ImageInfo | None:
        try:
            return await self.client.get_image(ref)
        except NotFound:
            return None

    async def _execute(
        self, state: _State, key: str, line: int, argv: list[str] | None, copy: _Copy | None
    ) -> str:
        args = DSecContainerRunArgs(
            container_image=state.image_ref,
            network_rules=dict(self.network_rules),
            memory_limit_mb=self.memory_limit_mb,
            image_loading="eager",
            ttl_running_stop=int(self.run_timeout) + 600,
            labels={"dsec.build": self.ref.replace(":", "_")[:63]},
        )
        sb = await self.client.run_container(args)
        async with sb:
            if state.workdir != "/":
                await self._must(sb, ["mkdir", "-p", state.workdir], line, "root", "/")
            if copy is not None:
                await self._copy(sb, copy, line)
            if argv is not None:
                res = await sb.exec(
                    argv,
                    env={**state.args, **state.env},  # ARGs are the RUN's environment too
                    workdir=state.workdir,
                    user=state.user,
                    timeout=self.run_timeout,
                )
                if res.exit_code != 0:
                    raise ImageBuildError(
                        f"Dockerfile line {line}: RUN exited with {res.exit_code}: "
                        f"{(res.stderr or res.stdout).strip()[-1500:]}",
                        line=line,
                        exit_code=res.exit_code,
                    )
            packed = await sb.pack_diff(CACHE_LAYER, key)
        return packed.layer.digest

    async def _must(self, sb: Sandbox, argv: list[str], line: int, user: str, wd: str) -> None:
        res = await sb.exec(argv, user=user, workdir=wd, timeout=120)
        if res.exit_code != 0:
            raise ImageBuildError(
                f"Dockerfile line {line}: {' '.join(argv)} failed: {res.stderr.strip()[-500:]}",
                line=line,
            )

    async def _copy(self, sb: Sandbox, copy: _Copy, line: int) -> None:
        dirs = sorted({str(PurePosixPath(d).parent) for _, d, _ in copy.files} | set(copy.dirs))
        if dirs:
            await self._must(sb, ["mkdir", "-p", *dirs], line, "root", "/")
        for host, dest, mode in copy.files:
            data = await asyncio.to_thread(host.read_bytes)
            await sb.write_file(dest, data, mode=mode)
        if copy.chown:
            targets = [dest for _, dest, _ in copy.files] + copy.dirs
            await self._must(sb, ["chown", copy.chown, *targets], line, "root", "/")


async def build_dockerfile(
    client: DSecClient,
    dockerfile: Path | str,
    context: Path | str,
    ref: str,
    **options: Any,
) -> BuildResult:
    """Build ``ref`` from ``dockerfile`` (a path) with ``context`` (a directory).

    Options: ``build_args``, ``network_rules`` (egress of every RUN; default none),
    ``no_cache``, ``memory_limit_mb``, ``run_timeout``, ``on_step`` (a callback per
    step). InvalidArgument names the line of an unsupported instruction; a failing
    RUN is an ImageBuildError with its exit code and output."""
    ctx = Path(context)
    if not await asyncio.to_thread(ctx.is_dir):
        raise InvalidArgument(f"build context {ctx} is not a directory")
    try:
        text = await asyncio.to_thread(Path(dockerfile).read_text)
    except OSError as exc:
        raise InvalidArgument(f"cannot read {dockerfile}: {exc.strerror}") from None
    return await DockerfileBuild(client, text, ctx, ref, **options).run()
