"""`dsec run-code` and `dsec judge`: stateless calls from the platform's warm pools."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from dsec.api.fncall import DSecFnCallRunArgs
from dsec.cli.common import emit, emit_json, sync_client, usage_from

LangOpt = Annotated[str, typer.Option("--lang", "-l", help="python, bash, sh, c, cpp, node")]
ImageOpt = Annotated[str, typer.Option("--image", help="image ref")]
MemOpt = Annotated[int, typer.Option("--memory", help="memory limit, MiB")]
CpuOpt = Annotated[float, typer.Option("--cpus", help="CPU quota in cores")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="wall-time limit, seconds")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _args(lang: str, image: str, memory: int, cpus: float, timeout: float) -> DSecFnCallRunArgs:
    try:
        return DSecFnCallRunArgs(
            image=image,
            language=lang,
            memory_limit_mb=memory,
            cpu_cores_limit=cpus,
            timeout_s=timeout,
        )
    except ValidationError as exc:
        raise usage_from(exc) from None


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text()


def run_code(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(help="source file ('-' for stdin)")],
    lang: LangOpt = "python",
    image: ImageOpt = "debian-python:bookworm",
    stdin_file: Annotated[
        str | None, typer.Option("--stdin", help="file fed to the program's stdin")
    ] = None,
    memory: MemOpt = 256,
    cpus: CpuOpt = 1.0,
    timeout: TimeoutOpt = 10.0,
    as_json: JsonOpt = False,
) -> None:
    """Run a program once in a fresh sandbox; exit code 0 only if its status is ok."""
    args = _args(lang, image, memory, cpus, timeout)
    code = _read(file)
    stdin = _read(stdin_file) if stdin_file else ""
    with sync_client(ctx, timeout=None) as client:
        res = client.run_code(args, code, stdin=stdin)
    if as_json:
        emit_json(res)
    else:
        if res.compile is not None and res.status == "compile_error":
            sys.stderr.write(res.compile.stderr)
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        sys.stderr.write(
            f"[{res.status}] exit {res.exit_code} wall {res.wall_time_s * 1000:.1f} ms "
            f"cpu {res.cpu_time_s * 1000:.1f} ms peak {res.peak_memory_bytes >> 10} KiB\n"
        )
    if res.status != "ok":
        raise typer.Exit(1)


def judge(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(help="source file")],
    tests: Annotated[
        Path, typer.Option("--tests", help='JSON: [{"stdin": ..., "expected": ...}, ...]')
    ],
    lang: LangOpt = "cpp",
    image: ImageOpt = "debian-python:bookworm",
    comparator: Annotated[
        str, typer.Option("--compare", help="exact, whitespace or float")
    ] = "whitespace",
    memory: MemOpt = 256,
    cpus: CpuOpt = 1.0,
    timeout: TimeoutOpt = 2.0,
    as_json: JsonOpt = False,
) -> None:
    """Judge a program on tests; prints one verdict per test (AC, WA, TLE, MLE, RE, CE)."""
    args = _args(lang, image, memory, cpus, timeout)
    cases = json.loads(tests.read_text())
    if comparator not in ("exact", "whitespace", "float"):
        raise typer.BadParameter("--compare must be exact, whitespace or float")
    with sync_client(ctx, timeout=None) as client:
        res = client.judge(args, _read(file), cases, comparator=comparator)  # type: ignore[arg-type]
    lines = [f"{i}: {t.verdict} ({t.wall_time_s * 1000:.1f} ms)" for i, t in enumerate(res.tests)]
    emit(res, "\n".join([*lines, f"{res.verdict} {res.passed}/{res.total}"]), as_json)
    if res.verdict != "AC":
        raise typer.Exit(1)


__all__ = ["judge", "run_code"]
