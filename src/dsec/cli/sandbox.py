"""`dsec sandbox ...`: create, exec, ls, rm."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.table import Table

from dsec.api.sandbox import SandboxState
from dsec.api.spec import BackendKind, RunArgs, run_args_adapter
from dsec.cli import shell as shell_cmd
from dsec.cli.common import (
    cells,
    emit,
    emit_json,
    err,
    inert,
    out,
    parse_pairs,
    print_error,
    sync_client,
    usage_from,
)
from dsec.errors import DSecError

app = typer.Typer(help="Create, use and remove sandboxes.", no_args_is_help=True)
app.command("shell")(shell_cmd.shell)

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
AllowOpt = Annotated[
    list[str],
    typer.Option("--allow", help="egress rule to allow: service (pypi) or IPv4[:ports]; repeat"),
]
DenyOpt = Annotated[
    list[str], typer.Option("--deny", help="egress rule set to false (same as leaving it out)")
]


def run_args(
    image: str,
    memory: int | None,
    cpus: float | None,
    ttl: int | None,
    label: list[str],
    env: list[str],
    *,
    backend: BackendKind = BackendKind.CONTAINER,
    **extra: object,
) -> RunArgs:
    """A run spec of ``backend`` from the options `sandbox create` and `sandbox batch`
    share (a spec the model refuses is a usage error, exit 2)."""
    image_field = {BackendKind.CONTAINER: "container_image", BackendKind.FULLVM: "vm_image"}.get(
        backend, "image"
    )
    fields: dict[str, object] = {"backend": backend.value, image_field: image, **extra}
    if memory is not None:
        fields["memory_limit_mb"] = memory
    if cpus is not None:
        fields["cpu_cores_limit"] = cpus
    if ttl is not None:
        fields["ttl_running_stop"] = ttl or None
    if label:
        fields["labels"] = parse_pairs(label, "--label")
    if env:
        fields["env"] = parse_pairs(env, "--env")
    try:
        return run_args_adapter.validate_python(fields)
    except ValidationError as exc:
        raise usage_from(exc) from None


class SandboxBackend(StrEnum):
    """The backends a sandbox can be created on from the command line."""

    CONTAINER = BackendKind.CONTAINER.value
    MICROVM = BackendKind.MICROVM.value
    FULLVM = BackendKind.FULLVM.value


def network_rules(allow: list[str], deny: list[str]) -> dict[str, bool]:
    return {**{name: False for name in deny}, **{name: True for name in allow}}


@app.command()
def create(
    ctx: typer.Context,
    image: Annotated[str, typer.Option("--image", "-i", help="image reference name[:tag]")],
    memory: Annotated[int | None, typer.Option("--memory", help="memory limit, MiB")] = None,
    cpus: Annotated[float | None, typer.Option("--cpus", help="CPU limit, cores")] = None,
    disk: Annotated[
        int | None, typer.Option("--disk", help="writable disk limit, MiB (default 10 GiB)")
    ] = None,
    ttl: Annotated[
        int | None, typer.Option("--ttl", help="idle seconds before auto-stop; 0 = never")
    ] = None,
    label: Annotated[list[str], typer.Option("--label", "-l", help="KEY=VALUE, repeatable")] = [],  # noqa: B006
    env: Annotated[list[str], typer.Option("--env", "-e", help="KEY=VALUE, repeatable")] = [],  # noqa: B006
    user: Annotated[str | None, typer.Option("--user", "-u", help="user or uid[:gid]")] = None,
    workdir: Annotated[str | None, typer.Option("--workdir", "-w")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait")] = 120,
    qos: Annotated[
        str | None,
        typer.Option(
            "--qos", help="CPU class: latency (default) or best_effort (SCHED_IDLE, low weight)"
        ),
    ] = None,
    allow: AllowOpt = [],  # noqa: B006
    deny: DenyOpt = [],  # noqa: B006
    protect: Annotated[
        list[str],
        typer.Option(
            "--protect", help="PATH=LAYER: only `dsec sandbox verify` sees it; repeatable"
        ),
    ] = [],  # noqa: B006
    backend: Annotated[
        SandboxBackend,
        typer.Option(
            "--backend",
            "-b",
            help="what runs it: a container, a QEMU microVM or a full VM (--image: a VM image)",
        ),
    ] = SandboxBackend.CONTAINER,
    as_json: JsonOpt = False,
) -> None:
    """Create a sandbox (a container unless --backend says otherwise) and print its id."""
    extra: dict[str, object] = {}
    if allow or deny:
        extra["network_rules"] = network_rules(allow, deny)
    if disk is not None:
        extra["disk_limit_mb"] = disk
    if user is not None:
        extra["init_user"] = user
    if workdir is not None:
        extra["workdir"] = workdir
    if qos is not None:
        extra["qos"] = qos
    if protect:
        pairs = parse_pairs(protect, "--protect")
        extra["protected"] = [{"path": p, "layer": layer} for p, layer in pairs.items()]
    kind = BackendKind(backend.value)
    args = run_args(image, memory, cpus, ttl, label, env, backend=kind, **extra)
    with sync_client(ctx) as client:
        sandbox = client.run_sandbox(args, timeout=timeout)
    emit(sandbox.info, sandbox.id, as_json)


@app.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
)
def exec_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    command: Annotated[list[str], typer.Argument(metavar="CMD...", help="argv to run")],
    timeout: Annotated[
        float | None, typer.Option("--timeout", "-t", help="kill the command after S seconds")
    ] = None,
    env: Annotated[list[str], typer.Option("--env", "-e", help="KEY=VALUE, repeatable")] = [],  # noqa: B006
    workdir: Annotated[str | None, typer.Option("--workdir", "-w")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u")] = None,
    shell: Annotated[
        bool, typer.Option("--shell", "-s", help="join CMD and run it with /bin/sh -c")
    ] = False,
    stdin: Annotated[
        bool, typer.Option("--stdin", "-i", help="feed this terminal's stdin to the command")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a command; its stdout/stderr pass through and its exit code is dsec's.

    Options go before ID; everything after ID (or after --) is the command.
    """
    if command and command[0] == "--":
        command = command[1:]  # with options ending at ID, click keeps a later "--"
    if not command:
        raise typer.BadParameter("no command given", param_hint="CMD...")
    data = sys.stdin.read() if stdin else None
    env_vars = parse_pairs(env, "--env")
    with sync_client(ctx) as client:
        sandbox = client.get(sandbox_id)
        if shell:
            result = sandbox.run_shell(
                " ".join(command),
                timeout=timeout,
                env=env_vars,
                workdir=workdir,
                user=user,
                stdin=data,
            )
        else:
            result = sandbox.exec(
                command, timeout=timeout, env=env_vars, workdir=workdir, user=user, stdin=data
            )
    if as_json:
        emit_json(result)
    else:
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.write(result.stderr)
        sys.stderr.flush()
        if result.timed_out:
            err.print(f"dsec: command timed out after {timeout} s", style="yellow", markup=False)
        if result.truncated:
            err.print("dsec: output was truncated", style="yellow", markup=False)
    raise typer.Exit(result.exit_code)


@app.command("verify", context_settings={"allow_interspersed_args": False})
def verify(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    command: Annotated[list[str], typer.Argument(metavar="CMD...", help="argv to run")],
    timeout: Annotated[
        float | None, typer.Option("--timeout", "-t", help="kill the command after S seconds")
    ] = None,
    env: Annotated[list[str], typer.Option("--env", "-e", help="KEY=VALUE, repeatable")] = [],  # noqa: B006
    workdir: Annotated[str | None, typer.Option("--workdir", "-w")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="default root")] = None,
    shell: Annotated[
        bool, typer.Option("--shell", "-s", help="join CMD and run it with /bin/sh -c")
    ] = False,
    graded: Annotated[
        list[str],
        typer.Option("--graded", "-g", help="agent path the grader sees (read-only); repeatable"),
    ] = [],  # noqa: B006
    isolated: Annotated[
        bool,
        typer.Option(
            "--isolated", help="freeze the sandbox and let it go on (default: stop it first)"
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a grader in a pristine verifier that sees the protected paths and read-only
    snapshots of the graded ones; the sandbox is stopped first unless --isolated.
    Output passes through and the grader's exit code is dsec's."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise typer.BadParameter("no command given", param_hint="CMD...")
    with sync_client(ctx) as client:
        result = client.get(sandbox_id).verify(
            " ".join(command) if shell else command,
            graded=graded or None,
            mode="isolated" if isolated else "fresh",
            timeout=timeout,
            env=parse_pairs(env, "--env"),
            workdir=workdir,
            user=user,
        )
    if as_json:
        emit_json(result)
    else:
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.write(result.stderr)
        sys.stderr.flush()
        if result.timed_out:
            err.print("dsec: verify command timed out", style="yellow", markup=False)
        for refusal in result.refused:
            err.print(
                f"dsec: left out of the snapshot: {refusal.path!r}: {refusal.reason}",
                style="yellow",
                markup=False,
            )
        if result.error:
            err.print(f"dsec: the grader did not run: {result.error}", style="red", markup=False)
    raise typer.Exit(result.exit_code)


@app.command("network")
def network(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    allow: AllowOpt = [],  # noqa: B006
    deny: DenyOpt = [],  # noqa: B006
    as_json: JsonOpt = False,
) -> None:
    """REPLACE a running sandbox's egress rules (no merge: what is not allowed here is
    denied from now on; no --allow at all denies everything). New connections follow at
    once. The sandbox must have been created with --allow or --deny."""
    with sync_client(ctx) as client:
        rules = client.get(sandbox_id).update_network(network_rules(allow, deny))
    if as_json:
        sys.stdout.write(json.dumps({"network_rules": rules}, indent=2) + "\n")
    else:
        allowed = sorted(k for k, v in rules.items() if v)
        out.print("allowed: " + (inert(", ".join(allowed)) if allowed else "nothing"))


@app.command("snapshot")
def snapshot(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    ref: Annotated[str, typer.Argument(metavar="NAME:TAG", help="the new VM image's name")],
    as_json: JsonOpt = False,
) -> None:
    """Save a running full VM (memory and disk, frozen across both) as a VM image that
    `dsec sandbox create --backend fullvm --image NAME:TAG` starts without booting. The
    VM runs on; an existing NAME:TAG is refused (remove it first)."""
    with sync_client(ctx) as client, err.status(f"saving {sandbox_id} as {ref} ..."):
        info = client.get(sandbox_id).snapshot(ref)
    emit(info, f"saved {sandbox_id} as {info.ref}  {info.digest[:19]}", as_json)


@app.command("ls")
def list_(
    ctx: typer.Context,
    label: Annotated[list[str], typer.Option("--label", "-l", help="KEY=VALUE filter")] = [],  # noqa: B006
    all_: Annotated[bool, typer.Option("--all", "-a", help="include stopped and failed")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List live sandboxes (all of them with --all)."""
    states = list(SandboxState) if all_ else None
    with sync_client(ctx) as client:
        sandboxes = client.list_sandboxes(labels=parse_pairs(label, "--label"), states=states)
    infos = sorted((s.info for s in sandboxes), key=lambda i: i.created_at)
    if as_json:
        emit_json(infos)
        return
    if not infos:
        err.print("no sandboxes" + ("" if all_ else " running (--all shows stopped ones)"))
        return
    table = Table(box=None, header_style="bold")
    for col in ("ID", "STATE", "IMAGE", "CREATED", "LABELS"):
        table.add_column(col)
    for info in infos:
        table.add_row(
            *cells(
                info.id,
                info.state.value,
                info.image,
                info.created_at.astimezone().strftime("%Y-%m-%d %H:%M:%S"),
                ",".join(f"{k}={v}" for k, v in sorted(info.labels.items())),
                limit=512,
            )
        )
    out.print(table)


@app.command("rm")
def remove(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str], typer.Argument(metavar="ID...")],
    as_json: JsonOpt = False,
) -> None:
    """Stop and remove sandboxes; continues past failures, exit 1 if any failed."""
    removed = []
    failed = False
    with sync_client(ctx) as client:
        for sandbox_id in sandbox_ids:
            try:
                removed.append(client.stop_sandbox(sandbox_id))
            except DSecError as exc:
                failed = True
                print_error(exc)
    if as_json:
        emit_json(removed)
    else:
        for info in removed:
            out.print(inert(info.id), markup=False)
    if failed:
        raise typer.Exit(1)
