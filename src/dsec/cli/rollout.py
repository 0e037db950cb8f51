"""`dsec rollout ...`: hosted rollouts (start, follow, cancel, hand-off, model endpoint)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from dsec.api.rollouts import ModelEndpoint, RolloutInfo, RolloutSpec, RolloutState
from dsec.api.spec import DSecContainerRunArgs
from dsec.api.verify import VerifyRequest
from dsec.cli.common import emit, emit_rows, sync_client
from dsec.errors import InvalidArgument

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]

app = typer.Typer(
    help="Rollouts hosted on the platform: the agent loop outlives the trainer.",
    no_args_is_help=True,
)


def _line(r: RolloutInfo) -> str:
    reward = "" if r.reward is None else f" reward={r.reward:g}"
    err = f" ({r.error})" if r.error else ""
    return f"{r.id}  {r.state.value:<17} calls={r.model_calls}{reward}{err}"


@app.command("start")
def start(
    ctx: typer.Context,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="a RolloutSpec as JSON (other options ignored)")
    ] = None,
    job: Annotated[str | None, typer.Option("--job", help="job id")] = None,
    image: Annotated[str | None, typer.Option("--image", help="container image")] = None,
    scaffold: Annotated[str | None, typer.Option("--scaffold", help="shell command")] = None,
    model_url: Annotated[str | None, typer.Option("--model-url", help="OpenAI base URL")] = None,
    model_key: Annotated[str | None, typer.Option("--model-key", envvar="DSEC_MODEL_KEY")] = None,
    model: Annotated[str | None, typer.Option("--model", help="model name to force")] = None,
    file: Annotated[
        list[str] | None, typer.Option("--file", help="PATH_IN_SANDBOX=LOCAL_FILE (repeatable)")
    ] = None,
    reward: Annotated[str | None, typer.Option("--reward", help="grader command")] = None,
    graded: Annotated[list[str] | None, typer.Option("--graded", help="graded path")] = None,
    timeout: Annotated[float, typer.Option(help="rollout timeout, seconds")] = 3600.0,
    max_steps: Annotated[int | None, typer.Option("--max-steps")] = None,
    memory_mb: Annotated[int, typer.Option("--memory-mb")] = 512,
    as_json: JsonOpt = False,
) -> None:
    """Start a rollout: from --spec FILE, or from the options."""
    if spec_file is not None:
        spec = RolloutSpec.model_validate_json(spec_file.read_bytes())
    else:
        if job is None or image is None or scaffold is None:
            raise InvalidArgument("--job, --image and --scaffold are needed (or --spec FILE)")
        files = {}
        for item in file or []:
            path, sep, local = item.partition("=")
            if not sep:
                raise InvalidArgument(f"--file takes PATH=LOCAL_FILE, got {item!r}")
            files[path] = Path(local).read_text()
        spec = RolloutSpec(
            job_id=job,
            sandbox=DSecContainerRunArgs(container_image=image, memory_limit_mb=memory_mb),
            scaffold=scaffold,
            files=files,
            model=None
            if model_url is None
            else ModelEndpoint(base_url=model_url, api_key=model_key, model=model),
            reward=None if reward is None else VerifyRequest(command=reward, graded=graded),
            timeout=timeout,
            max_steps=max_steps,
        )
    with sync_client(ctx) as client:
        info = client.start_rollout(spec)
    emit(info, info.id, as_json)


@app.command("get")
def get(ctx: typer.Context, rollout_id: str, as_json: JsonOpt = False) -> None:
    with sync_client(ctx) as client:
        info = client.get_rollout(rollout_id)
    emit(info, _line(info), as_json)


@app.command("list")
def list_(
    ctx: typer.Context,
    job_id: str,
    state: Annotated[RolloutState | None, typer.Option("--state")] = None,
    as_json: JsonOpt = False,
) -> None:
    with sync_client(ctx) as client:
        items = client.list_rollouts(job_id, state)
    emit_rows(items, _line, as_json)


@app.command("wait")
def wait(
    ctx: typer.Context,
    rollout_id: str,
    timeout: Annotated[float, typer.Option(help="seconds")] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Wait until the rollout finished, failed or was cancelled."""
    with sync_client(ctx, timeout=None) as client:
        info = client.wait_rollout(rollout_id, timeout)
    emit(info, _line(info), as_json)


@app.command("cancel")
def cancel(ctx: typer.Context, rollout_id: str, as_json: JsonOpt = False) -> None:
    with sync_client(ctx) as client:
        info = client.cancel_rollout(rollout_id)
    emit(info, _line(info), as_json)


@app.command("finished")
def finished(
    ctx: typer.Context,
    job_id: str,
    limit: Annotated[int, typer.Option(help="at most this many")] = 100,
) -> None:
    """Ended rollouts not acknowledged yet, with their trajectories (JSON lines)."""
    with sync_client(ctx) as client:
        items = client.finished_rollouts(job_id, limit)
    for r in items:
        sys.stdout.write(json.dumps(r.model_dump(mode="json")) + "\n")


@app.command("ack")
def ack(ctx: typer.Context, job_id: str, ids: list[str], as_json: JsonOpt = False) -> None:
    """Acknowledge rollouts: they are never handed out again."""
    with sync_client(ctx) as client:
        res = client.ack_rollouts(job_id, ids)
    emit(
        res,
        f"acked {len(res.acked)}, already {len(res.already)}, unknown {len(res.unknown)}",
        as_json,
    )


@app.command("set-endpoint")
def set_endpoint(
    ctx: typer.Context,
    job_id: str,
    base_url: str,
    key: Annotated[str | None, typer.Option("--key", envvar="DSEC_MODEL_KEY")] = None,
    model: Annotated[str | None, typer.Option("--model")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Point the job's rollouts (held calls too) at a model endpoint."""
    with sync_client(ctx) as client:
        res = client.set_model_endpoint(
            job_id, ModelEndpoint(base_url=base_url, api_key=key, model=model)
        )
    emit(res, f"{job_id} -> {res.endpoint.base_url} ({res.rollouts} live rollouts)", as_json)
