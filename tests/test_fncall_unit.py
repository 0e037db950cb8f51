"""FnCall pieces without a platform: languages, comparators, input checks, the seccomp
rule translation, cgroup plans and the SDK's request building."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsec.api.fncall import DSecFnCallRunArgs
from dsec.errors import InvalidArgument, LimitExceeded
from dsec.fncall import callstub
from dsec.fncall.languages import LANGUAGES, language
from dsec.fncall.service import check_code, compare
from dsec.fncall.zygote import cgroup_plan, seccomp_rules, write_config
from dsec.resources.cgroups import CgroupHost, Layout
from dsec.sdk import _fncall as proto


def test_languages_are_declarative() -> None:
    assert language("PY").name == "python" and language("c++").name == "cpp"
    cpp = language("cpp")
    assert cpp.compile is not None and "main" in cpp.argv(cpp.compile)
    assert cpp.argv(cpp.run) == ["./main"]
    assert {lang.name for lang in LANGUAGES} >= {"python", "bash", "sh", "c", "cpp", "node"}
    with pytest.raises(InvalidArgument, match="supported: bash, c, cpp"):
        language("cobol")


def test_compare() -> None:
    assert compare("3\n", "3", "whitespace", 0)
    assert not compare("3\n", "3", "exact", 0)
    assert compare("1.0000001 ok", "1 ok", "float", 1e-6)
    assert not compare("1.1 ok", "1 ok", "float", 1e-6)
    assert not compare("1 2", "1", "float", 1e-6)


def test_check_code() -> None:
    with pytest.raises(InvalidArgument):
        check_code("")
    with pytest.raises(LimitExceeded):
        check_code("x" * (1 << 20 + 1))
    with pytest.raises(InvalidArgument):
        check_code("x", files={"/abs": ""})
    with pytest.raises(InvalidArgument):
        check_code("x", files={"a/../../b": ""})
    check_code("x", stdin="y", files={"data/in.txt": "1"})


def test_seccomp_rules_follow_the_platform_profile() -> None:
    lines = seccomp_rules().splitlines()
    assert lines[0] == "default 1"  # EPERM
    rules = {line.split()[1]: line for line in lines[1:]}
    assert rules["read"].startswith("-1 ")  # allowed
    assert rules["mount"].startswith("1 ")  # refused (EPERM: no listener here)
    assert rules["clone3"].startswith("38 ")  # ENOSYS, libc falls back to clone
    clone = [line for line in lines if line.split()[1] == "clone"]
    assert any("SCMP_CMP_MASKED_EQ" in c and c.startswith("-1 ") for c in clone)


def _v1_host(tmp: Path) -> CgroupHost:
    v1 = {c: tmp / c for c in ("memory", "cpu", "pids")}
    for d in v1.values():
        d.mkdir()
    return CgroupHost(Layout.HYBRID, v1, None)


def test_cgroup_plan_v1_and_v2(tmp_path: Path) -> None:
    plan = cgroup_plan(_v1_host(tmp_path), "dsec/e.fncall/k", 64 << 20, 0.5, 100)
    assert [d.relative_to(tmp_path).parts[0] for d in plan.dirs] == ["memory", "cpu", "pids"]
    assert (0, "memory.limit_in_bytes", str(64 << 20)) in plan.sets
    assert (1, "cpu.cfs_period_us", "10000") in plan.sets
    assert (1, "cpu.cfs_quota_us", "5000") in plan.sets
    assert (2, "pids.max", "100") in plan.sets
    assert plan.reuse > 0 and (0, "memory.max_usage_in_bytes", "0") in plan.resets
    v2root = tmp_path / "v2"
    v2root.mkdir()
    plan2 = cgroup_plan(CgroupHost(Layout.V2, {}, v2root), "dsec/e.fncall/k", 1 << 20, 2, 9)
    assert plan2.v2 and plan2.reuse == 0 and (0, "cpu.max", "20000 10000") in plan2.sets
    conf = tmp_path / "conf"
    write_config(
        conf,
        lowers=[tmp_path / "l"],
        stage=tmp_path / "s",
        tmpfs_bytes=1,
        plan=plan,
        rules=tmp_path / "r",
        rootmnt=tmp_path / "m",
        shared=tmp_path / "sh",
    )
    text = conf.read_text()
    assert "cgset 0 memory.limit_in_bytes" in text and "rootmode 1" in text
    assert "newnet 1" in text and "reuse 256" in text and "prestart" not in text
    bash = language("bash")
    assert bash.prestart and not language("cpp").prestart
    write_config(
        conf,
        lowers=[tmp_path / "l"],
        stage=tmp_path / "s",
        tmpfs_bytes=1,
        plan=plan,
        rules=tmp_path / "r",
        rootmnt=tmp_path / "m",
        shared=tmp_path / "sh",
        prestart=(bash.source, bash.argv(bash.run), {"PATH": "/bin", "LANG": "C.UTF-8"}, 2500),
    )
    lines = conf.read_text().splitlines()
    assert [ln for ln in lines if ln.startswith("prestart")] == [
        "prestart_cpu_ms 2500",
        "prestart_src main.sh",
        "prestart_arg bash",
        "prestart_arg main.sh",
        "prestart_env PATH=/bin",
        "prestart_env LANG=C.UTF-8",
    ]


def test_call_stub_checks_the_python_version() -> None:
    stub = callstub.stub("3.11")
    assert "'3.11'" in stub and callstub.RESULT in stub
    files = callstub.files(b"payload")
    assert "_dsec/call.b64" in files and "_dsec/cloudpickle/cloudpickle.py" in files


def test_sdk_builds_requests_and_validates_locally() -> None:
    args = DSecFnCallRunArgs(image="busybox:latest", language="sh")
    call = proto.judge(args, "x", [("1", "1"), {"stdin": "2", "expected": "2"}])
    body = json.loads(call.body)
    assert call.op == "fncall.judge" and call.ws_args() == body
    assert json.loads(call.http().content or b"{}") == body
    assert [t["stdin"] for t in body["tests"]] == ["1", "2"]
    with pytest.raises(InvalidArgument):
        proto.judge(args, "x", [])  # at least one test
    with pytest.raises(InvalidArgument):
        proto.run_code(args, "x", argv=["a"] * 1000)
    with pytest.raises(ValueError):
        DSecFnCallRunArgs(memory_limit_mb=1)
    run = proto.run_code(args, "echo", stdin="in")
    assert run.path == "/v1/fncall/run" and run.timeout is not None
