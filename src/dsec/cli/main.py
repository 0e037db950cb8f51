"""The `dsec` command: global options, sub-commands, and the error policy.

Error policy: a typed error prints ``error: <code>: <message>`` on one red line and
exits 1; a usage error exits 2; nothing prints a traceback unless DSEC_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Annotated

import typer

from dsec.cli import batch as batch_cmd
from dsec.cli import cluster as cluster_cmd
from dsec.cli import db as db_cmd
from dsec.cli import demo as demo_cmd
from dsec.cli import events as events_cmd
from dsec.cli import fncall as fncall_cmd
from dsec.cli import iam as iam_cmd
from dsec.cli import image, layer, sandbox, store
from dsec.cli import rl as rl_cmd
from dsec.cli import rollout as rollout_cmd
from dsec.cli import top as top_cmd
from dsec.cli import trajectory as trajectory_cmd
from dsec.cli import up as up_cmd
from dsec.cli.common import Globals, UsageFailure, err, print_error
from dsec.errors import DSecError, PermissionDenied

app = typer.Typer(
    name="dsec",
    help="DSec: elastic, isolated, stateful sandboxes for agentic RL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
sandbox.app.command("batch")(batch_cmd.batch)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(image.app, name="image")
app.add_typer(layer.app, name="layer")
app.add_typer(store.app, name="store")
app.add_typer(rl_cmd.job_app, name="job")
app.add_typer(rl_cmd.env_app, name="env")
app.add_typer(rl_cmd.role_app, name="role")
app.add_typer(rollout_cmd.app, name="rollout")
app.add_typer(iam_cmd.project_app, name="project")
app.add_typer(iam_cmd.principal_app, name="principal")
app.add_typer(iam_cmd.key_app, name="key")
app.add_typer(iam_cmd.quota_app, name="quota")
app.add_typer(trajectory_cmd.app, name="trajectory")
app.add_typer(db_cmd.app, name="db")
app.add_typer(cluster_cmd.app, name="cluster")
app.command("apiserver")(cluster_cmd.apiserver)
app.command("watcher")(cluster_cmd.watcher)
app.command("edge")(cluster_cmd.edge)
app.command("up")(up_cmd.up)
app.command("down")(up_cmd.down)
app.command("demo")(demo_cmd.demo)
app.command("events")(events_cmd.events)
app.command("audit")(events_cmd.audit)
app.command("top")(top_cmd.top)
app.command("run-code")(fncall_cmd.run_code)
app.command("judge")(fncall_cmd.judge)


def _version(value: bool) -> None:
    if value:
        from dsec import __version__

        typer.echo(f"dsec {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option("--url", help="platform URL (else DSEC_URL, then saved config)")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="API key (else DSEC_API_KEY, then saved)")
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print version")
    ] = False,
) -> None:
    ctx.obj = Globals(url=url, api_key=api_key)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (the testable core of ``main``)."""
    command = typer.main.get_command(app)
    try:
        rv = command.main(
            args=list(argv) if argv is not None else None,
            prog_name="dsec",
            standalone_mode=False,
        )
    except typer.Abort:
        err.print("aborted", style="red")
        return 130
    except typer.TyperException as exc:  # usage errors (exit 2) and friends, shown by typer
        show = getattr(exc, "show", None)
        if callable(show):
            show(file=sys.stderr)
        else:
            err.print(f"error: {exc.format_message()}", style="red", markup=False)
        return exc.exit_code
    except UsageFailure as exc:
        print_error(exc.error)
        return 2
    except DSecError as exc:
        print_error(exc)
        return 1
    except PermissionError as exc:
        print_error(PermissionDenied(str(exc)))
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("DSEC_DEBUG"):
            raise
        print_error(DSecError(f"{type(exc).__name__}: {exc} (DSEC_DEBUG=1 shows a traceback)"))
        return 1
    return rv if isinstance(rv, int) else 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
