"""Plug-ins against the real framework packages from PyPI, on a real platform.

mini-swe-agent: its own ``DefaultAgent`` loop with its ``DeterministicModel`` (a
scripted agent, no LLM) and our environment loaded by import path, as a config does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from dsec.integrations.minisweagent import DSecEnvironment
from tests.conftest import PlatformProcess

pytestmark = [pytest.mark.root]


@pytest.fixture
def env(platform: PlatformProcess, busybox_image: str) -> Iterator[DSecEnvironment]:
    e = get_environment(
        {
            "environment_class": "dsec.integrations.minisweagent.DSecEnvironment",
            "image": busybox_image,
            "cwd": "/tmp",
            "env": {"TASK": "fizz"},
            "timeout": 5,
            "memory_limit_mb": 128,
            "url": platform.url,
            "api_key": platform.api_key,
        }
    )
    assert isinstance(e, DSecEnvironment)
    try:
        yield e
    finally:
        e.stop()


def test_minisweagent_runs_a_task_in_the_sandbox(env: DSecEnvironment) -> None:
    steps = [
        [{"command": "pwd; echo $TASK > answer.txt; ls /nonexistent"}],
        [{"command": "sleep 30"}],
        [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat /tmp/answer.txt"}],
    ]
    model = DeterministicModel(  # type: ignore[no-untyped-call]
        outputs=[make_output(f"step {i}", a) for i, a in enumerate(steps)]
    )
    agent = DefaultAgent(
        model,
        env,
        system_template="You are scripted.",
        instance_template="{{task}} in {{sandbox_id}}",
        cost_limit=0,
        step_limit=10,
    )
    result = agent.run("write the answer")
    assert result["exit_status"] == "Submitted", result
    assert result["submission"] == "fizz\n"
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    first, second = observations[0], observations[1]
    assert "/tmp" in first and "nonexistent" in first  # stderr merged, as LocalEnvironment
    assert "<returncode>1</returncode>" in first
    assert "timed out" in second and "<returncode>-1</returncode>" in second
    # The work happened in the sandbox, not on the host.
    assert env.sandbox.read_file("/tmp/answer.txt") == b"fizz\n"
    assert env.serialize()["info"]["config"]["sandbox_id"] == env.sandbox.id
    assert "api_key" not in env.serialize()["info"]["config"]["environment"]


def test_stop_is_idempotent_and_ends_the_sandbox(env: DSecEnvironment) -> None:
    env.stop()
    env.stop()
    assert env.sandbox.refresh().state.value == "stopped"
