"""`dsec sandbox batch IMAGE --count N --job J`: many sandboxes for one job, with progress.

The progress bar goes to stderr and the summary to stdout (``--json``: the final counts
and the failures as JSON). Ctrl-C cancels the batch cleanly: nothing new starts, the
creates in flight finish and are counted; a second Ctrl-C stops waiting for them.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from dsec.api.batch import BatchCreated, BatchDone, BatchError, BatchFailed
from dsec.cli.common import err, inert, out, sync_client
from dsec.cli.sandbox import run_args
from dsec.errors import DSecError
from dsec.sdk._batch import SyncBatch
from dsec.sdk.sync import DSecSyncClient

STOP_THREADS = 8


def _follow(batch: SyncBatch, count: int, show: bool) -> bool:
    """Consume the events with a progress bar; True if the user interrupted."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("[green]{task.fields[created]} created[/] [red]{task.fields[failed]} failed[/]"),
        TextColumn("{task.fields[rate]:.1f}/s"),
        TimeElapsedColumn(),
        console=err,
        disable=not show,
        transient=False,
    )
    interrupted = False
    start = time.monotonic()
    with progress:
        task: TaskID = progress.add_task(
            f"batch {batch.id}", total=count, created=0, failed=0, rate=0.0
        )
        events = iter(batch)
        while True:
            try:
                event = next(events)
            except StopIteration:
                break
            except KeyboardInterrupt:
                if interrupted:  # second Ctrl-C: stop waiting (the server cancels the rest)
                    batch.close()
                    raise
                interrupted = True
                progress.update(task, description=f"cancelling {batch.id}")
                try:
                    batch.cancel()
                except DSecError as exc:
                    err.print(f"cancel failed: {inert(exc)}", style="red", markup=False)
                continue
            if isinstance(event, BatchCreated | BatchFailed):
                created, failed = len(batch.created), len(batch.failures)
                rate = created / max(time.monotonic() - start, 1e-6)
                progress.update(
                    task, completed=created + failed, created=created, failed=failed, rate=rate
                )
    return interrupted


def _stop_all(client: DSecSyncClient, ids: list[str]) -> int:
    def stop(sandbox_id: str) -> bool:
        try:
            client.stop_sandbox(sandbox_id)
            return True
        except DSecError as exc:
            err.print(f"stop {sandbox_id}: {inert(exc)}", style="yellow", markup=False)
            return False

    with ThreadPoolExecutor(STOP_THREADS) as pool:
        return sum(pool.map(stop, ids))


def _summary(done: BatchDone, failures: dict[int, BatchError], stopped: int) -> None:
    rate = done.created / done.duration if done.duration > 0 else 0.0
    out.print(
        f"batch {done.batch_id}: {done.created} created, {done.failed} failed, "
        f"{done.cancelled} cancelled in {done.duration:.1f} s ({rate:.1f} sandboxes/s)"
        + (f"; stopped {stopped}" if stopped else ""),
        markup=False,
        soft_wrap=True,
    )
    if done.reason:
        out.print(f"  {inert(done.reason)}", markup=False, soft_wrap=True)
    groups: dict[str, list[int]] = defaultdict(list)
    for index, error in sorted(failures.items()):
        groups[error.code].append(index)
    for code, indexes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        sample = inert(failures[indexes[0]].message, 512)
        shown = ", ".join(map(str, indexes[:20])) + (" ..." if len(indexes) > 20 else "")
        out.print(
            f"  {code}: {len(indexes)} (indexes {shown}): {sample}", markup=False, soft_wrap=True
        )


def batch(
    ctx: typer.Context,
    image: Annotated[str, typer.Argument(help="image reference name[:tag]")],
    count: Annotated[int, typer.Option("--count", "-n", help="sandboxes to create")],
    job: Annotated[str, typer.Option("--job", "-j", help="RL job the sandboxes serve")],
    parallelism: Annotated[
        int | None, typer.Option("--parallelism", "-p", help="creates in flight")
    ] = None,
    stop_after: Annotated[
        bool, typer.Option("--stop-after", help="stop the created sandboxes at the end")
    ] = False,
    memory: Annotated[int | None, typer.Option("--memory", help="memory limit, MiB")] = None,
    cpus: Annotated[float | None, typer.Option("--cpus", help="CPU limit, cores")] = None,
    ttl: Annotated[
        int | None, typer.Option("--ttl", help="idle seconds before auto-stop; 0 = never")
    ] = None,
    label: Annotated[list[str], typer.Option("--label", "-l", help="KEY=VALUE, repeatable")] = [],  # noqa: B006
    env: Annotated[list[str], typer.Option("--env", "-e", help="KEY=VALUE, repeatable")] = [],  # noqa: B006
    timeout: Annotated[float, typer.Option("--timeout", help="seconds per create")] = 120,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable summary")] = False,
) -> None:
    """Create COUNT sandboxes of IMAGE for JOB with a progress bar; Ctrl-C cancels.

    Exit status: 0 if all were created, 1 if any failed, 130 if cancelled."""
    spec = run_args(image, memory, cpus, ttl, label, env)
    with sync_client(ctx, timeout=60.0) as client:
        with client.create_batch(
            spec, count=count, job=job, parallelism=parallelism, timeout=timeout
        ) as handle:
            interrupted = _follow(handle, count, show=not as_json)
            done = handle.done
            if done is None:
                done = handle.wait()
            failures = dict(handle.failures)
            ids = [info.id for info in handle.created.values()]
        stopped = _stop_all(client, ids) if stop_after else 0
    if as_json:
        sys.stdout.write(
            json.dumps(
                {
                    **done.model_dump(mode="json"),
                    "stopped": stopped,
                    "sandboxes": {str(i): s for i, s in zip(handle.created, ids, strict=True)},
                    "failures": {str(i): e.model_dump(mode="json") for i, e in failures.items()},
                },
                indent=2,
            )
            + "\n"
        )
    else:
        _summary(done, failures, stopped)
    if interrupted:
        raise typer.Exit(130)
    if done.failed or done.cancelled:
        raise typer.Exit(1)
