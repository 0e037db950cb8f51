"""Hosted rollouts (DSEC.md §6.2, §6.3) end to end on a real `dsec up`.

A scripted OpenAI-compatible server on loopback plays the trainer; each rollout's
scaffold is a busybox shell loop in a real crun sandbox that calls the model gateway
with wget and appends one line per finished step to a file (the side effect that proves
no command ran twice). The trainer is killed mid-rollout, the edge is SIGKILLed and
restarted while the rollouts are paused, the trainer comes back on another port, and
every rollout finishes with each model call recorded once.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

import pytest

from dsec import (
    DSecContainerRunArgs,
    DSecSyncClient,
    ModelEndpoint,
    RolloutSpec,
    RolloutState,
    VerifyRequest,
)
from tests.conftest import PlatformProcess, platform_process
from tests.scripted_trainer import ScriptedTrainer

pytestmark = pytest.mark.root

STEPS = 5

CALL = (
    'wget -q -O - --header "Authorization: Bearer ${KEY:-$OPENAI_API_KEY}" '
    "--header 'Content-Type: application/json' "
    '--post-data "{\\"model\\":\\"x\\",\\"messages\\":[{\\"role\\":\\"user\\",'
    '\\"content\\":\\"$DSEC_ROLLOUT_ID step $i\\"}]}" "$OPENAI_BASE_URL/chat/completions"'
)

SCAFFOLD = f"""mkdir -p /work
i=0
while [ $i -lt {STEPS} ]; do
  until out=$({CALL} 2>/dev/null); do sleep 0.3; done
  echo "$i" >> /work/steps
  i=$((i+1))
  sleep 0.3
done
"""

GRADER = VerifyRequest(
    command=f"test $(wc -l < /work/steps) -eq {STEPS} && "
    f"test $(sort -u /work/steps | wc -l) -eq {STEPS}",
    graded=["/work"],
)


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process() as p:
        with DSecSyncClient(p.url, p.api_key) as client:
            client.build_image("busybox")
        yield p


def spec(job: str, **kw: object) -> RolloutSpec:
    base: dict[str, object] = {
        "job_id": job,
        "sandbox": DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64),
        "scaffold": SCAFFOLD,
        "timeout": 240.0,
        "reward": GRADER,
        "pause_after": 1.0,
        "files": {"/tmp/task.txt": "count to five"},
    }
    base.update(kw)
    return RolloutSpec.model_validate(base)


def wait_for(what: str, cond: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_rollouts_outlive_trainer_and_edge(plat: PlatformProcess) -> None:
    job = "job-preempt"
    first = ScriptedTrainer(api_key="sk-real-secret").start()
    second: ScriptedTrainer | None = None
    try:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            ep = ModelEndpoint(base_url=first.url, api_key="sk-real-secret", model="policy-v1")
            ros = [client.start_rollout(spec(job, model=ep)) for _ in range(3)]
            ids = [r.id for r in ros]
            # Mid-rollout: every rollout has had some calls answered.
            wait_for(
                "two model calls each",
                lambda: all(client.get_rollout(i).model_calls >= 2 for i in ids),
            )
            first.stop()  # the trainer is preempted
            wait_for(
                "every rollout paused",
                lambda: all(client.get_rollout(i).state is RolloutState.PAUSED for i in ids),
            )
            for i in ids:
                sb = client.get_rollout(i).sandbox_id
                assert sb is not None
                assert client.get(sb).info.state.value == "paused"  # frozen, reclaimed
            assert {r.state for r in client.list_rollouts(job)} == {RolloutState.PAUSED}
        plat.kill()  # the edge dies too, with the rollouts paused
        plat.start()
        with DSecSyncClient(plat.url, plat.api_key) as client:
            assert {r.state for r in client.list_rollouts(job)} == {RolloutState.PAUSED}
            second = ScriptedTrainer(api_key="sk-new-secret").start()  # back, elsewhere
            done = client.set_model_endpoint(
                job, ModelEndpoint(base_url=second.url, api_key="sk-new-secret")
            )
            assert done.rollouts == 3 and done.endpoint.base_url == second.url
            finals = [client.wait_rollout(i, timeout=120) for i in ids]
            for f in finals:
                assert f.state is RolloutState.FINISHED, f
                assert f.reward == 1.0 and f.verdict is not None and f.verdict.passed
                assert f.model_calls == STEPS
                assert f.model_retries >= 1
            # Every step reached a model exactly once, across both trainers.
            seen = collections.Counter(first.prompts() + second.prompts())
            for i in ids:
                for n in range(STEPS):
                    assert seen[f"{i} step {n}"] == 1, (i, n, seen)
            assert set(first.auth_seen) == {"Bearer sk-real-secret"}
            assert set(second.auth_seen) == {"Bearer sk-new-secret"}

            # The hand-off: listed until acknowledged, never after.
            results = client.finished_rollouts(job)
            assert sorted(r.rollout.id for r in results) == sorted(ids)
            one = results[0]
            calls = [s for s in one.steps if s.op == "model_call"]
            assert len(calls) == STEPS and all(s.status == "ok" for s in calls)
            assert [s.op for s in one.steps[:1]] == ["write_file"]
            assert calls[0].result is not None
            assert calls[0].result["token_ids"] and calls[0].result["logprobs"]
            assert calls[0].request["body"]["model"] == "x"  # as the scaffold sent it
            ack = client.ack_rollouts(job, ids[:2])
            assert sorted(ack.acked) == sorted(ids[:2])
            assert [r.rollout.id for r in client.finished_rollouts(job)] == [ids[2]]
            again = client.ack_rollouts(job, [*ids[:2], ids[2], "ro-nope"])
            assert sorted(again.already) == sorted(ids[:2])
            assert again.acked == [ids[2]] and again.unknown == ["ro-nope"]
            assert client.finished_rollouts(job) == []
            # The agent sandboxes are stopped with their rollouts.
            for f in finals:
                assert f.sandbox_id is not None
                assert client.get(f.sandbox_id).info.state.value == "stopped"
    finally:
        first.stop()
        if second is not None:
            second.stop()
