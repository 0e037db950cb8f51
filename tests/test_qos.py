"""CPU QoS classes on a real platform: a best-effort sandbox's processes run at
SCHED_IDLE with the lowest CPU weight and cannot leave it; a latency one runs normally
with a high weight. (core scheduling: reported as detected, never faked.) And the OOM
bias of each class (dsec.resources.oom), which root inside cannot lower."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient
from dsec.api.fncall import DSecFnCallRunArgs
from dsec.resources import cgroups, oom, qos
from tests.conftest import PlatformProcess, platform_process
from tests.waiting import until

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def plat() -> Iterator[PlatformProcess]:
    with platform_process() as p:
        yield p


@pytest.fixture(scope="module")
def client(plat: PlatformProcess) -> Iterator[DSecSyncClient]:
    with DSecSyncClient(plat.url, plat.api_key) as c:
        c.build_image("busybox")
        yield c


@pytest.fixture
def sandboxes(client: DSecSyncClient) -> Iterator[list[Any]]:
    """Every sandbox a test makes, stopped whatever the test's outcome."""
    made: list[Any] = []
    yield made
    for sb in made:
        sb.stop()


def create(client: DSecSyncClient, made: list[Any], cls: str) -> Any:
    args = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64, qos=cls)
    sb = client.run_container(args, timeout=60)
    made.append(sb)
    return sb


def cgroup_rel(plat: PlatformProcess, sid: str) -> str:
    return f"/dsec/{plat.edge_id}/{sid}"


def cpu_class(rel: str) -> str:
    """Which class cgroup ``rel``'s CPU settings are: ``best_effort`` (idle where the
    kernel has cpu.idle, else the lowest weight), ``latency`` (the high weight)."""
    host = cgroups.detect()
    rel = rel.strip("/")
    if "cpu" in host.v1:
        cpu = host.v1["cpu"] / rel
        weight, high = int((cpu / "cpu.shares").read_text()), qos.CPU_SHARES["latency"]
    else:
        assert host.v2 is not None
        cpu = host.v2 / rel
        weight = int((cpu / "cpu.weight").read_text())
        high = qos.cgroup_v2_weight(qos.CPU_SHARES["latency"])
    idle = host.has_cpu_idle and (cpu / "cpu.idle").read_text().strip() == "1"
    if weight == high and not idle:
        return "latency"
    # An idle group reports the kernel's idle weight (3 as shares) instead of ours.
    if weight <= 3 and idle == host.has_cpu_idle:
        return "best_effort"
    return f"neither (weight {weight}, idle {idle})"


def class_of(plat: PlatformProcess, sid: str) -> str:
    return cpu_class(cgroup_rel(plat, sid))


def host_pids(plat: PlatformProcess, sid: str) -> set[int]:
    return cgroups.detect().pids(cgroup_rel(plat, sid))


def of_each(read: Callable[[int], int], plat: PlatformProcess, sid: str) -> list[int]:
    """``read`` of every process in the sandbox's cgroup, skipping one that exits between
    the listing and the read: a command's supervisor reports the exit status before it
    exits itself, so it can still be listed right after the command returned."""
    values = []
    for pid in host_pids(plat, sid):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            values.append(read(pid))
    return values


def test_best_effort_runs_idle_with_the_lowest_weight(
    plat: PlatformProcess, client: DSecSyncClient, sandboxes: list[Any]
) -> None:
    sb = create(client, sandboxes, "best_effort")
    assert sb.info.spec.qos == "best_effort"
    # A command started after create (forked by the agent) inherits the policy.
    res = sb.run_shell("sleep 30 >/dev/null 2>&1 & grep policy /proc/self/sched")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split()[-1] == str(os.SCHED_IDLE), res.stdout
    policies = of_each(qos.policy_of, plat, sb.id)
    assert len(policies) >= 2  # the agent and the background sleep
    assert set(policies) == {os.SCHED_IDLE}
    assert class_of(plat, sb.id) == "best_effort"


def test_latency_runs_normally_with_a_high_weight(
    plat: PlatformProcess, client: DSecSyncClient, sandboxes: list[Any]
) -> None:
    sb = create(client, sandboxes, "latency")
    res = sb.run_shell("grep policy /proc/self/sched")
    assert res.stdout.split()[-1] == str(os.SCHED_OTHER), res.stdout
    assert set(of_each(qos.policy_of, plat, sb.id)) == {os.SCHED_OTHER}
    assert class_of(plat, sb.id) == "latency"
    assert qos.CPU_SHARES["latency"] > 1024 > qos.CPU_SHARES["best_effort"]


def test_a_best_effort_sandbox_cannot_leave_sched_idle(
    plat: PlatformProcess, client: DSecSyncClient, sandboxes: list[Any]
) -> None:
    """Root inside has no CAP_SYS_NICE and RLIMIT_NICE 0: neither chrt nor raising the
    nice limit nor writing its cgroup's weight gets it out."""
    sb = create(client, sandboxes, "best_effort")
    attempts = {
        "chrt other": "chrt -o -p 0 $$",
        "chrt batch": "chrt -b -p 0 $$",
        "chrt fifo": "chrt -f -p 1 $$",
        "renice": "renice -n -5 -p $$",
        "nice limit": "ulimit -e 40",
        "cgroup weight": "echo 100000 > /sys/fs/cgroup/cpu/cpu.shares"
        if "cpu" in cgroups.detect().v1
        else "echo 10000 > /sys/fs/cgroup/cpu.weight",
        "cgroup idle": "echo 0 > /sys/fs/cgroup/cpu/cpu.idle"
        if "cpu" in cgroups.detect().v1
        else "echo 0 > /sys/fs/cgroup/cpu.idle",
    }
    for name, attempt in attempts.items():
        res = sb.run_shell(f"{attempt}; rc=$?; grep policy /proc/self/sched; exit $rc")
        assert res.exit_code != 0, f"{name}: {res.stdout} {res.stderr}"
    res = sb.run_shell("ulimit -e; grep policy /proc/self/sched")
    assert res.stdout.split() == ["0", "policy", ":", str(os.SCHED_IDLE)], res.stdout
    assert set(of_each(qos.policy_of, plat, sb.id)) == {os.SCHED_IDLE}
    assert class_of(plat, sb.id) == "best_effort"


def test_health_reports_core_scheduling_as_detected(client: DSecSyncClient) -> None:
    detail = client.health().backend_details["container"]["core_scheduling"]
    why_not = qos.core_scheduling()
    assert detail == ("on" if why_not is None else f"off: {why_not}")
    if not Path("/proc/sys/kernel/sched_core_enabled").exists() and why_not is None:
        pytest.fail("core scheduling reported on a kernel that may not have it")


def lowering(sb: Any, attempts: dict[str, str]) -> dict[str, str]:
    """Which of ``attempts`` (shell, inside ``sb``) succeeded, with what they saw."""
    done = {}
    for name, attempt in attempts.items():
        res = sb.run_shell(f"{attempt}; rc=$?; cat /proc/self/oom_score_adj; exit $rc")
        if res.exit_code == 0:
            done[name] = res.stdout.strip()
    return done


BELOW_ZERO = {
    "lowest": "echo -1000 > /proc/self/oom_score_adj",
    "init": "echo -1000 > /proc/1/oom_score_adj",
    "legacy oom_adj": "echo -17 > /proc/self/oom_adj",
    "choom": "choom -n -1000 -- true",
}
TO_ZERO = {
    "own": "echo 0 > /proc/self/oom_score_adj",
    "init to 0": "echo 0 > /proc/1/oom_score_adj",
    "a child's": "sleep 5 & echo 0 > /proc/$!/oom_score_adj",
}


@pytest.mark.parametrize("cls", ["latency", "best_effort"])
def test_the_oom_killer_takes_sandboxes_before_the_platform_and_root_cannot_duck(
    plat: PlatformProcess, client: DSecSyncClient, sandboxes: list[Any], cls: str
) -> None:
    """Every process of a sandbox carries its class's OOM bias (dsec.resources.oom),
    commands forked later too. Root inside can raise it, never take it below the
    platform's own 0 (CAP_SYS_RESOURCE), and, where the platform has that capability
    to set the floor, not lower it at all; health says which holds here."""
    sb = create(client, sandboxes, cls)
    bias = oom.oom_score_adj(cls)
    assert bias > 0
    res = sb.run_shell("sleep 30 >/dev/null 2>&1 & cat /proc/self/oom_score_adj")
    assert res.stdout.strip() == str(bias), res.stdout
    biases = of_each(oom.oom_score_adj_of, plat, sb.id)
    assert len(biases) >= 2 and set(biases) == {bias}
    assert lowering(sb, BELOW_ZERO) == {}
    detail = client.health().backend_details["container"]["oom_score_adj"]
    if oom.floor_enforced():
        assert "cannot lower" in detail, detail
        assert lowering(sb, TO_ZERO) == {}
        assert set(of_each(oom.oom_score_adj_of, plat, sb.id)) == {bias}
    else:  # this host: root has no CAP_SYS_RESOURCE, so no floor can be set
        assert "advisory" in detail and "CAP_SYS_RESOURCE" in detail, detail
        assert set(lowering(sb, TO_ZERO).values()) <= {"0", str(bias)}
    assert min(of_each(oom.oom_score_adj_of, plat, sb.id)) >= 0
    # raising is allowed (and only costs the sandbox itself)
    assert sb.run_shell("echo 1000 > /proc/self/oom_score_adj").exit_code == 0
    assert plat.proc is not None and oom.oom_score_adj_of(plat.proc.pid) == 0


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
        return [int(c) for c in fh.read().split()]


def test_a_function_calls_code_carries_the_fncall_bias(
    plat: PlatformProcess, client: DSecSyncClient
) -> None:
    """FnCall steps run untrusted code as nobody: the bias the zygote gave their
    sandbox reaches them, and they cannot go below 0 (nor below the bias where the
    floor is enforced). The zygote itself, platform code, keeps 0."""
    args = DSecFnCallRunArgs(image="busybox:latest", language="sh", memory_limit_mb=64, timeout_s=5)
    r = client.run_code(
        args,
        "cat /proc/self/oom_score_adj; echo -1 > /proc/self/oom_score_adj; echo rc=$?;"
        "echo 0 > /proc/self/oom_score_adj; echo rc=$?",
    )
    first, below, to_zero = r.stdout.split()
    assert first == str(oom.FNCALL_OOM_SCORE_ADJ), r
    assert below != "rc=0", r
    assert (to_zero != "rc=0") == oom.floor_enforced(), r
    assert plat.proc is not None
    comm = {c: Path(f"/proc/{c}/comm").read_text() for c in children(plat.proc.pid)}
    zygotes = [c for c, name in comm.items() if name.startswith("dsec-zyg")]
    assert zygotes and {oom.oom_score_adj_of(z) for z in zygotes} == {0}
    # A sandbox whose call ended exits meanwhile: read those still there. One the pool
    # has just cloned shows the zygote's 0 until the zygote sets its bias, which it does
    # before the sandbox may run anything (zygote.c, the "g" it waits for): give each
    # a moment to get there.
    biases = set()
    for runner in (r for z in zygotes for r in children(z)):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):

            def biased(r: int = runner) -> bool:
                return oom.oom_score_adj_of(r) == oom.FNCALL_OOM_SCORE_ADJ

            until(f"runner {runner} with the FnCall OOM bias", biased, 1.0, interval=0.02)
            biases.add(oom.oom_score_adj_of(runner))
    assert biases == {oom.FNCALL_OOM_SCORE_ADJ}
