"""Adversarial suite: root inside a sandbox tries to cheat, escape or break the host.

Every attempt runs as root in a real sandbox on a real platform and must (1) fail or
stay contained, (2) leave the host and a neighbouring sandbox unaffected, and (3) be on
record: the command in the audit log and, where a detector exists, a typed event
tagged with the attempt's job id, so a trainer can discard the rollout.

System-call attempts use a small static C program (tests/adversary/attack.c) so that
they are the raw calls, not whatever a busybox applet happens to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, ProtectedMount
from dsec.api.events import AuditKind, EventKind
from dsec.errors import DSecError, LimitExceeded
from dsec.native import binary
from dsec.sdk.client import Sandbox
from tests.conftest import REPO, FakeInternet, PlatformProcess
from tests.hostprint import HostPrint

pytestmark = pytest.mark.root

ATTACK_IN_SANDBOX = "/usr/local/bin/attack"


@pytest.fixture(scope="module")
def attack_binary() -> Path:
    return binary(
        REPO / "tests" / "adversary" / "attack.c",
        name="attack",
        subdir="tests",
        cflags=["-static", "-O1", "-w"],
        what="the adversarial test program",
    )


@dataclass
class Arena:
    """An attacker sandbox (own job id), a neighbour holding a secret, and host canaries."""

    client: DSecClient
    platform: PlatformProcess
    attacker: Sandbox
    neighbour: Sandbox
    job: str
    secret: str
    answer: str
    host_canary: Path
    abstract_socket: str

    async def attack(self, name: str, arg: str = "", *, timeout: float = 30) -> str:
        res = await self.attacker.exec(
            [ATTACK_IN_SANDBOX, name, *([arg] if arg else [])], timeout=timeout
        )
        out = res.stdout + res.stderr
        assert res.exit_code != 2, out
        assert res.exit_code == 0, f"attempt {name} went through: {out}"
        return out

    async def shell(self, command: str, *, timeout: float = 60) -> str:
        res = await self.attacker.run_shell(command, timeout=timeout)
        return res.stdout + res.stderr

    async def events(self, kind: EventKind | None = None) -> list[object]:
        found = await self.client.events(job=self.job, kinds=[kind] if kind else None)
        return list(found)

    async def recorded(self, needle: str) -> None:
        """The attempt's command is in the audit log under the attacker's job."""
        rows = await self.client.audit(job=self.job, kinds=[AuditKind.COMMAND], limit=10_000)
        assert any(needle in str(r.detail.get("command")) for r in rows), needle

    async def expect_event(self, kind: EventKind, **match: object) -> None:
        for _ in range(40):  # detectors report within a second
            for ev in await self.client.events(job=self.job, kinds=[kind]):
                if all(str(v) in str(ev.detail.get(k)) for k, v in match.items()):
                    return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {kind.value} event matching {match} for job {self.job}")


@contextlib.contextmanager
def abstract_listener() -> Iterator[str]:
    """A host service on an abstract unix socket (these are per network namespace)."""
    name = "dsec-adv-" + secrets.token_hex(4)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen(4)
    try:
        yield name
    finally:
        srv.close()


@pytest.fixture
async def arena(
    client: DSecClient, busybox_image: str, platform: PlatformProcess, attack_binary: Path
) -> AsyncIterator[Arena]:
    job = "adv-" + secrets.token_hex(4)
    secret = "neighbour-secret-" + secrets.token_hex(8)
    canary = Path("/tmp") / f"dsec-host-canary-{secrets.token_hex(4)}"
    canary.write_text("host-canary-" + secrets.token_hex(8))
    answer = "the-answer-" + secrets.token_hex(8)
    spec = DSecContainerRunArgs(
        container_image=busybox_image,
        memory_limit_mb=128,
        pids_limit=256,
        # Small: the inode flood (test_disk_fill_...) fills it with empty files, ~350 bytes
        # of metadata each; 128 MiB took ~380,000 files and a minute to fill and remove.
        disk_limit_mb=64,  # the smallest a spec takes
        job_id=job,
        # Its own network namespace with nothing allowed: the strictest egress policy.
        network_rules={"pypi": False},
        protected=[ProtectedMount(path="/answers", files={"expected.txt": answer})],
    )
    neighbour_spec = DSecContainerRunArgs(
        container_image=busybox_image, memory_limit_mb=64, job_id=job + "-neighbour"
    )
    before = HostPrint.take()
    attacker = await client.run_container(spec)
    neighbour = await client.run_container(neighbour_spec)
    try:
        program = await asyncio.to_thread(attack_binary.read_bytes)
        await attacker.write_file(ATTACK_IN_SANDBOX, program, mode=0o755)
        await neighbour.write_file("/root/secret", secret.encode())
        with abstract_listener() as sock_name:
            yield Arena(
                client, platform, attacker, neighbour, job, secret, answer, canary, sock_name
            )
        # The neighbour still works and still has its own file, untouched.
        res = await neighbour.run_shell("cat /root/secret")
        assert res.exit_code == 0 and res.stdout == secret
        assert (await client.health()).status == "ok"
        before.assert_same(HostPrint.take())
        assert canary.read_text().startswith("host-canary-")
    finally:
        for sb in (attacker, neighbour):
            with contextlib.suppress(DSecError):
                await sb.stop()
        canary.unlink(missing_ok=True)


# ---- the host kernel: calls that reboot, load code or change global state -------------

KERNEL_CALLS = [
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "clock_settime",
    "settimeofday",
    "adjtimex",
    "add_key",
    "keyctl",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "iopl",
    "ioperm",
    "syslog",
    "acct",
    "open_by_handle_at",
]


@pytest.mark.parametrize("call", KERNEL_CALLS)
async def test_kernel_call_is_refused_and_reported(arena: Arena, call: str) -> None:
    out = await arena.attack(call)
    assert "denied" in out
    await arena.recorded(call)
    await arena.expect_event(
        EventKind.SECCOMP_VIOLATION, syscall=call.replace("settimeofday", "settimeofday")
    )


# ---- namespaces, mounts and other processes ------------------------------------------

ESCAPE_CALLS = [
    "unshare_user",
    "unshare_mount",
    "setns",
    "mount_tmpfs",
    "mount_proc",
    "remount_root_rw",
    "umount_proc_mask",
    "ptrace_init",
    "ptrace_sibling",
    "process_vm_readv",
    "pidfd_getfd",
]


@pytest.mark.parametrize("call", ESCAPE_CALLS)
async def test_namespace_mount_and_ptrace_tricks_fail(arena: Arena, call: str) -> None:
    out = await arena.attack(call)
    assert "denied" in out
    await arena.recorded(call)
    await arena.expect_event(EventKind.SECCOMP_VIOLATION)


async def test_chroot_walk_up_stays_in_the_sandbox(arena: Arena) -> None:
    out = await arena.attack("chroot_escape")
    assert "contained" in out or "denied" in out
    await arena.recorded("chroot_escape")


async def test_raw_and_packet_sockets_are_refused(arena: Arena) -> None:
    for call in ("raw_socket", "packet_socket"):
        assert "denied" in await arena.attack(call)
        await arena.recorded(call)


async def test_block_device_of_the_host_disk_cannot_be_opened(arena: Arena) -> None:
    assert "denied" in await arena.attack("mknod_disk")
    await arena.recorded("mknod_disk")


# ---- kernel interfaces under /proc and /sys ------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/proc/sysrq-trigger",
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/vm/drop_caches",
        "/sys/kernel/mm/transparent_hugepage/enabled",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/.dsec/init",
    ],
)
async def test_kernel_and_agent_files_are_read_only(arena: Arena, path: str) -> None:
    assert "denied" in await arena.attack("write", path)
    await arena.recorded(path)


@pytest.mark.parametrize("path", ["/proc/kcore", "/proc/keys", "/proc/timer_list"])
async def test_sensitive_kernel_files_are_masked(arena: Arena, path: str) -> None:
    out = await arena.attack("read", path)
    assert "empty (masked)" in out or "denied" in out


async def test_sandbox_hostname_change_stays_in_the_sandbox(arena: Arena) -> None:
    res = await arena.attacker.exec([ATTACK_IN_SANDBOX, "sethostname"])
    # Allowed inside its own UTS namespace (or refused); the arena checks the host's.
    assert res.exit_code in (0, 1)
    assert socket.gethostname() != "pwned"


# ---- host files, other sandboxes, platform files --------------------------------------


async def test_host_files_are_unreachable_through_proc_and_links(arena: Arena) -> None:
    canary = arena.host_canary
    out = await arena.shell(
        f"cat {canary} /proc/1/root{canary} /proc/*/root{canary} /proc/1/cwd{canary}; "
        f"ls -la /proc/1/root/ /proc/*/root/tmp; find / -xdev -name '{canary.name}*'; "
        f"cat /proc/1/mountinfo"
    )
    assert canary.read_text() not in out
    assert canary.name not in out.replace(f"{canary}", "")
    # The file API resolves links inside the sandbox, never on the host.
    await arena.shell(f"ln -sf {canary} /tmp/link; ln -sf /proc/1/root{canary} /tmp/link2")
    for link in ("/tmp/link", "/tmp/link2"):
        with pytest.raises(DSecError):
            await arena.attacker.read_file(link)
        with contextlib.suppress(DSecError):
            await arena.attacker.write_file(link, b"overwritten by the sandbox")
    assert canary.read_text().startswith("host-canary-")
    await arena.recorded(str(canary))


async def test_other_sandboxes_files_are_invisible(arena: Arena) -> None:
    nid = arena.neighbour.id
    out = await arena.shell(
        "cat /proc/*/root/root/secret; find / -xdev -name secret; "
        f"ls /sys/fs/cgroup/*/dsec /sys/fs/cgroup/memory/dsec/*/{nid}; "
        f"cat {arena.platform.data_dir}/sandboxes/{nid}/upper/root/secret"
    )
    assert arena.secret not in out
    await arena.recorded("/proc/*/root/root/secret")


async def test_platform_files_are_not_in_the_sandbox(arena: Arena) -> None:
    data = arena.platform.data_dir
    probes = [data, data / "audit.db", data / "edge.db", data / "edge_token.key", data / "run"]
    out = await arena.shell("; ".join(f"test -e {p} && echo PRESENT {p}" for p in probes))
    assert "PRESENT" not in out
    # Nothing of the host is mounted in: every mount's root and mount point are the
    # sandbox's own (the root overlay's options name its host layer paths, as Docker's
    # do; they are names, not access).
    mounts = await arena.shell("cat /proc/1/mountinfo /proc/self/mountinfo")
    # Two read-only files of the platform's are by design: the DNS settings and the
    # empty decoys standing in for protected paths.
    for line in mounts.splitlines():
        root, point = line.split()[3:5]
        if point in ("/etc/resolv.conf", "/answers"):
            assert " ro," in line, line
            continue
        assert str(data) not in root + point and "sock" not in root + point, line
    sockets = await arena.shell("find / -xdev -type s 2>/dev/null; ls -la /proc/1/fd")
    assert ".sock" not in sockets  # the agents', the spawner's: no host socket's name
    env = await arena.shell("env; cat /proc/1/environ")
    assert arena.platform.api_key not in env and "DSEC_API_KEY" not in env
    await arena.recorded("audit.db")


async def test_forged_requests_to_host_unix_sockets_fail(arena: Arena) -> None:
    run = arena.platform.data_dir / "run"
    spawner = run / "spawner.sock"
    agent = run / "agents" / f"{arena.attacker.id}.sock"
    for target in (str(spawner), str(agent), "/var/run/docker.sock", "/run/crun"):
        assert "denied" in await arena.attack("connect_unix", target)
    # Abstract sockets live in the network namespace: the host's are out of reach.
    assert "denied" in await arena.attack("connect_unix", "@" + arena.abstract_socket)
    await arena.recorded("connect_unix")


async def test_edge_api_and_host_ports_are_unreachable(arena: Arena) -> None:
    port = arena.platform.port
    gateway = (await arena.shell("awk '/^nameserver/ {print $2; exit}' /etc/resolv.conf")).strip()
    assert gateway.count(".") == 3, gateway
    # Its own loopback, the host through its gateway, the metadata service.
    for target in (f"127.0.0.1:{port}", f"{gateway}:{port}", f"{gateway}:22"):
        assert "denied" in await arena.attack("connect_tcp", target, timeout=10)
    assert "denied" in await arena.attack("connect_tcp", "169.254.169.254:80", timeout=10)
    await arena.recorded("connect_tcp")
    await arena.expect_event(EventKind.HOST_ACCESS, target="host")
    await arena.expect_event(EventKind.HOST_ACCESS, target="metadata")


async def test_egress_and_dns_outside_the_rules_fail(arena: Arena) -> None:
    out = await arena.shell("nslookup pypi.org; wget -T 3 -q -O- http://93.184.215.14/")
    assert "93.184" not in out.split("wget")[0]  # no DNS answer for a denied service
    assert "denied" in await arena.attack("connect_tcp", "93.184.215.14:443", timeout=10)
    await arena.expect_event(EventKind.DENIED_CONNECTION)


# ---- cheating: the grader's answers --------------------------------------------------


async def test_protected_answer_cannot_be_read_even_as_root(arena: Arena) -> None:
    out = await arena.shell(
        "cat /answers/expected.txt; cat /proc/*/root/answers/expected.txt; "
        # every file system of the sandbox (grep -r follows no links, so /proc/*/root
        # adds nothing to the line above, and /proc and /sys alone took a minute)
        "grep -rs -D skip the-answer $(ls -d /* | grep -v -x -e /proc -e /sys) | head; "
        "ls -la /answers"
    )
    assert arena.answer not in out
    with contextlib.suppress(DSecError):
        assert arena.answer.encode() not in await arena.attacker.read_file("/answers/expected.txt")
    assert "denied" in await arena.attack("write", "/answers/expected.txt")
    await arena.expect_event(EventKind.PROTECTED_PATH, path="/answers")
    # Only the designated verifier step sees it.
    res = await arena.attacker.verify("cat /answers/expected.txt")
    assert res.exit_code == 0 and res.stdout == arena.answer


# ---- resource exhaustion --------------------------------------------------------------


async def test_fork_bomb_is_contained(arena: Arena) -> None:
    await arena.attacker.run_shell("bomb() { bomb | bomb & }; bomb", timeout=5)
    # The bomb's last processes may still hold the pids limit for a moment (dying,
    # not yet reaped): the cleanup command itself is then refused with a typed error.
    for _ in range(50):
        try:
            await arena.attacker.run_shell("kill -9 -1", timeout=10)
            break
        except LimitExceeded:
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the sandbox's pids stayed exhausted for 5 s after the bomb")
    await arena.recorded("bomb()")
    await arena.expect_event(EventKind.RESOURCE_LIMIT, limit="pids")


async def test_memory_bomb_is_killed_inside_the_sandbox(arena: Arena) -> None:
    res = await arena.attacker.run_shell("tail /dev/zero", timeout=30)
    assert res.exit_code == 137  # OOM-killed; pid 1 and the sandbox live on
    assert (await arena.attacker.run_shell("echo alive")).stdout == "alive\n"
    await arena.expect_event(EventKind.RESOURCE_LIMIT, limit="memory")


async def test_disk_fill_and_inode_exhaustion_stop_at_the_quota(arena: Arena) -> None:
    res = await arena.attacker.run_shell("dd if=/dev/zero of=/fill bs=1M count=400", timeout=60)
    assert res.exit_code != 0 and "quota" in res.stderr.lower()
    # Data keeps 48 of the 64 MiB, so the empty files meet the quota after ~5x10^4
    # (~2x10^5 from empty); a quota blind to metadata would let them run forever.
    res = await arena.attacker.run_shell("rm -f /fill; dd if=/dev/zero of=/fill bs=1M count=48")
    assert res.exit_code == 0, res
    out = await arena.attack("fill_inodes", "/many", timeout=120)
    assert "stopped after" in out and "quota" in out.lower()
    await arena.expect_event(EventKind.RESOURCE_LIMIT, limit="disk")
    await arena.attacker.run_shell("rm -rf /many /fill", timeout=60)


async def test_huge_output_flood_is_truncated(arena: Arena) -> None:
    res = await arena.attacker.exec(
        ["sh", "-c", "yes flood | head -c 200000000"], max_output_bytes=1 << 20, timeout=60
    )
    assert res.truncated and len(res.stdout) <= 1 << 20
    await arena.recorded("yes flood")
    await arena.expect_event(EventKind.RESOURCE_LIMIT, limit="output")


# ---- and the honest agent still works -------------------------------------------------


async def test_normal_agent_workload_runs_and_raises_nothing(
    client: DSecClient, platform: PlatformProcess, fake_internet: FakeInternet
) -> None:
    """Install from the allowed package index with pip, build, run the tests: all under
    the seccomp profile and egress rules, and not one event for the job."""
    import pip

    await client.build_image("debian-python", timeout=900)
    job = "honest-" + secrets.token_hex(4)
    spec = DSecContainerRunArgs(
        container_image="debian-python:bookworm",
        memory_limit_mb=512,
        job_id=job,
        network_rules={"pypi": True},
    )
    async with await client.run_container(spec, timeout=120) as sb:
        # The image has python3 but no pip: the agent brings it (pure Python).
        await sb.upload_dir(Path(pip.__file__).parent, "/opt/pip/pip")
        steps = [
            "PYTHONPATH=/opt/pip python3 -m pip install --no-cache-dir --disable-pip-version-check"
            " --index-url http://pypi.org/simple/ --trusted-host pypi.org"
            " --break-system-packages dsecdemo",
            "python3 -m compileall -q /usr/local/lib/python3*/dist-packages/dsecdemo",
            "cd /tmp && python3 -m unittest -v dsecdemo.test_add",
        ]
        for step in steps:
            res = await sb.run_shell(step, timeout=300)
            assert res.exit_code == 0, (step, res.stdout[-2000:], res.stderr[-2000:])
        assert "OK" in res.stderr
        allowed = await client.audit(job=job, kinds=[AuditKind.NETWORK])
        assert any(r.action == "dns_answered" for r in allowed)
        assert await client.events(job=job) == []
    assert fake_internet.pypi.ip
