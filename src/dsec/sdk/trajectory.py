"""Trajectories in the SDK: logged, replayable steps of an RL rollout.

::

    traj = client.trajectory("job-42", "rollout-7")
    await traj.write_file(sb, "/work/task.py", source)
    res = await traj.run_shell(sb, "python /work/task.py")   # step 1

A trainer that was preempted resumes by running the same code again with a fresh
``Trajectory`` (steps count from 0): the platform answers every step it already logged
from the log without touching the sandbox, until the first step that differs, which runs
for real. ``run_many`` sends many commands in one request (how thousands of logged steps
are fast-forwarded at >10k steps/s). All steps go through the platform's one trajectory
endpoint, where the replay decision is made; nothing is decided client-side.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import quote

import httpx

from dsec.api.trajectory import StepAnswer, StepRecord, TrajectoryInfo, check_name
from dsec.errors import error_class_for
from dsec.sdk._protocol import Call, _list_of, _model, wait_timeout
from dsec.sdk.datapath import CommandResult, command_args

if TYPE_CHECKING:
    from dsec.sdk._portal import Portal
    from dsec.sdk.client import DSecClient, Sandbox
    from dsec.sdk.datapath import Session

T = TypeVar("T")

#: Steps per request of ``run_many`` (the server takes at most 5000).
BATCH = 2000
_JSON = {"Content-Type": "application/json"}


class _AsyncSender(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


def _path(job: str, rollout: str | None = None) -> str:
    out = "/v1/trajectories/" + quote(check_name(job, "job id"), safe="")
    if rollout is not None:
        out += "/" + quote(check_name(rollout, "rollout id"), safe="")
    return out


def _answers(resp: httpx.Response) -> list[StepAnswer]:
    return [StepAnswer.model_validate(a) for a in json.loads(resp.content)["results"]]


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


def _sandbox_id(sb: _HasId | str) -> str:
    return sb if isinstance(sb, str) else sb.id


def _command_result(answer: StepAnswer) -> CommandResult:
    res = dict(answer.result or {})
    out, err = res.get("stdout", ""), res.get("stderr", "")
    return CommandResult(**res, stdout_bytes=out.encode(), stderr_bytes=err.encode())


class Trajectory:
    """One rollout's steps. ``step`` is the number the next step gets; ``replayed`` and
    ``executed`` count how this object's steps were answered."""

    def __init__(self, client: DSecClient, job_id: str, rollout_id: str, *, start_step: int = 0):
        self._client = client
        self.job_id = check_name(job_id, "job id")
        self.rollout_id = check_name(rollout_id, "rollout id")
        self.step = start_step
        self.replayed = 0
        self.executed = 0
        self.last_replayed = False

    def __repr__(self) -> str:
        return f"Trajectory({self.job_id!r}, {self.rollout_id!r}, step={self.step})"

    # -- steps ----------------------------------------------------------------------------
    async def send(
        self, steps: Sequence[Mapping[str, Any]], *, timeout: float | None = None
    ) -> list[StepAnswer]:
        """Send step bodies (``{"sandbox_id", "command"|"file"}``) numbered from
        ``self.step``; returns every answer, raising the typed error of a failed step
        after counting it (its step number is used up: it is logged)."""
        out: list[StepAnswer] = []
        for i in range(0, len(steps), BATCH):
            chunk = [{**s, "step": self.step + j} for j, s in enumerate(steps[i : i + BATCH])]
            call = Call(
                "POST",
                _path(self.job_id, self.rollout_id) + "/steps",
                _answers,
                content=json.dumps({"steps": chunk}).encode(),
                headers=_JSON,
                timeout=wait_timeout(timeout),
            )
            answers = await self._client._send(call)
            for a in answers:
                self.step = a.step + 1
                self.last_replayed = a.replayed
                if a.replayed:
                    self.replayed += 1
                else:
                    self.executed += 1
                if a.error is not None:
                    err = error_class_for(str(a.error.get("code", "")))(
                        str(a.error.get("message", ""))
                    )
                    err.details = {**dict(a.error.get("details") or {}), "step": a.step}
                    raise err
                out.append(a)
        return out

    async def run_shell(
        self,
        sb: Sandbox | str,
        command: str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
    ) -> CommandResult:
        """``sb.run_shell`` as the next step of this trajectory (logged or replayed)."""
        args = command_args(
            command,
            timeout=timeout,
            env=env,
            workdir=workdir,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
        )
        return await self._command(sb, args, timeout)

    async def exec(
        self,
        sb: Sandbox | str,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        max_output_bytes: int | None = None,
    ) -> CommandResult:
        """``sb.exec`` (an argv, no shell) as the next step."""
        args = command_args(
            list(argv),
            timeout=timeout,
            env=env,
            workdir=workdir,
            user=user,
            stdin=stdin,
            max_output_bytes=max_output_bytes,
        )
        return await self._command(sb, args, timeout)

    async def _command(
        self, sb: _HasId | str, args: dict[str, Any], timeout: float | None
    ) -> CommandResult:
        (answer,) = await self.send(
            [{"sandbox_id": _sandbox_id(sb), "command": args}], timeout=timeout
        )
        return _command_result(answer)

    async def session_run(
        self, session: Session, command: str, *, timeout: float | None = None
    ) -> CommandResult:
        """Input to a shell session (``session.run``) as the next step."""
        args = command_args(command, session=session.id, timeout=timeout)
        (answer,) = await self.send(
            [{"sandbox_id": session.info.sandbox_id, "command": args}], timeout=timeout
        )
        return _command_result(answer)

    async def write_file(
        self, sb: Sandbox | str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        """``sb.write_file`` as the next step (the log keeps the content's sha256)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        file = {"path": path, "content_b64": base64.b64encode(raw).decode(), "mode": mode}
        await self.send([{"sandbox_id": _sandbox_id(sb), "file": file}])

    async def run_many(
        self,
        sb: Sandbox | str,
        commands: Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> list[CommandResult]:
        """Many shell commands as consecutive steps, in as few requests as possible:
        identical in effect to calling ``run_shell`` for each, in order."""
        sid = _sandbox_id(sb)
        steps = [
            {"sandbox_id": sid, "command": command_args(c, timeout=timeout, env=env)}
            for c in commands
        ]
        return [_command_result(a) for a in await self.send(steps)]

    # -- the log --------------------------------------------------------------------------
    async def info(self) -> TrajectoryInfo:
        return await self._client._send(
            Call("GET", _path(self.job_id, self.rollout_id), _model(TrajectoryInfo))
        )

    async def records(self, *, after: int = -1, limit: int = 1000) -> list[StepRecord]:
        return await self._client._send(records_call(self.job_id, self.rollout_id, after, limit))


def records_call(job: str, rollout: str, after: int, limit: int) -> Call[list[StepRecord]]:
    return Call(
        "GET",
        _path(job, rollout) + "/steps",
        _list_of(StepRecord),
        params=[("after", str(after)), ("limit", str(limit))],
    )


def infos_call(job: str, rollout: str | None = None) -> Call[list[TrajectoryInfo]]:
    params = [("rollout_id", rollout)] if rollout is not None else []
    return Call("GET", _path(job), _list_of(TrajectoryInfo), params=params)


def export_call(job: str, rollout: str | None = None) -> Call[str]:
    params = [("format", "jsonl")] + ([("rollout_id", rollout)] if rollout is not None else [])
    return Call("GET", _path(job), lambda r: r.text, params=params, timeout=wait_timeout(None))


def discard_call(job: str, rollout: str, from_step: int) -> Call[int]:
    return Call(
        "DELETE",
        _path(job, rollout),
        lambda r: int(r.json()["discarded"]),
        params=[("from_step", str(from_step))],
    )


class TrajectoryMixin:
    """``DSecClient.trajectory(...)`` and the log queries."""

    def trajectory(self, job_id: str, rollout_id: str, *, start_step: int = 0) -> Trajectory:
        """A handle that numbers steps from ``start_step`` (0: replay from the start)."""
        return Trajectory(self, job_id, rollout_id, start_step=start_step)  # type: ignore[arg-type]

    async def trajectories(self: _AsyncSender, job_id: str) -> list[TrajectoryInfo]:
        return await self._send(infos_call(job_id))

    async def trajectory_steps(
        self: _AsyncSender, job_id: str, rollout_id: str, *, after: int = -1, limit: int = 1000
    ) -> list[StepRecord]:
        return await self._send(records_call(job_id, rollout_id, after, limit))

    async def export_trajectories(
        self: _AsyncSender, job_id: str, rollout_id: str | None = None
    ) -> str:
        """The log as JSONL (one step a line, in order)."""
        return await self._send(export_call(job_id, rollout_id))

    async def discard_trajectory_steps(
        self: _AsyncSender, job_id: str, rollout_id: str, from_step: int
    ) -> int:
        """Drop ``from_step`` and later steps (e.g. one in doubt after a platform crash)."""
        return await self._send(discard_call(job_id, rollout_id, from_step))


class _SyncSender(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class SyncTrajectory:
    """Blocking twin of ``Trajectory``: the same steps, sent through the sync client's
    event-loop portal (one implementation of the replay protocol, not two)."""

    def __init__(self, traj: Trajectory, call: Callable[[Coroutine[Any, Any, Any]], Any]):
        self._traj = traj
        self._call = call

    def __repr__(self) -> str:
        return f"Sync{self._traj!r}"

    @property
    def inner(self) -> Trajectory:
        """The async ``Trajectory`` this one drives (the sync data path hands it to the
        async twin of each call)."""
        return self._traj

    @property
    def step(self) -> int:
        return self._traj.step

    @property
    def replayed(self) -> int:
        return self._traj.replayed

    @property
    def executed(self) -> int:
        return self._traj.executed

    @property
    def last_replayed(self) -> bool:
        return self._traj.last_replayed

    def run_shell(self, sb: _HasId | str, command: str, **kw: Any) -> CommandResult:
        """``sb.run_shell`` as the next step (keywords as for ``Trajectory.run_shell``)."""
        result: CommandResult = self._call(self._traj.run_shell(_sandbox_id(sb), command, **kw))
        return result

    def exec(self, sb: _HasId | str, argv: Sequence[str], **kw: Any) -> CommandResult:
        result: CommandResult = self._call(self._traj.exec(_sandbox_id(sb), argv, **kw))
        return result

    def write_file(
        self, sb: _HasId | str, path: str, data: bytes | str, *, mode: int = 0o644
    ) -> None:
        self._call(self._traj.write_file(_sandbox_id(sb), path, data, mode=mode))

    def run_many(self, sb: _HasId | str, commands: Sequence[str], **kw: Any) -> list[CommandResult]:
        results: list[CommandResult] = self._call(
            self._traj.run_many(_sandbox_id(sb), commands, **kw)
        )
        return results

    def info(self) -> TrajectoryInfo:
        info: TrajectoryInfo = self._call(self._traj.info())
        return info

    def records(self, *, after: int = -1, limit: int = 1000) -> list[StepRecord]:
        records: list[StepRecord] = self._call(self._traj.records(after=after, limit=limit))
        return records


class _SyncClient(Protocol):
    def _portal(self) -> Portal: ...

    def _async_client(self) -> DSecClient: ...


class SyncTrajectoryMixin:
    """``DSecSyncClient.trajectory(...)`` and the log queries."""

    def trajectory(
        self: _SyncClient, job_id: str, rollout_id: str, *, start_step: int = 0
    ) -> SyncTrajectory:
        """A handle that numbers steps from ``start_step`` (0: replay from the start)."""
        traj = Trajectory(self._async_client(), job_id, rollout_id, start_step=start_step)
        return SyncTrajectory(traj, self._portal().call)

    def trajectories(self: _SyncSender, job_id: str) -> list[TrajectoryInfo]:
        return self._send(infos_call(job_id))

    def trajectory_steps(
        self: _SyncSender, job_id: str, rollout_id: str, *, after: int = -1, limit: int = 1000
    ) -> list[StepRecord]:
        return self._send(records_call(job_id, rollout_id, after, limit))

    def export_trajectories(self: _SyncSender, job_id: str, rollout_id: str | None = None) -> str:
        return self._send(export_call(job_id, rollout_id))

    def discard_trajectory_steps(
        self: _SyncSender, job_id: str, rollout_id: str, from_step: int
    ) -> int:
        return self._send(discard_call(job_id, rollout_id, from_step))
