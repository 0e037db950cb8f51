"""Dockerfile builds without a Docker daemon, on the platform's own sandboxes.

Each ``RUN`` runs in a container sandbox of this platform, created through the normal
API: the caller's quota, the sandbox limits and the build's egress rules apply
(``network_rules``; empty = loopback only), so a build is governed like an agent. Its
changes become one EROFS layer with ``pack_diff``; ``COPY``/``ADD`` write the context's
files into a sandbox the same way and pack them. After every such step the layers so
far are tagged as a cache image (``dsec-build-cache:<key>``, ``compose_image``), which
the next step's sandbox starts from and which a rebuild finds again: the cache key of
a step is the hash of (its parent's key, the instruction after substitution, the
build's env/workdir/user/shell, and for COPY/ADD the content hash of the files it copies;
for ``COPY --from`` the source stage's key or the source image's digest).

Multi-stage builds: every ``FROM`` starts a stage (``AS name``); ``target`` picks the
stage to build (default the last) and only the stages it needs are built (its ``FROM``
chain and the stages its ``COPY --from=<name|index>`` name); ``COPY --from=<image ref>``
copies out of an image, pulled like a ``FROM``. The image gets only the target stage's
layers. ``ARG`` before the first ``FROM`` is global: usable in ``FROM`` lines and,
redeclared without a value inside a stage, there too; ``build_args`` override defaults.

``.dockerignore`` (dsec.sdk.dockerignore, Docker's pattern rules): ignored files are
never copied nor hashed. ``ADD`` unpacks a local tar (plain/gzip/bzip2/xz, by content;
bounded) and fetches a URL *inside a build sandbox* with the build's egress rules
(``curl`` or ``wget`` of the image under construction): a Dockerfile is no way around
egress policy, and an image without either tool gets a clear error. ``--chown`` and
``--chmod`` on COPY/ADD, globs and Docker's trailing-slash rules (dsec.sdk.buildcontext).

ENV, WORKDIR, USER, CMD, ENTRYPOINT (exec and shell form; shell form through ``SHELL``),
SHELL, LABEL, EXPOSE, STOPSIGNAL and HEALTHCHECK go into the final image's config
(STOPSIGNAL and HEALTHCHECK are recorded there for whoever runs the image: the platform
itself stops sandboxes its own way and runs no health checks). VOLUME and ONBUILD are
refused with an InvalidArgument naming the line: nothing is silently ignored.

Parsing: ``dockerfile-parse`` (PyPI, maintained by the containerbuildsystem project,
used by OSBS/atomic-reactor): instructions with their line numbers, continuation
lines, and its ``WordSplitter`` for quoting and ``$VAR``/``${VAR}`` expansion (it
does not do ``${VAR:-default}``, so that is refused rather than expanded wrongly).

The one place a ``FROM`` reference is resolved is :func:`resolve_base`.
"""

from __future__ import annotations

import asyncio
import copy as copymod
import hashlib
import io
import json
import re
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from dsec.api.fields import ENV_KEY_RE, names_registry
from dsec.api.images import ImageConfigSpec, ImageInfo
from dsec.api.spec import DSecContainerRunArgs
from dsec.errors import (
    ImageBuildError,
    ImageNotFound,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    Unsupported,
)
from dsec.sdk.buildcontext import (
    MAX_COPY_BYTES,
    BuildContext,
    CopyFlags,
    CopyPlan,
    archive_kind,
    clean_abs,
    extract_archive,
    fail,
    parse_flags,
    plan_copy,
)

if TYPE_CHECKING:
    from dsec.sdk.client import DSecClient, Sandbox

CACHE_IMAGE = "dsec-build-cache"
CACHE_LAYER = "dsec-build"
RUN_TIMEOUT = 1800.0
MAX_URL_BYTES = 1 << 30
MAX_DOCKERFILE_BYTES = 1 << 20
DEFAULT_SHELL = ["/bin/sh", "-c"]
SUPPORTED = (
    *("FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "CMD", "ENTRYPOINT"),
    *("ARG", "LABEL", "EXPOSE", "MAINTAINER", "SHELL", "STOPSIGNAL", "HEALTHCHECK"),
)
REFUSED = {
    "VOLUME": "VOLUME is not supported (a sandbox's disk is its own; mount nothing)",
    "ONBUILD": "ONBUILD is not supported (a trigger run by a later build)",
}
_MODIFIER_RE = re.compile(r"\$\{[^}]*:[-+]")
_STAGE_NAME_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,127}$")
_DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h))+$")
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# ``ADD <url>`` inside the build sandbox: curl or wget, bounded, to a fixed file.
_FETCH = (
    'set -e; u="$1"; o="$2"; max="$3"; '
    'if command -v curl >/dev/null 2>&1; then curl -fsSL --max-filesize "$max" -o "$o" "$u"; '
    'elif command -v wget >/dev/null 2>&1; then wget -q -O "$o" "$u"; '
    "else echo 'ADD <url> needs curl or wget in the image' >&2; exit 127; fi; "
    '[ "$(wc -c < "$o")" -le "$max" ] || { echo "more than $max bytes" >&2; rm -f "$o"; exit 27; }'
)


@dataclass
class StepReport:
    line: int
    instruction: str
    cached: bool
    seconds: float
    layer: str | None = None
    stage: int = 0


@dataclass
class BuildResult:
    image: ImageInfo
    steps: list[StepReport]
    seconds: float
    stages_built: list[int] = field(default_factory=list)

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
    shell: list[str] = field(default_factory=lambda: list(DEFAULT_SHELL))
    stop_signal: str | None = None
    healthcheck: dict[str, Any] | None = None
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
            shell=None if self.shell == DEFAULT_SHELL else list(self.shell),
            stop_signal=self.stop_signal,
            healthcheck=self.healthcheck,
        )

    def subst(self) -> dict[str, str]:
        return {**self.args, **self.env}


@dataclass
class _Stage:
    index: int
    name: str | None
    base: str  # the FROM image word, global ARGs substituted
    line: int
    body: list[tuple[str, str, int]]  # (instruction, value, line)
    deps: set[int] = field(default_factory=set)
    base_stage: int | None = None


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


_fail = fail


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


def _duration(text: str, line: int) -> float:
    if not _DURATION_RE.match(text):
        raise _fail(line, f"bad HEALTHCHECK duration {text!r} (e.g. 30s, 1m30s)")
    return sum(float(n) * _UNITS[u] for n, u in _DURATION_PART_RE.findall(text))


def _healthcheck(value: str, line: int) -> dict[str, Any]:
    """Docker's HEALTHCHECK as the image config's ``Healthcheck`` object."""
    text = value.strip()
    if text.upper() == "NONE":
        return {"test": ["NONE"]}
    out: dict[str, Any] = {}
    options = {"--interval": "interval", "--timeout": "timeout", "--start-period": "start_period"}
    options["--start-interval"] = "start_interval"
    while text.startswith("--"):
        flag, _, text = text.partition(" ")
        text = text.strip()
        name, sep, val = flag.partition("=")
        if not sep:
            raise _fail(line, f"HEALTHCHECK {name} needs a value")
        if name in options:
            out[options[name]] = _duration(val, line)
        elif name == "--retries":
            if not val.isdigit() or int(val) > 1000:
                raise _fail(line, f"HEALTHCHECK --retries {val!r} is not a count")
            out["retries"] = int(val)
        else:
            raise _fail(line, f"HEALTHCHECK {name} is not supported")
    head, _, rest = text.partition(" ")
    if head.upper() != "CMD" or not rest.strip():
        raise _fail(line, "expected HEALTHCHECK [options] CMD command, or HEALTHCHECK NONE")
    argv = _json_form(rest)
    out["test"] = ["CMD", *argv] if argv is not None else ["CMD-SHELL", rest.strip()]
    return out


def _stop_signal(value: str, line: int) -> str:
    text = value.strip()
    if text.isdigit() and 1 <= int(text) <= 64:
        return text
    name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
    if name not in signal.Signals.__members__ and not re.match(r"^SIGRTM(IN|AX)([+-]\d+)?$", name):
        raise _fail(line, f"STOPSIGNAL {text!r} is not a signal")
    return name


def _split_stages(
    instructions: list[dict[str, Any]],
) -> tuple[list[tuple[str, int]], list[tuple[str, int, list[tuple[str, str, int]]]]]:
    """(global ARGs, [(FROM value, line, body)]) with unsupported instructions refused."""
    if not instructions:
        raise InvalidArgument("the Dockerfile has no instructions")
    global_args: list[tuple[str, int]] = []
    stages: list[tuple[str, int, list[tuple[str, str, int]]]] = []
    for ins in instructions:
        name = str(ins["instruction"]).upper()
        value = str(ins["value"])
        line = int(ins["startline"]) + 1
        if name in REFUSED:
            raise _fail(line, REFUSED[name])
        if name not in SUPPORTED:
            raise _fail(line, f"{name} is not supported (supported: {', '.join(SUPPORTED)})")
        if name == "FROM":
            stages.append((value, line, []))
        elif not stages:
            if name != "ARG":
                raise _fail(line, f"{name} before FROM")
            global_args.append((value, line))
        else:
            stages[-1][2].append((name, value, line))
    if not stages:
        raise InvalidArgument("the Dockerfile has no FROM")
    return global_args, stages


class DockerfileBuild:
    """One build: parse, plan the stages, then the needed stages' steps in order."""

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
        target: str | None = None,
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
        self.target = target
        self.on_step = on_step
        self.steps: list[StepReport] = []
        self.ctx: BuildContext | None = None
        self.stage_index = 0

    async def run(self) -> BuildResult:
        t0 = time.perf_counter()
        global_lines, raw_stages = _split_stages(_parse(self.text))
        self.ctx = await asyncio.to_thread(BuildContext.load, self.context)
        pre_args: dict[str, str] = {}
        for value, line in global_lines:
            pre_args.update(self._arg(value, pre_args, line))
        stages = self._plan(raw_stages, pre_args)
        target = self._target(stages)
        needed = self._needed(stages, target)
        done: dict[int, _State] = {}
        for stage in stages:
            if stage.index not in needed:
                continue
            self.stage_index = stage.index
            done[stage.index] = await self._build_stage(stage, pre_args, done, stages)
        state = done[target.index]
        image = await self.client.compose_image(self.ref, state.layers, state.config())
        return BuildResult(
            image=image,
            steps=self.steps,
            seconds=time.perf_counter() - t0,
            stages_built=sorted(needed),
        )

    def _plan(
        self,
        raw: list[tuple[str, int, list[tuple[str, str, int]]]],
        pre_args: Mapping[str, str],
    ) -> list[_Stage]:
        stages: list[_Stage] = []
        names: dict[str, int] = {}
        for index, (value, line, body) in enumerate(raw):
            if _MODIFIER_RE.search(value):
                raise _fail(line, "${VAR:-default} and ${VAR:+alt} are not supported")
            words = _words(value, pre_args)
            if words and words[0].startswith("--"):
                raise _fail(line, f"FROM {words[0].split('=', 1)[0]} is not supported")
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise _fail(line, f"expected FROM image [AS name], got {value!r}")
            name = words[2].lower() if len(words) == 3 else None
            if name is not None:
                if not _STAGE_NAME_RE.match(name):
                    raise _fail(line, f"invalid stage name {words[2]!r}")
                if name in names:
                    raise _fail(line, f"stage name {name!r} is used twice")
            stage = _Stage(index, name, words[0], line, body)
            base = words[0].lower()
            if base in names:
                stage.base_stage = names[base]
                stage.deps.add(names[base])
            for instr, val, ln in body:
                if instr != "COPY":
                    continue
                src = self._copy_from(val, pre_args, ln)
                if src is None:
                    continue
                ref = self._stage_ref(src, names, index, ln)
                if ref is not None:
                    stage.deps.add(ref)
            if name is not None:
                names[name] = index
            stages.append(stage)
        return stages

    @staticmethod
    def _copy_from(value: str, pre_args: Mapping[str, str], line: int) -> str | None:
        words = _json_form(value) or _words(value, pre_args)
        for word in words:
            if not word.startswith("--"):
                return None
            if word.startswith("--from="):
                return word.split("=", 1)[1]
        return None

    @staticmethod
    def _stage_ref(src: str, names: Mapping[str, int], index: int, line: int) -> int | None:
        """The stage ``--from=src`` names (a name or an index), None for an image."""
        if src.isdigit():
            n = int(src)
            if n >= index:
                raise _fail(line, f"COPY --from={src}: stage {n} is not an earlier stage")
            return n
        if src.lower() in names:
            return names[src.lower()]
        return None

    def _target(self, stages: list[_Stage]) -> _Stage:
        if self.target is None:
            return stages[-1]
        for stage in stages:
            if stage.name == self.target.lower():
                return stage
        known = ", ".join(s.name for s in stages if s.name) or "none"
        raise InvalidArgument(f"build target {self.target!r} is not a stage (stages: {known})")

    @staticmethod
    def _needed(stages: list[_Stage], target: _Stage) -> set[int]:
        needed: set[int] = set()
        todo = [target.index]
        while todo:
            i = todo.pop()
            if i not in needed:
                needed.add(i)
                todo.extend(stages[i].deps)
        return needed

    def _report(self, line: int, name: str, cached: bool, t0: float, layer: str | None) -> None:
        step = StepReport(line, name, cached, time.perf_counter() - t0, layer, self.stage_index)
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)

    def _arg(self, value: str, known: Mapping[str, str], line: int) -> dict[str, str]:
        name, sep, default = value.strip().partition("=")
        if not name or any(c.isspace() for c in name):
            raise _fail(line, f"bad ARG {value!r}")
        if name in self.build_args:
            return {name: self.build_args[name]}
        if sep:
            return {name: _expand(default, known)}
        return {name: known[name]} if name in known else {}

    async def _build_stage(
        self,
        stage: _Stage,
        pre_args: Mapping[str, str],
        done: Mapping[int, _State],
        stages: list[_Stage],
    ) -> _State:
        s0 = time.perf_counter()
        if stage.base_stage is not None:
            state = copymod.deepcopy(done[stage.base_stage])
            state.args = {}
            state.global_args = dict(pre_args)
        else:
            state = await self._from(stage.base, pre_args, stage.line)
        self._report(stage.line, "FROM", True, s0, None)
        for name, value, line in stage.body:
            s0 = time.perf_counter()
            layer = await self._step(state, name, value, line, done, stages)
            self._report(line, name, layer is None or layer[1], s0, layer[0] if layer else None)
        if state.workdir not in state.made_dirs:
            s0 = time.perf_counter()
            line = stage.body[-1][2] if stage.body else stage.line
            made = await self._layer_step(state, f"WORKDIR {state.workdir}", line, None)
            self._report(line, "WORKDIR", made[1], s0, made[0])
        return state

    async def _from(self, base_ref: str, pre_args: Mapping[str, str], line: int) -> _State:
        if base_ref == "scratch":
            raise _fail(line, "FROM scratch is not supported: start from an image")
        try:
            base = await resolve_base(self.client, base_ref)
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
        for key in ("cmd", "entrypoint", "shell"):
            val = cfg.get(key)
            if isinstance(val, list) and (val or key != "shell"):
                setattr(state, key, [str(v) for v in val])
        for key in ("labels",):
            val = cfg.get(key)
            if isinstance(val, dict):
                state.labels = {str(k): str(v) for k, v in val.items()}
        sig = cfg.get("stop_signal")
        if isinstance(sig, str):
            state.stop_signal = sig
        health = cfg.get("healthcheck")
        if isinstance(health, dict):
            state.healthcheck = dict(health)
        return state

    def _command(self, state: _State, value: str, line: int, name: str) -> list[str]:
        argv = _json_form(value)
        if argv is None:
            return [*state.shell, value]
        if not argv and name == "RUN":
            raise _fail(line, "RUN [] has no command")
        return argv

    async def _step(
        self,
        state: _State,
        name: str,
        value: str,
        line: int,
        done: Mapping[int, _State],
        stages: list[_Stage],
    ) -> tuple[str, bool] | None:
        """Apply one instruction; (layer digest, cached) for a layer step, else None."""
        subst = state.subst()
        if name not in ("RUN", "CMD", "ENTRYPOINT", "HEALTHCHECK") and _MODIFIER_RE.search(value):
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
            for port in _words(value, subst):
                if not re.match(r"^\d{1,5}(-\d{1,5})?(/(tcp|udp|sctp))?$", port):
                    raise _fail(line, f"EXPOSE {port!r} is not a port[/protocol]")
                state.exposed.append(port)
        elif name == "WORKDIR":
            state.workdir = clean_abs(state.workdir, _expand(value.strip(), subst))
        elif name == "USER":
            state.user = _expand(value.strip(), subst)
        elif name == "SHELL":
            argv = _json_form(value)
            if not argv:
                raise _fail(line, 'SHELL takes the JSON form, e.g. SHELL ["/bin/bash", "-c"]')
            state.shell = argv
        elif name == "STOPSIGNAL":
            state.stop_signal = _stop_signal(_expand(value, subst), line)
        elif name == "HEALTHCHECK":
            state.healthcheck = _healthcheck(value, line)
        elif name == "CMD":
            state.cmd = self._command(state, value, line, name)
        elif name == "ENTRYPOINT":
            state.entrypoint = self._command(state, value, line, name)
            state.cmd = None  # Docker: a new ENTRYPOINT drops the CMD it inherited
        elif name == "RUN":
            if value.lstrip().startswith("--"):
                flag = value.split()[0].split("=", 1)[0]
                raise _fail(line, f"RUN {flag} is not supported (no cache or secret mounts)")
            argv = self._command(state, value, line, name)
            return await self._layer_step(
                state, f"RUN {json.dumps(argv)}", line, self._run_action(state, argv, line)
            )
        elif name in ("COPY", "ADD"):
            return await self._copy_step(state, name, value, line, done, stages)
        return None

    async def _copy_step(
        self,
        state: _State,
        name: str,
        value: str,
        line: int,
        done: Mapping[int, _State],
        stages: list[_Stage],
    ) -> tuple[str, bool]:
        words = _json_form(value) or _words(value, state.subst())
        flags = parse_flags(words, name, line)
        if len(words) < 2:
            raise _fail(line, f"{name} needs a source and a destination")
        *srcs, dest = words
        if flags.source is not None:
            return await self._copy_from_step(state, srcs, dest, flags, line, done, stages)
        urls = [s for s in srcs if "://" in s]
        if urls:
            if name == "COPY":
                raise _fail(line, "COPY of a URL is not supported; use ADD")
            if len(srcs) > 1:
                raise _fail(line, "ADD <url> takes one source")
            return await self._add_url(state, urls[0], dest, flags, line)
        assert self.ctx is not None
        plan = await asyncio.to_thread(
            plan_copy, self.ctx, srcs, dest, state.workdir, flags, line, name
        )
        archives: list[tuple[Path, str]] = []
        if name == "ADD":
            for host, where, _mode in list(plan.files):
                kind = await asyncio.to_thread(archive_kind, host)
                if kind is not None:
                    archives.append((host, kind))
                    plan.files.remove((host, where, _mode))
        text = f"{name} {plan.digest} archives={len(archives)} dest={dest}"
        dest_dir = clean_abs(state.workdir, dest)
        return await self._layer_step(
            state, text, line, self._copy_action(plan, line, archives, dest_dir)
        )

    async def _copy_from_step(
        self,
        state: _State,
        srcs: list[str],
        dest: str,
        flags: CopyFlags,
        line: int,
        done: Mapping[int, _State],
        stages: list[_Stage],
    ) -> tuple[str, bool]:
        assert flags.source is not None
        names = {s.name: s.index for s in stages if s.name is not None}
        index = self._stage_ref(flags.source, names, self.stage_index, line)
        if index is not None:
            source = done[index]
            source_ref, source_key = source.image_ref, source.key
        else:
            try:
                image = await resolve_base(self.client, flags.source)
            except NotFound as exc:
                raise _fail(line, f"COPY --from={flags.source}: {exc.message}") from None
            source_ref, source_key = image.ref, image.digest
        for src in srcs:
            if any(c in src for c in "*?[") or "\x00" in src:
                raise _fail(line, "wildcards in COPY --from sources are not supported")
        paths = [clean_abs("/", s) for s in srcs]  # from the source's root, as in Docker
        text = (
            f"COPY --from {source_key} {json.dumps(paths)} {dest} "
            f"chown={flags.chown} chmod={flags.chmod}"
        )

        async def action(sb: Sandbox) -> None:
            await self._copy_out_of(source_ref, paths, dest, state.workdir, flags, line, sb)

        return await self._layer_step(state, text, line, action)

    async def _copy_out_of(
        self,
        source_ref: str,
        paths: list[str],
        dest: str,
        workdir: str,
        flags: CopyFlags,
        line: int,
        sb: Sandbox,
    ) -> None:
        """Copy ``paths`` of the image ``source_ref`` into ``sb``: a sandbox of the
        source (no network) streams each as a tar into a local staging directory
        (extracted with tarfile's ``data`` filter), which is then copied like a context."""
        args = DSecContainerRunArgs(
            container_image=source_ref,
            memory_limit_mb=256,
            ttl_running_stop=int(self.run_timeout) + 600,
            labels={"dsec.build": self.ref.replace(":", "_")[:63]},
        )
        with tempfile.TemporaryDirectory(prefix="dsec-copyfrom-") as tmp:
            stage_root = Path(tmp)
            rels: list[str] = []
            async with await self.client.run_container(args) as src:
                for n, path in enumerate(paths):
                    try:
                        info = await src.stat(path, follow=True)
                    except NotFound:
                        raise _fail(line, f"COPY --from: {path} is not in the source") from None
                    slot = stage_root / str(n)
                    await src.download_dir(path, slot)
                    if info.type == "directory":
                        rels.append(str(n))
                    else:
                        rels.append(f"{n}/{PurePosixPath(path).name}")
            ctx = BuildContext(stage_root)
            plan = await asyncio.to_thread(plan_copy, ctx, rels, dest, workdir, flags, line, "COPY")
            await self._apply_copy(sb, plan, line)

    async def _add_url(
        self, state: _State, url: str, dest: str, flags: CopyFlags, line: int
    ) -> tuple[str, bool]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _fail(line, f"ADD {url!r}: only http and https URLs")
        if any(c in url for c in "\x00\n\r\t ") or len(url) > 4096:
            raise _fail(line, "ADD: the URL has control characters or is too long")
        name = PurePosixPath(parts.path).name
        if dest.endswith("/") and not name:
            raise _fail(line, f"ADD {url!r}: cannot tell a file name from the URL")
        where = clean_abs(state.workdir, dest + name if dest.endswith("/") else dest)
        text = f"ADD {url} {where} chown={flags.chown} chmod={flags.chmod}"

        async def action(sb: Sandbox) -> None:
            parent = str(PurePosixPath(where).parent)
            await self._must(sb, ["mkdir", "-p", parent], line, "root", "/")
            res = await sb.exec(
                ["/bin/sh", "-c", _FETCH, "add", url, where, str(MAX_URL_BYTES)],
                user="root",
                workdir="/",
                timeout=self.run_timeout,
            )
            if res.exit_code != 0:
                raise ImageBuildError(
                    f"Dockerfile line {line}: ADD {url} failed (exit {res.exit_code}; the "
                    f"build's network_rules decide what it may reach): "
                    f"{(res.stderr or res.stdout).strip()[-500:]}",
                    line=line,
                    exit_code=res.exit_code,
                )
            mode = f"{flags.chmod:o}" if flags.chmod is not None else "600"
            await self._must(sb, ["chmod", mode, where], line, "root", "/")
            if flags.chown:
                await self._must(sb, ["chown", flags.chown, where], line, "root", "/")

        return await self._layer_step(state, text, line, action)

    def _run_action(
        self, state: _State, argv: list[str], line: int
    ) -> Callable[[Sandbox], Awaitable[None]]:
        env = {**state.args, **state.env}  # ARGs are the RUN's environment too
        workdir, user = state.workdir, state.user

        async def action(sb: Sandbox) -> None:
            res = await sb.exec(argv, env=env, workdir=workdir, user=user, timeout=self.run_timeout)
            if res.exit_code != 0:
                raise ImageBuildError(
                    f"Dockerfile line {line}: RUN exited with {res.exit_code}: "
                    f"{(res.stderr or res.stdout).strip()[-1500:]}",
                    line=line,
                    exit_code=res.exit_code,
                )

        return action

    def _copy_action(
        self, plan: CopyPlan, line: int, archives: list[tuple[Path, str]], dest_dir: str
    ) -> Callable[[Sandbox], Awaitable[None]]:
        async def action(sb: Sandbox) -> None:
            await self._apply_copy(sb, plan, line)
            for host, kind in archives:
                with tempfile.TemporaryDirectory(prefix="dsec-add-") as tmp:
                    out = Path(tmp) / "x"
                    await asyncio.to_thread(
                        extract_archive, host, kind, out, line, limit=MAX_COPY_BYTES
                    )
                    ctx = BuildContext(out)
                    flags = CopyFlags(chown=plan.chown, chmod=plan.chmod)
                    sub = await asyncio.to_thread(
                        plan_copy, ctx, ["."], dest_dir.rstrip("/") + "/", "/", flags, line, "ADD"
                    )
                    await self._apply_copy(sb, sub, line)

        return action

    async def _layer_step(
        self,
        state: _State,
        text: str,
        line: int,
        action: Callable[[Sandbox], Awaitable[None]] | None,
    ) -> tuple[str, bool]:
        doc = {
            "parent": state.key,
            "step": text,
            "env": state.env,
            "args": state.args,
            "workdir": state.workdir,
            "user": state.user,
            "shell": state.shell,
        }
        key = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
        cache_ref = f"{CACHE_IMAGE}:{key[:48]}"
        cached = None if self.no_cache else await self._cached(cache_ref)
        if cached is not None and cached.layers[: len(state.layers)] == state.layers:
            digest, hit = cached.layers[-1], True
        else:
            digest, hit = await self._execute(state, key, line, action), False
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
        self,
        state: _State,
        key: str,
        line: int,
        action: Callable[[Sandbox], Awaitable[None]] | None,
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
            if action is not None:
                await action(sb)
            packed = await sb.pack_diff(CACHE_LAYER, key)
        return packed.layer.digest

    async def _must(self, sb: Sandbox, argv: list[str], line: int, user: str, wd: str) -> None:
        res = await sb.exec(argv, user=user, workdir=wd, timeout=120)
        if res.exit_code != 0:
            raise ImageBuildError(
                f"Dockerfile line {line}: {' '.join(argv)} failed: {res.stderr.strip()[-500:]}",
                line=line,
            )

    async def _apply_copy(self, sb: Sandbox, plan: CopyPlan, line: int) -> None:
        dirs = sorted({str(PurePosixPath(d).parent) for _, d, _ in plan.files} | set(plan.dirs))
        if dirs:
            await self._must(sb, ["mkdir", "-p", *dirs], line, "root", "/")
        for host, dest, mode in plan.files:
            await sb.write_stream(dest, host, mode=mode if plan.chmod is None else plan.chmod)
        targets = [dest for _, dest, _ in plan.files] + plan.dirs
        if plan.chmod is not None and plan.dirs:
            await self._must(sb, ["chmod", f"{plan.chmod:o}", *plan.dirs], line, "root", "/")
        if plan.chown and targets:
            await self._must(sb, ["chown", plan.chown, *targets], line, "root", "/")


async def build_dockerfile(
    client: DSecClient,
    dockerfile: Path | str,
    context: Path | str,
    ref: str,
    **options: Any,
) -> BuildResult:
    """Build ``ref`` from ``dockerfile`` (a path) with ``context`` (a directory).

    Options: ``build_args``, ``network_rules`` (egress of every RUN and ``ADD <url>``;
    default none), ``target`` (the stage to build), ``no_cache``, ``memory_limit_mb``,
    ``run_timeout``, ``on_step`` (a callback per step). InvalidArgument names the line
    of an unsupported instruction; a failing RUN is an ImageBuildError with its exit
    code and output."""
    ctx = Path(context)
    if not await asyncio.to_thread(ctx.is_dir):
        raise InvalidArgument(f"build context {ctx} is not a directory")
    try:
        size = (await asyncio.to_thread(Path(dockerfile).stat)).st_size
        if size > MAX_DOCKERFILE_BYTES:
            raise PayloadTooLarge(f"{dockerfile} is larger than {MAX_DOCKERFILE_BYTES} bytes")
        text = await asyncio.to_thread(Path(dockerfile).read_text)
    except OSError as exc:
        raise InvalidArgument(f"cannot read {dockerfile}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidArgument(f"{dockerfile} is not UTF-8 text") from None
    return await DockerfileBuild(client, text, ctx, ref, **options).run()
