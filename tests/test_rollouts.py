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
import functools
import secrets
import time
from collections.abc import Callable, Iterator

import pytest

from dsec import (
    AlreadyExists,
    DSecContainerRunArgs,
    DSecSyncClient,
    InvalidArgument,
    ModelEndpoint,
    RolloutSpec,
    RolloutState,
    VerifyRequest,
)
from tests.conftest import PlatformProcess, platform_process
from tests.scripted_trainer import ScriptedTrainer
from tests.waiting import until

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


# A rollout moves at the pace of its scaffold and model calls: a minute, polled lightly.
wait_for = functools.partial(until, timeout=60.0, interval=0.2)


def test_rollouts_outlive_trainer_and_edge(plat: PlatformProcess) -> None:
    job = "job-preempt"
    # Answers each rollout's first call and holds its second: at the kill every rollout
    # has a call in flight, dropped unanswered.
    first = ScriptedTrainer(api_key="sk-real-secret", hold_after_first=True).start()
    second: ScriptedTrainer | None = None
    try:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            ep = ModelEndpoint(base_url=first.url, api_key="sk-real-secret", model="policy-v1")
            ros = [client.start_rollout(spec(job, model=ep)) for _ in range(3)]
            ids = [r.id for r in ros]
            # Mid-rollout: every rollout had a call answered and has the next in flight.
            wait_for(
                "a model call each, the next in flight",
                lambda: (
                    all(client.get_rollout(i).model_calls >= 1 for i in ids)
                    and len(first.prompts()) >= 2 * len(ids)
                ),
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
            # Every step was answered by a model exactly once, across both trainers
            # (the calls the dying trainer dropped were sent again, answered once).
            seen = collections.Counter(first.answered + second.answered)
            for i in ids:
                for n in range(STEPS):
                    assert seen[f"{i} step {n}"] == 1, (i, n, seen)
            assert sorted(set(first.prompts()) - set(first.answered)) == sorted(
                f"{i} step 1" for i in ids
            )
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


def test_held_call_goes_through_when_the_trainer_moves(plat: PlatformProcess) -> None:
    """No edge restart: the held call itself is answered by the trainer that came back
    (streamed), one model_call step with its failed attempts listed."""
    job = "job-held"
    first = ScriptedTrainer().start()
    second: ScriptedTrainer | None = None
    streamed = SCAFFOLD.replace('\\"model\\":\\"x\\"', '\\"model\\":\\"x\\",\\"stream\\":true')
    try:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            ro = client.start_rollout(
                spec(job, model=ModelEndpoint(base_url=first.url), scaffold=streamed)
            )
            wait_for("a call", lambda: client.get_rollout(ro.id).model_calls >= 1)
            first.stop()
            wait_for("paused", lambda: client.get_rollout(ro.id).state is RolloutState.PAUSED)
            second = ScriptedTrainer().start()
            client.set_model_endpoint(job, ModelEndpoint(base_url=second.url))
            final = client.wait_rollout(ro.id, timeout=120)
            assert final.state is RolloutState.FINISHED and final.reward == 1.0, final
            (res,) = client.finished_rollouts(job)
            calls = [s for s in res.steps if s.op == "model_call"]
            assert len(calls) == STEPS
            held = [s for s in calls if s.result and s.result["attempts"] > 1]
            assert len(held) == 1 and held[0].result is not None
            assert held[0].result["retries"] and held[0].result["stream"] is True
            answer = held[0].result["response"]["choices"][0]
            assert answer["text"].startswith("ok: ") and answer["token_ids"]
            assert held[0].result["logprobs"]
            seen = collections.Counter(first.prompts() + second.prompts())
            assert all(seen[f"{ro.id} step {n}"] == 1 for n in range(STEPS)), seen
            client.ack_rollouts(job, [ro.id])
    finally:
        first.stop()
        if second is not None:
            second.stop()


SPY = 'mkdir -p /work && echo "$OPENAI_API_KEY" > /work/key && env > /work/env && sleep 120'


def test_adversarial_sandboxes(plat: PlatformProcess) -> None:
    """Another rollout's token, the real key, a forged reward, flooding, max_steps."""
    import httpx

    job = "job-adv"
    trainer = ScriptedTrainer(api_key="sk-real-secret", delay=0.5).start()
    try:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            ep = ModelEndpoint(base_url=trainer.url, api_key="sk-real-secret")
            a = client.start_rollout(spec(job, model=ep, scaffold=SPY, reward=None))
            b = client.start_rollout(spec(job, scaffold=SPY, reward=None))
            forged = client.start_rollout(
                spec(
                    job,
                    scaffold="mkdir -p /work && echo 1 > /work/reward && echo PASSED && exit 0",
                    reward=VerifyRequest(command="test -f /work/solved", graded=["/work"]),
                )
            )
            limited = client.start_rollout(
                spec(
                    job,
                    max_steps=2,
                    reward=None,
                    scaffold="mkdir -p /work; for i in 0 1 2; do "
                    + CALL
                    + " >/dev/null 2>>/work/err; echo $? >> /work/rc; done",
                )
            )

            def box(ro_id: str) -> str:
                sid = client.get_rollout(ro_id).sandbox_id
                assert sid is not None
                return sid

            def spied(ro_id: str) -> bool:
                sid = client.get_rollout(ro_id).sandbox_id
                return sid is not None and client.get(sid).run_shell("cat /work/env").exit_code == 0

            wait_for("the spies' keys", lambda: spied(a.id) and spied(b.id))
            sa, sb = client.get(box(a.id)), client.get(box(b.id))
            key_a = sa.read_file("/work/key").decode().strip()
            env_b = sb.read_file("/work/env").decode()
            assert "sk-real-secret" not in env_b and key_a not in env_b
            base = next(
                line.split("=", 1)[1]
                for line in env_b.splitlines()
                if line.startswith("OPENAI_BASE_URL=")
            )
            # The real key is nowhere in the sandbox (environment of every process, files).
            leak = sb.run_shell("grep -l sk-real-secret /proc/*/environ /work/* 2>/dev/null; true")
            assert leak.stdout.strip() == ""

            def call_from(s: object, token: str, n: int = 1) -> str:
                cmd = (
                    CALL.replace("${KEY:-$OPENAI_API_KEY}", token)
                    .replace("$OPENAI_BASE_URL", base)
                    .replace("$DSEC_ROLLOUT_ID", "spy")
                )
                script = (
                    f"i=x; for j in $(seq {n}); do ({cmd} >/dev/null 2>>/tmp/e.$j; "
                    "echo $? >> /tmp/rcs) & done; wait; cat /tmp/e.* 2>/dev/null; rm -f /tmp/e.*"
                )
                return s.run_shell(script, timeout=60).stdout  # type: ignore[attr-defined, no-any-return]

            # Another rollout's token from this sandbox: refused, and nothing reached the model.
            assert "403" in call_from(sb, key_a)
            assert "401" in call_from(sb, "dsro_forged")
            assert "spy step x" not in trainer.prompts()
            # Its own token from outside its sandbox (the host): refused too.
            with pytest.raises(httpx.HTTPStatusError) as err:
                httpx.post(
                    base.replace(base.split("/")[2].split(":")[0], "127.0.0.1")
                    + "/chat/completions",
                    json={"messages": []},
                    headers={"authorization": f"Bearer {key_a}"},
                ).raise_for_status()
            assert err.value.response.status_code == 403
            # Flooding: calls beyond the in-flight cap are refused at once (429).
            own = sb.read_file("/work/key").decode().strip()
            out = call_from(sb, own, n=20)
            assert "429" in out
            assert client.get_rollout(b.id).model_calls <= 8

            # A forged reward: the scaffold's files and output decide nothing.
            f = client.wait_rollout(forged.id, timeout=60)
            assert f.state is RolloutState.FINISHED and f.exit_code == 0
            assert f.reward == 0.0 and f.verdict is not None and not f.verdict.passed
            # max_steps: the third call is refused; two model_call steps are logged.
            lim = client.wait_rollout(limited.id, timeout=60)
            assert lim.model_calls == 2
            (res,) = [r for r in client.finished_rollouts(job) if r.rollout.id == limited.id]
            assert [s.op for s in res.steps].count("model_call") == 2
            # Cancel: the rollout ends and its sandbox with it.
            c = client.cancel_rollout(a.id)
            assert c.state is RolloutState.CANCELLED
            assert client.get(box(a.id)).info.state.value == "stopped"
            client.cancel_rollout(b.id)
    finally:
        trainer.stop()


def test_fncall_judge_reward_and_unit_pieces(plat: PlatformProcess) -> None:
    """A FnCall judge grades the program the agent wrote (tests passed / tests); the
    gateway's stream merge and RL fields, and the hand-off ack, on their own."""
    from dsec import FnCallJudge
    from dsec.api.fncall import DSecFnCallRunArgs, JudgeTest
    from dsec.rollouts.gateway import merge_stream, rl_fields

    job = "job-judge"
    trainer = ScriptedTrainer().start()
    try:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            judge = FnCallJudge(
                code_path="/work/solution.sh",
                args=DSecFnCallRunArgs(
                    image="busybox:latest", language="sh", memory_limit_mb=64, timeout_s=5
                ),
                tests=[JudgeTest(stdin="2 3", expected="5"), JudgeTest(stdin="1 1", expected="3")],
            )
            ro = client.start_rollout(
                spec(
                    job,
                    model=ModelEndpoint(base_url=trainer.url),
                    scaffold="mkdir -p /work && "
                    "echo 'read a b; echo $((a + b))' > /work/solution.sh",
                    reward=judge,
                )
            )
            # Typed refusals: a rollout id in use, a job with no model endpoint.
            with pytest.raises(AlreadyExists):
                client.start_rollout(spec(job, rollout_id=ro.rollout_id))
            with pytest.raises(InvalidArgument, match="no model endpoint"):
                client.start_rollout(spec("job-without-endpoint"))
            final = client.wait_rollout(ro.id, timeout=120)
            assert final.state is RolloutState.FINISHED, final
            assert final.reward == 0.5 and final.judgement is not None
            assert (final.judgement.passed, final.judgement.total) == (1, 2)
            client.ack_rollouts(job, [ro.id])
    finally:
        trainer.stop()

    merged = merge_stream(
        [
            {"id": "a", "choices": [{"index": 0, "delta": {"content": "he"}, "token_ids": [1]}]},
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "llo"},
                        "token_ids": [2],
                        "logprobs": {"content": [{"token": "llo", "logprob": -0.5}]},
                        "finish_reason": "stop",
                    }
                ]
            },
        ]
    )
    assert merged["choices"][0]["text"] == "hello"
    assert rl_fields(merged) == {"token_ids": [[1, 2]], "logprobs": [[-0.5]]}
    completions = {"choices": [{"logprobs": {"token_logprobs": [-1.0, -2.0]}}]}
    assert rl_fields(completions) == {"logprobs": [[-1.0, -2.0]]}


def test_edge_killed_while_scaffolds_run(plat: PlatformProcess) -> None:
    """SIGKILL of the edge with scaffolds mid-run (not paused): each re-attached, none
    started twice, every step logged as one model_call; then the CLI reads the job."""
    import json
    import subprocess
    import sys

    job = "job-crash"
    trainer = ScriptedTrainer().start()
    try:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            ep = ModelEndpoint(base_url=trainer.url)
            ids = [client.start_rollout(spec(job, model=ep, reward=GRADER)).id for _ in range(2)]
            wait_for(
                "a call each", lambda: all(client.get_rollout(i).model_calls >= 1 for i in ids)
            )
        plat.kill()
        plat.start()
        with DSecSyncClient(plat.url, plat.api_key) as client:
            finals = [client.wait_rollout(i, timeout=120) for i in ids]
            for f in finals:  # the grader checks each step ran once (no scaffold rerun)
                assert f.state is RolloutState.FINISHED and f.reward == 1.0, f
                assert f.model_calls == STEPS
            for res in client.finished_rollouts(job):
                prompts = [
                    s.request["body"]["messages"][-1]["content"]
                    for s in res.steps
                    if s.op == "model_call" and s.status == "ok"
                ]
                assert sorted(prompts) == [f"{res.rollout.id} step {n}" for n in range(STEPS)]
        dsec = [sys.executable, "-m", "dsec.cli.main", "--url", plat.url]
        dsec += ["--api-key", plat.api_key, "rollout"]
        cli = subprocess.run(
            [*dsec, "list", job, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert sorted(r["id"] for r in json.loads(cli.stdout)) == sorted(ids)
        ack = subprocess.run(
            [*dsec, "ack", job, *ids],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert "acked 2" in ack.stdout
    finally:
        trainer.stop()


# A scaffold whose client retries as the OpenAI SDK does: 2 retries after a reset or a
# refusal, ~0.5 s then ~1 s apart, each numbered in x-stainless-retry-count; a call
# that fails all three attempts is lost (written down, the scaffold exits 3).
OPENAI_LIKE = """mkdir -p /work
call() {
  n=0
  while :; do
    body='{"messages":[{"role":"user","content":"'"$DSEC_ROLLOUT_ID step $1"'"}]}'
    wget -q -O /dev/null --header "Authorization: Bearer $OPENAI_API_KEY" \\
      --header "x-stainless-retry-count: $n" --header 'Content-Type: application/json' \\
      --post-data "$body" "$OPENAI_BASE_URL/chat/completions" 2>/dev/null && return 0
    n=$((n+1))
    [ $n -gt 2 ] && return 1
    sleep $n
  done
}
for i in 0 1; do
  call $i || { echo "lost $i" >> /work/lost; exit 3; }
  echo $i >> /work/steps
done
"""


def test_held_call_survives_the_edge_dying(plat: PlatformProcess) -> None:
    """A call held (the trainer is away) when the edge is SIGKILLed: the scaffold's
    connection is reset and its client retries twice within ~3 s, far less than a
    restart; the gateway's listening socket outlives the edge (dsec.rollouts.listener),
    so the retry waits in its backlog, the restarted edge accepts it, and it is
    answered and logged once, as the client's retry of the same call."""
    job = "job-keeper"
    trainer = ScriptedTrainer()
    try:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            dead = ModelEndpoint(base_url="http://127.0.0.1:9/v1")  # nobody listens
            ro = client.start_rollout(
                spec(job, model=dead, scaffold=OPENAI_LIKE, reward=None, pause_after=300.0)
            )
            wait_for(
                "the first call held",
                lambda: (
                    client.get_rollout(ro.id).state
                    in (RolloutState.WAITING_FOR_MODEL, RolloutState.FAILED, RolloutState.FINISHED)
                ),
            )
            held = client.get_rollout(ro.id)
            assert held.state is RolloutState.WAITING_FOR_MODEL, held
        plat.kill()
        time.sleep(1.5)  # the scaffold's first retry is made while no edge runs
        plat.start()
        trainer.start()
        with DSecSyncClient(plat.url, plat.api_key) as client:
            client.set_model_endpoint(job, ModelEndpoint(base_url=trainer.url))
            final = client.wait_rollout(ro.id, timeout=120)
            assert final.state is RolloutState.FINISHED and final.exit_code == 0, final
            assert final.model_calls == 2, final
            (res,) = client.finished_rollouts(job)
            calls = [s for s in res.steps if s.op == "model_call"]
            prompts = [s.request["body"]["messages"][-1]["content"] for s in calls]
            assert prompts == [f"{ro.id} step 0", f"{ro.id} step 1"], prompts
            assert all(s.status == "ok" for s in calls)
            assert calls[0].result is not None and calls[0].result.get("client_retry", 0) >= 1
            assert sorted(trainer.prompts()) == sorted(prompts)  # each reached it once
            client.ack_rollouts(job, [ro.id])
    finally:
        trainer.stop()


def test_rollouts_are_governed_by_roles(plat: PlatformProcess) -> None:
    """Jobs and rollouts belong to a project (dsec.control.jobs). A second tenant, with
    the runtime role on its own project only, attacks the admin's job by every route
    under /v1/rollouts, /v1/jobs and /v1/trajectories: ids it saw or guessed are 404 as
    if they did not exist, the job's routes are 403, the job id cannot be reused, its
    endpoint cannot be pointed elsewhere; and the admin's rollout is untouched."""
    import httpx

    from dsec import NotFound, PermissionDenied

    tag = secrets.token_hex(3)
    trainer = ScriptedTrainer().start()
    evil = ScriptedTrainer().start()
    try:
        with DSecSyncClient(plat.url, plat.api_key) as admin:
            admin.create_project(f"ro-{tag}")
            admin.create_principal(f"tenant-{tag}", default_project=f"ro-{tag}")
            admin.grant(f"tenant-{tag}", "runtime", project=f"ro-{tag}")
            key = admin.create_key(f"tenant-{tag}").key
            ep = ModelEndpoint(base_url=trainer.url, api_key="sk-x")
            job = f"job-admin-{tag}"
            theirs = admin.start_rollout(spec(job, model=ep, reward=None, scaffold="sleep 30"))
            assert theirs.project == "default"
            mine_job = f"job-t-{tag}"
            with DSecSyncClient(plat.url, key) as tenant:
                elsewhere = spec(
                    mine_job,
                    model=ep,
                    reward=None,
                    sandbox=DSecContainerRunArgs(
                        container_image="busybox:latest", memory_limit_mb=64, project="default"
                    ),
                )
                with pytest.raises(PermissionDenied):  # a project it has no role on
                    tenant.start_rollout(elsewhere)
                # Rollout ids, seen or guessed: 404 alike, whatever the route.
                for rid in (theirs.id, theirs.id[:-1] + "0", "nope-ro00"):
                    with pytest.raises(NotFound):
                        tenant.get_rollout(rid)
                    with pytest.raises(NotFound):
                        tenant.wait_rollout(rid, timeout=0.1)
                    with pytest.raises(NotFound):
                        tenant.cancel_rollout(rid)
                # The job's routes: 403.
                attacks: list[Callable[[], object]] = [
                    lambda: tenant.list_rollouts(job),
                    lambda: tenant.finished_rollouts(job),
                    lambda: tenant.ack_rollouts(job, [theirs.id]),
                    lambda: tenant.set_model_endpoint(job, ModelEndpoint(base_url=evil.url)),
                    lambda: tenant.pause_job(job),
                    lambda: tenant.resume_job(job),
                    # the job id reused, by a rollout or a sandbox
                    lambda: tenant.start_rollout(spec(job, model=ep, reward=None)),
                    lambda: tenant.run_sandbox(
                        DSecContainerRunArgs(container_image="busybox:latest", job_id=job)
                    ),
                ]
                for n, attack in enumerate(attacks):
                    with pytest.raises(PermissionDenied):
                        attack()
                        raise AssertionError(f"attack {n} went through")
                # Its trajectories: read, export, log into, discard.
                h = {"Authorization": f"Bearer {key}"}
                rid = theirs.rollout_id
                with httpx.Client(base_url=plat.url, headers=h, timeout=30) as http:
                    routes: list[tuple[str, str, object]] = [
                        ("GET", f"/v1/trajectories/{job}", None),
                        ("GET", f"/v1/trajectories/{job}?format=jsonl", None),
                        ("GET", f"/v1/trajectories/{job}/{rid}", None),
                        ("GET", f"/v1/trajectories/{job}/{rid}/steps", None),
                        ("DELETE", f"/v1/trajectories/{job}/{rid}?from_step=0", None),
                        ("POST", f"/v1/trajectories/{job}/{rid}/steps", {"steps": []}),
                    ]
                    for method, path, body in routes:
                        r = http.request(method, path, json=body)
                        assert r.status_code == 403, (method, path, r.status_code, r.text)
                # Its own job: fine, and another's id in its ack is "unknown", not acked.
                own = tenant.start_rollout(spec(mine_job, model=ep, reward=None))
                assert own.project == f"ro-{tag}"
                assert [r.id for r in tenant.list_rollouts(mine_job)] == [own.id]
                assert tenant.cancel_rollout(own.id).state.value in {"cancelled", "finished"}
                res = tenant.ack_rollouts(mine_job, [own.id, theirs.id])
                assert res.acked == [own.id] and res.unknown == [theirs.id]
                tenant.set_model_endpoint(mine_job, ep)
            # The admin (a role on every project) sees both; its rollout is untouched and
            # its calls still reach its own trainer.
            assert admin.get_rollout(own.id).project == f"ro-{tag}"
            got = admin.get_rollout(theirs.id)
            assert got.state.value not in {"cancelled", "failed"} and not got.acked
            assert evil.prompts() == []
            assert admin.cancel_rollout(theirs.id).state.value == "cancelled"
            assert [r.rollout.id for r in admin.finished_rollouts(job)] == [theirs.id]
    finally:
        trainer.stop()
        evil.stop()
