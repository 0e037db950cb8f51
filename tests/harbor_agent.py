"""A scripted Harbor agent (no LLM) for tests/test_harbor_integration.py.

Harbor loads it by import path (``--agent tests.harbor_agent:ScriptedAgent``) in the
Python 3.12 venv, and it drives the environment only through Harbor's own calls: exec,
upload/download of files, is_file/is_dir. ``--ak answer=right`` computes the answer
from the task's uploaded question, ``--ak answer=wrong`` writes a wrong one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

from dsec.errors import Timeout
from tests.harbor_shell import fetch


class ScriptedAgent(BaseAgent):
    def __init__(self, *args: Any, answer: str = "right", pypi_ip: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer = answer
        self.pypi_ip = pypi_ip

    @staticmethod
    def name() -> str:
        return "dsec-scripted"

    def version(self) -> str:
        return "1.0"

    async def setup(self, environment: BaseEnvironment) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            tool = Path(tmp) / "multiply.sh"
            tool.write_text('#!/bin/sh\nset -- $(cat "$1")\nexpr "$1" \\* "$2"\n')
            await environment.upload_file(tool, "/opt/agent/bin/multiply.sh")
        await _check(environment, "chmod +x /opt/agent/bin/multiply.sh")

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        # The task's environment/ directory was uploaded into the workdir at start.
        if not await environment.is_file("/srv/task/question.txt"):
            raise AssertionError("the environment dir was not uploaded")
        if not await environment.is_dir("/opt/agent/bin") or await environment.is_dir(
            "/srv/task/question.txt"
        ):
            raise AssertionError("is_dir is wrong")
        # The agent phase's allowlist: pypi.org (a host_services entry) and an IPv4
        # address (a raw rule) are reachable.
        for host in (self.pypi_ip, "pypi.org"):  # the IP first: a DNS answer opens it too
            net = await environment.exec(fetch(host), timeout_sec=20)
            if net.return_code != 0:
                raise AssertionError(f"{host} not reachable in the agent phase: {net}")
        if self.answer == "right":
            command = "/opt/agent/bin/multiply.sh question.txt > answer.txt"
        else:
            command = "echo 41 > answer.txt"
        await _check(environment, command)
        await _check(environment, "echo 'stderr line' >&2; echo done", want_stderr=True)
        probe = await environment.exec(
            'pwd; echo "$PROBE"; id -u', cwd="/opt", env={"PROBE": "p 1"}, user="65534"
        )
        if (probe.stdout or "").split("\n")[:3] != ["/opt", "p 1", "65534"]:
            raise AssertionError(f"cwd/env/user not applied: {probe}")
        seen: list[tuple[str, str]] = []

        async def collect(text: str, stream: str) -> None:
            seen.append((stream, text))

        with environment.scoped_output_callback(collect):  # Harbor's streaming hook
            await _check(environment, "echo out; echo err >&2; printf '\\303'; printf '\\251'")
        streams = {stream: "".join(t for s, t in seen if s == stream) for stream, _ in seen}
        if streams != {"stdout": "out\né", "stderr": "err\n"}:
            raise AssertionError(f"output callbacks got {seen}")
        try:
            await environment.exec("sleep 30", timeout_sec=1)
        except Timeout:
            pass
        else:
            raise AssertionError("a command past its timeout_sec did not raise")
        with tempfile.TemporaryDirectory() as tmp:
            await environment.download_file("/srv/task/answer.txt", Path(tmp) / "a" / "answer")
            written = (Path(tmp) / "a" / "answer").read_text().strip()
        (self.logs_dir / "answer.txt").write_text(written)
        # Left for Harbor to download from /logs/agent after the run (download_dir).
        await _check(
            environment, f"mkdir -p /logs/agent/deep && echo {written} > /logs/agent/deep/seen"
        )
        context.metadata = {"answer": written}


async def _check(environment: BaseEnvironment, command: str, *, want_stderr: bool = False) -> None:
    result = await environment.exec(command)
    if result.return_code != 0:
        raise AssertionError(f"{command!r} failed: {result}")
    if want_stderr and (result.stderr or "").strip() != "stderr line":
        raise AssertionError(f"stderr not kept apart: {result}")
