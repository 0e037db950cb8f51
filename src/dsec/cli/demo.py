"""`dsec demo`: the first thing a new user runs.

Finds or starts a platform, makes sure the image exists, creates sandboxes concurrently
(a burst: reported as sandboxes per second), runs a command in each, shows what
happened, cleans up; then measures what a user can compare (sequential create, exec,
the host's raw crun on the same layer: dsec.cli.demo_timings) and exits 0 only if every
step worked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from dsec.api.fields import parse_image_ref
from dsec.api.spec import DSecContainerRunArgs, DSecMicroVMRunArgs
from dsec.cli.common import cell, err, globals_of, out, print_error
from dsec.cli.demo_timings import TIMING_IMAGE, Timings, measure_platform, measure_raw, show_timings
from dsec.cli.up import announce
from dsec.config import DEFAULT_DATA_DIR, load_client_config, save_client_config
from dsec.errors import DSecError, ImageNotFound, PlatformUnavailable, Unauthenticated
from dsec.net.ports import free_port
from dsec.sdk import DSecClient, Sandbox

RECIPES = {"busybox": "busybox", "debian-python": "debian-python"}
DEFAULT_REFS = {"busybox": "busybox:latest", "debian-python": "debian-python:bookworm"}
PYTHON_PROBE = "python3 -c 'import platform,os; print(platform.python_version(), os.getpid())'"


# ---- the platform: found or started ---------------------------------------------------


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def platform_command(port: int, data_dir: Path) -> list[str]:
    """How the demo starts its own platform (a separate `dsec up` process)."""
    return [
        sys.executable,
        "-m",
        "dsec.cli.main",
        "up",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--no-save-config",
    ]


@dataclass
class StartedPlatform:
    proc: subprocess.Popen[bytes]
    url: str
    api_key: str
    data_dir: Path
    temp_dir: bool
    log_path: Path
    killed: bool = False

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.proc.kill()
                self.proc.wait()


def start_platform(data_dir: Path | None, wait: float = 120.0) -> StartedPlatform:
    temp = data_dir is None
    directory = Path(tempfile.mkdtemp(prefix="dsec-demo-")) if data_dir is None else data_dir
    directory.mkdir(parents=True, exist_ok=True)
    fd, log_name = tempfile.mkstemp(prefix="dsec-demo-", suffix=".log")
    key = "dsk_" + secrets.token_urlsafe(24)
    port = free_port()
    env = {**os.environ, "DSEC_API_KEY": key}
    if temp:
        # Its data dir is removed at the end: nothing may run on for a later `dsec up`
        # to re-adopt (a kept spawner would outlive the directory it serves).
        env["DSEC_STOP_SANDBOXES_ON_EXIT"] = "1"
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            platform_command(port, directory),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the demo, which then stops it cleanly
        )
    started = StartedPlatform(
        proc, f"http://127.0.0.1:{port}", key, directory, temp, Path(log_name)
    )
    deadline = time.monotonic() + wait
    with err.status(f"starting a platform (dsec up, data in {directory})..."):
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = started.log_tail()
                if tail:
                    err.print(tail, style="dim", markup=False, highlight=False)
                raise PlatformUnavailable(
                    f"`dsec up` exited with code {proc.returncode}; log: {log_name}"
                )
            if answers(started.url):
                return started
            time.sleep(0.1)
    started.stop()
    raise PlatformUnavailable(f"`dsec up` did not answer within {wait:.0f} s; log: {log_name}")


def _cleanup(started: StartedPlatform) -> None:
    """After the platform started here stopped: its log goes, and a throwaway data dir
    with it (never one that still has mounts under it). Both are kept, and said, when
    the stop was not clean: they are what there is to look at then."""
    clean = not started.killed  # a clean exit may still report SIGTERM (uvicorn's)
    if started.temp_dir:
        try:
            from dsec import linux

            clean = clean and not linux.mounts(started.data_dir)
        except Exception:
            clean = False
        if clean:
            shutil.rmtree(started.data_dir, ignore_errors=True)
    if clean:
        started.log_path.unlink(missing_ok=True)
        return
    kept = f"{started.data_dir} and " if started.temp_dir else ""
    err.print(f"kept {kept}{started.log_path} for inspection", style="yellow")


@contextlib.contextmanager
def ended_like_ctrl_c() -> Iterator[None]:
    """SIGTERM and SIGHUP (``timeout``, a closed terminal, a job runner's stop) end the
    demo as Ctrl-C does, so its cleanup runs: the sandboxes it made and the platform it
    started are stopped, a throwaway data dir removed. Python's default for them is to
    die on the spot, which left that `dsec up` (its own session, so the signal never
    reached it) serving a data dir that nobody would stop or remove. Where SIGINT is
    ignored (a background job of a non-interactive shell), the interrupt is raised
    here instead, or these signals would end nothing at all."""

    def relay(signum: int, frame: object) -> None:
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)  # asyncio's handler: its tasks end cleanly

    before = {sig: signal.signal(sig, relay) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class DemoPlatform:
    """The platform the demo talks to, and where its layer blobs may be on this host
    (for the raw crun baseline: the data dir of one started here, else the default)."""

    url: str
    api_key: str
    data_dirs: tuple[Path, ...]


@contextlib.contextmanager
def platform_for_demo(
    url: str | None, api_key: str | None, data_dir: Path | None, keep: bool
) -> Iterator[DemoPlatform]:
    """A running platform: the configured one, or one started here."""
    config = load_client_config(url, api_key)
    guesses = tuple(d for d in (data_dir, DEFAULT_DATA_DIR) if d is not None)
    if answers(config.url):
        if not config.api_key:
            raise Unauthenticated(
                f"the platform at {config.url} answers but no API key is known: "
                "pass --api-key or set DSEC_API_KEY"
            )
        err.print(f"using the platform at {config.url}", style="dim")
        yield DemoPlatform(config.url, config.api_key, guesses)
        return
    started = start_platform(data_dir)
    try:
        yield DemoPlatform(started.url, started.api_key, (started.data_dir,))
    finally:
        if keep and started.proc.poll() is None:
            saved = save_client_config(started.url, started.api_key)
            announce(started.url, started.api_key, saved)
            err.print(
                f"the platform keeps running (pid {started.proc.pid}); "
                f"stop it with: kill {started.proc.pid}",
                style="dim",
            )
        else:
            with err.status("stopping the platform..."):
                started.stop()
            _cleanup(started)


# ---- the demo itself -------------------------------------------------------------------


@dataclass
class Row:
    index: int
    sandbox: Sandbox | None = None
    create_ms: float | None = None
    exec_ms: float | None = None
    exit_code: int | None = None
    output: str = ""
    state: str = "-"
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and self.exit_code == 0 and self.state == "stopped"


def probe_command(image: str) -> str:
    name, _ = parse_image_ref(image)
    return PYTHON_PROBE if name.rsplit("/", 1)[-1].startswith("debian-python") else "uname -a"


async def ensure_image(client: DSecClient, image: str) -> None:
    try:
        await client.get_image(image)
        return
    except ImageNotFound:
        name, _ = parse_image_ref(image)
        recipe = RECIPES.get(name)
        if recipe is None:
            raise
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        progress.add_task(f"building {image} (first time only; debootstrap takes minutes)")
        default = parse_image_ref(DEFAULT_REFS[recipe])
        target = None if parse_image_ref(image) == default else image
        info = await client.build_image(recipe, name=target)
    err.print(f"built {info.ref} ({len(info.layers)} layer(s))", style="dim")


async def run_demo(
    url: str, api_key: str, count: int, image: str, timeout: float, timings: Timings
) -> bool:
    """The concurrent phase: ``count`` creates at once (their rate goes to ``timings``),
    a command in each, all stopped."""
    run_id = secrets.token_hex(4)
    command = probe_command(image)
    rows = [Row(i) for i in range(count)]
    args = DSecContainerRunArgs(
        container_image=image,
        memory_limit_mb=256,
        cpu_cores_limit=0.5,
        ttl_running_stop=600,
        labels={"dsec-demo": run_id},
    )
    started_at = time.perf_counter()
    async with DSecClient(url, api_key, max_connections=max(64, min(count, 1024))) as client:
        await ensure_image(client, image)
        columns = (
            TextColumn("{task.description:<10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=err) as progress:
            creating = progress.add_task("create", total=count)
            running = progress.add_task("exec", total=count)

            burst_start = time.perf_counter()
            ready: list[float] = []

            async def one(row: Row) -> None:
                t0 = time.perf_counter()
                try:
                    row.sandbox = await client.run_container(args, timeout=timeout)
                    row.create_ms = (time.perf_counter() - t0) * 1000
                    ready.append(time.perf_counter())
                    row.state = row.sandbox.state.value
                except DSecError as exc:
                    row.errors.append(f"{exc.code}: {exc.message}")
                    return
                finally:
                    progress.advance(creating)
                t1 = time.perf_counter()
                try:
                    result = await row.sandbox.run_shell(command, timeout=60)
                    row.exec_ms = (time.perf_counter() - t1) * 1000
                    row.exit_code = result.exit_code
                    text = (result.stdout.strip() or result.stderr.strip()).splitlines()
                    row.output = text[0] if text else ""
                    if result.exit_code != 0:
                        row.output = f"exit {result.exit_code}: {row.output}"
                except DSecError as exc:
                    row.errors.append(f"{exc.code}: {exc.message}")
                finally:
                    progress.advance(running)

            async def stop(row: Row) -> None:
                if row.sandbox is None:
                    return
                try:
                    row.state = (await row.sandbox.stop()).state.value
                except DSecError as exc:
                    row.errors.append(f"stop: {exc.code}: {exc.message}")
                finally:
                    progress.advance(removing)

            removing = progress.add_task("remove", total=count, visible=False)
            try:
                await asyncio.gather(*(one(r) for r in rows))
                if ready:
                    timings.burst_n, timings.burst_s = len(ready), max(ready) - burst_start
            finally:
                created = sum(1 for r in rows if r.sandbox is not None)
                progress.update(removing, total=created, visible=True)
                await asyncio.gather(*(stop(r) for r in rows))
    show_summary(rows, command, time.perf_counter() - started_at)
    return all(r.ok for r in rows)


async def run_timings(
    platform: DemoPlatform, timings: Timings, *, creates: int, execs: int
) -> bool:
    """The comparable figures (dsec.cli.demo_timings), measured after the burst so that
    neither disturbs the other; printed as one table."""
    async with DSecClient(platform.url, platform.api_key) as client:
        await ensure_image(client, TIMING_IMAGE)
        layers = (await client.get_image(TIMING_IMAGE)).layers
        with err.status(f"timing {creates} sequential creates and {execs} execs..."):
            await measure_platform(client, timings, creates=creates, execs=execs)
        with err.status("timing raw crun on the same layer..."):
            await measure_raw(timings, platform.url, layers, platform.data_dirs, creates)
    show_timings(timings)
    return True


MICROVM_PROBE = "uname -r; nproc; awk '/MemTotal/ {print $2 \" kB\"}' /proc/meminfo"


async def run_microvm_demo(url: str, api_key: str, image: str, timeout: float) -> bool:
    """One microVM from the same image store (a booted kernel of its own), timed, with
    the accelerator that ran it; skipped with a note where the platform runs none."""
    async with DSecClient(url, api_key) as client:
        health = await client.health()
        if "microvm" not in health.backends:
            why = health.backends_unavailable.get("microvm", "not enabled")
            err.print(f"microVMs: skipped ({cell(why)})", style="yellow")
            return True
        await ensure_image(client, image)
        args = DSecMicroVMRunArgs(image=image, memory_limit_mb=256, ttl_running_stop=600)
        t0 = time.perf_counter()
        try:
            sandbox = await client.run_microvm(args, timeout=timeout)
        except DSecError as exc:
            out.print(Text(f"microVM create failed: {exc.code}: {exc.message}", style="red"))
            return False
        try:
            create_ms = (time.perf_counter() - t0) * 1000
            t1 = time.perf_counter()
            result = await sandbox.run_shell(MICROVM_PROBE, timeout=60)
            exec_ms = (time.perf_counter() - t1) * 1000
        finally:
            await sandbox.stop()
        guest = " / ".join(result.stdout.split("\n")[:3]).strip(" /")
        out.print(
            Text.assemble(
                f"microVM {sandbox.id} ({sandbox.info.accelerator or '?'}): created in "
                f"{create_ms:.0f} ms, exec {exec_ms:.0f} ms, guest kernel/cpus/memory: ",
                cell(guest),
            )
        )
        return result.exit_code == 0


def show_summary(rows: list[Row], command: str, elapsed: float) -> None:
    out.print(f"$ {command}", markup=False, style="bold")
    table = Table(header_style="bold", box=None)
    table.add_column("#", justify="right")
    table.add_column("sandbox")
    table.add_column("state")
    # Time until this sandbox was ready within the burst: queueing included.
    table.add_column("ready after ms", justify="right")
    table.add_column("exec ms", justify="right")
    table.add_column("output", overflow="fold")
    for row in rows:
        # cell(): command output is data, never rich markup or terminal control.
        table.add_row(
            str(row.index),
            cell(row.sandbox.id if row.sandbox else "-"),
            cell(row.state, style="green" if row.ok else "red"),
            f"{row.create_ms:.1f}" if row.create_ms is not None else "-",
            f"{row.exec_ms:.1f}" if row.exec_ms is not None else "-",
            cell("; ".join(row.errors), style="red") if row.errors else cell(row.output),
        )
    out.print(table)
    ok = sum(r.ok for r in rows)
    verdict = (
        Text("all good", style="green")
        if ok == len(rows)
        else Text(f"{len(rows) - ok} failed", style="red")
    )
    out.print(
        Text.assemble(
            f"{ok}/{len(rows)} sandboxes created at once, ran and removed in {elapsed:.2f} s: ",
            verdict,
        )
    )


def demo(
    ctx: typer.Context,
    count: Annotated[int, typer.Option("--count", "-n", min=1, max=10_000)] = 20,
    image: Annotated[str, typer.Option("--image")] = "debian-python:bookworm",
    data_dir: Annotated[
        Path | None,
        typer.Option(
            "--data-dir",
            help="data dir for a platform started here (default: /var/lib/dsec, so built "
            "images are reused by the next run; --temp-data for a throwaway one)",
        ),
    ] = None,
    temp_data: Annotated[
        bool, typer.Option("--temp-data", help="start the platform on a throwaway data dir")
    ] = False,
    keep_platform: Annotated[
        bool,
        typer.Option(
            "--keep-platform/--no-keep-platform", help="leave a platform started here running"
        ),
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="per-sandbox create timeout")] = 120,
    microvm: Annotated[
        bool,
        typer.Option("--microvm/--no-microvm", help="also boot one microVM (busybox) and time it"),
    ] = True,
    creates: Annotated[
        int,
        typer.Option(
            "--creates", min=0, max=1000, help="sequential creates timed (0: no timing phase)"
        ),
    ] = 30,
    execs: Annotated[
        int, typer.Option("--execs", min=1, max=100_000, help='run_shell("true") calls timed')
    ] = 100,
) -> None:
    """Create COUNT sandboxes at once (a burst: sandboxes/s), run a command in each,
    clean up; then time sequential creates, exec and the host's raw crun on the same
    layer, side by side; then one microVM where the platform runs them."""
    try:
        parse_image_ref(image)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--image") from None
    g = globals_of(ctx)
    if data_dir is None and not temp_data:
        data_dir = DEFAULT_DATA_DIR
    with ended_like_ctrl_c(), platform_for_demo(g.url, g.api_key, data_dir, keep_platform) as plat:
        url, key = plat.url, plat.api_key
        timings = Timings()
        try:
            ok = asyncio.run(run_demo(url, key, count, image, timeout, timings))
            if creates:
                ok = asyncio.run(run_timings(plat, timings, creates=creates, execs=execs)) and ok
            elif timings.burst_rate is not None:
                show_timings(timings)
            if microvm:
                ok = asyncio.run(run_microvm_demo(url, key, "busybox:latest", timeout)) and ok
        except DSecError as exc:
            print_error(exc)
            ok = False
    raise typer.Exit(0 if ok else 1)
