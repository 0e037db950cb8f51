"""Hosted rollouts without a platform: the store's hand-off, spec checks, redaction,
and the SDK's sans-I/O calls (tests/test_rollouts.py runs them for real)."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from dsec import DSecContainerRunArgs, ModelEndpoint, RolloutSpec, RolloutState
from dsec.api.rollouts import RolloutInfo, redact_spec
from dsec.errors import AlreadyExists, InvalidArgument
from dsec.rollouts.store import Rollout, RolloutStore
from dsec.sdk import _rollouts as proto


def spec(**kw: object) -> RolloutSpec:
    base: dict[str, object] = {
        "job_id": "j",
        "sandbox": DSecContainerRunArgs(container_image="busybox:latest"),
        "scaffold": "true",
        "model": ModelEndpoint(base_url="http://t:8000/v1/", api_key="sk-secret"),
    }
    base.update(kw)
    return RolloutSpec.model_validate(base)


def row(rid: str, state: RolloutState = RolloutState.STARTING, **kw: object) -> Rollout:
    now = time.time()
    fields: dict[str, object] = {
        "id": rid,
        "job_id": "j",
        "rollout_id": rid,
        "principal": "p",
        "spec": spec(),
        "state": state,
        "token": "tok-" + rid,
        "sandbox_id": None,
        "process_id": None,
        "exit_code": None,
        "reward": None,
        "verdict": None,
        "judgement": None,
        "error": None,
        "model_calls": 0,
        "model_retries": 0,
        "created_at": now,
        "updated_at": now,
        "finished_at": None,
        "deadline": now + 60,
        "acked": False,
    }
    fields.update(kw)
    return Rollout(**fields)  # type: ignore[arg-type]


def test_hand_off_is_exactly_once() -> None:
    store = RolloutStore(None)
    a, b, c = row("a"), row("b"), row("c")
    for r in (a, b, c):
        store.insert(r)
    with pytest.raises(AlreadyExists):
        store.insert(row("a"))
    store.update(a, state=RolloutState.FINISHED, reward=1.0)
    store.update(b, state=RolloutState.FAILED, error="x")
    assert a.finished_at is not None
    ended = [RolloutState.FINISHED, RolloutState.FAILED, RolloutState.CANCELLED]
    listed = {r.id for r in store.of_job("j", ended, unacked_only=True)}
    assert listed == {"a", "b"}
    # A trainer that died before acking sees them again; an ack counts once.
    assert store.ack("j", ["a", "c", "zz"]) == (["a"], [], ["c", "zz"])
    assert store.ack("j", ["a", "b", "b"]) == (["b"], ["a"], [])
    assert store.of_job("j", ended, unacked_only=True) == []
    assert store.ack("other-job", ["a"]) == ([], [], ["a"])
    assert [r.id for r in store.live()] == ["c"]
    assert store.by_token("tok-c") is not None and store.by_token("nope") is None
    store.bump(c, calls=2, retries=3)
    got = store.get("c")
    assert got is not None and (got.model_calls, got.model_retries) == (2, 3)
    store.close()


def test_endpoints_and_settings() -> None:
    store = RolloutStore(None)
    first = ModelEndpoint(base_url="http://a/v1")
    store.set_endpoint("j", first, only_if_unset=True)
    store.set_endpoint("j", ModelEndpoint(base_url="http://b/v1"), only_if_unset=True)
    assert store.endpoint("j") == first  # a rollout's model never moves a set job
    store.set_endpoint("j", ModelEndpoint(base_url="http://c/v1"), only_if_unset=False)
    ep = store.endpoint("j")
    assert ep is not None and ep.base_url == "http://c/v1"
    assert store.setting("gateway_port") is None
    store.set_setting("gateway_port", "4242")
    assert store.setting("gateway_port") == "4242"


def test_spec_checks_and_redaction() -> None:
    s = spec()
    assert s.model is not None and s.model.base_url == "http://t:8000/v1"
    assert "sk-secret" not in repr(s.model)
    assert "api_key" not in redact_spec(s)["model"]
    assert "sk-secret" not in s.model.public().model_dump_json()
    assert "api_key" not in RolloutInfo.model_fields
    for bad in (
        {"files": {"relative/path": "x"}},
        {"env": {"1BAD": "x"}},
        {"model": {"base_url": "file:///etc/passwd"}},
        {"job_id": "has space"},
        {"scaffold": ""},
        {"timeout": 0},
    ):
        with pytest.raises(ValidationError):
            spec(**bad)
    judged = spec(reward={"code_path": "/work/a.py", "tests": [{"stdin": "", "expected": "1"}]})
    assert type(judged.reward).__name__ == "FnCallJudge"
    graded = spec(reward={"command": "true"})
    assert type(graded.reward).__name__ == "VerifyRequest"


def test_sdk_calls() -> None:
    c = proto.list_rollouts("job-1", "paused")
    assert (c.method, c.path, c.params) == (
        "GET",
        "/v1/rollouts",
        [("job_id", "job-1"), ("state", "paused")],
    )
    w = proto.wait_rollout("ro-1", 3600)
    assert w.path == "/v1/rollouts/ro-1/wait" and w.params == [("timeout", "60.0")]
    assert proto.ack_rollouts("j", ["a"]).path == "/v1/jobs/j/rollouts/ack"
    put = proto.set_model_endpoint("j", ModelEndpoint(base_url="http://x/v1"))
    assert (put.method, put.path) == ("PUT", "/v1/jobs/j/model-endpoint")
    with pytest.raises(InvalidArgument):
        proto.get_rollout("a/b")
    with pytest.raises(InvalidArgument):
        proto.ack_rollouts("j", [])
    with pytest.raises(ValueError):
        proto.list_rollouts("j", "sleeping")
