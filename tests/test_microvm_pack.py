"""pack_diff and fork of microVMs, for real (QEMU under TCG): the agent's ext4 disk is
parsed by a packer VM, its tar by the host as hostile input (dsec.backends.microvm.pack),
and the layer starts a container and a microVM alike. One platform with both backends."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import AsyncIterator, Iterator

import pytest

from dsec import DSecClient, DSecMicroVMRunArgs, SandboxState
from tests.conftest import PlatformProcess, platform_process

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU"),
    pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-utils"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

SECRET = "PACK-VM-SECRET-77e2"
LONG = "d" * 120  # past ustar's 100-byte name field: a pax path record
SETUP = f"""
set -e
test -L /bin/vi
rm /bin/vi
rm -rf /usr/sbin && mkdir /usr/sbin && echo only > /usr/sbin/only
mkdir -p /root/app /root/sticky /root/{LONG}
printf 'echo hi\\n' > /root/app/run.sh && chmod 0750 /root/app/run.sh
echo s > /root/suid && chown 1234:5678 /root/suid && chmod 4755 /root/suid
echo p > /root/private && chmod 0600 /root/private
chmod 1777 /root/sticky
ln -s /root/app/run.sh /root/link
echo deep > /root/{LONG}/{LONG}.txt
echo twin > /root/a && ln /root/a /root/b
mkfifo /root/fifo
mknod /root/sda b 8 0
mknod /root/mem c 1 1
echo planted > /grader/planted || true
"""
CHECK = (
    "test ! -e /bin/vi && echo vi-gone; ls /usr/sbin; "
    "stat -c '%a %u:%g %n' /root/app/run.sh /root/suid /root/private /root/sticky; "
    f"readlink /root/link; sh /root/app/run.sh; cat /root/{LONG}/{LONG}.txt; "
    "stat -c '%h' /root/a; cat /root/b; test -p /root/fifo && echo fifo; "
    "test -e /root/sda || echo no-sda; test -e /root/mem || echo no-mem"
)
EXPECTED = (
    "vi-gone\nonly\n750 0:0 /root/app/run.sh\n4755 1234:5678 /root/suid\n"
    "600 0:0 /root/private\n1777 0:0 /root/sticky\n/root/app/run.sh\nhi\ndeep\n"
    "2\ntwin\nfifo\nno-sda\nno-mem\n"
)


@pytest.fixture(scope="module")
def vmplatform() -> Iterator[PlatformProcess]:
    with platform_process(DSEC_BACKENDS="container,microvm") as plat:
        from dsec import DSecSyncClient

        with DSecSyncClient(plat.url, plat.api_key) as c:
            c.build_image("busybox")
        yield plat


@pytest.fixture
async def client(vmplatform: PlatformProcess) -> AsyncIterator[DSecClient]:
    c = DSecClient(vmplatform.url, vmplatform.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()


def vm_spec(**kw: object) -> DSecMicroVMRunArgs:
    kw.setdefault("memory_limit_mb", 256)
    kw.setdefault("disk_limit_mb", 128)
    return DSecMicroVMRunArgs.model_validate({"image": "busybox:latest", **kw})


def no_packer_left(platform: PlatformProcess, sandbox_id: str) -> None:
    vms = platform.data_dir / "vms"
    assert not (vms / f"{sandbox_id}.k").exists(), "a packer VM's files were left behind"


async def test_pack_diff_of_a_microvm_starts_a_container_and_a_microvm(
    client: DSecClient, vmplatform: PlatformProcess
) -> None:
    src = await client.run_microvm(
        vm_spec(protected=[{"path": "/grader", "files": {"k.txt": SECRET}}]), timeout=180
    )
    started: list[object] = []
    try:
        r = await src.run_shell(SETUP, timeout=60)
        assert r.exit_code == 0, r.stderr
        name = "pkvm-" + secrets.token_hex(3)
        env = await src.pack_diff(name=name, version="v1")
        assert env.layer.kind == "workspace" and env.container_image == "busybox:latest"
        assert {"/.dsec", "/grader", "/proc", "/dev"} <= set(env.excluded)
        assert (await src.refresh()).state is SandboxState.RUNNING  # continued after
        assert (await src.run_shell("cat /root/b")).stdout == "twin\n"
        no_packer_left(vmplatform, src.id)

        child = await client.run_container(env.run_args(memory_limit_mb=64))
        started.append(child)
        r = await child.run_shell(CHECK)
        assert r.stdout == EXPECTED, r.stderr
        r = await child.run_shell(  # (the FIFO would block grep's read)
            f"test -e /grader; echo $?; rm /root/fifo; grep -rs {SECRET} /root /usr /etc"
        )
        assert r.stdout == "1\n"  # neither the protected path nor what was planted there

        vm_child = await client.run_microvm(env.microvm_run_args(memory_limit_mb=256), timeout=180)
        started.append(vm_child)
        r = await vm_child.run_shell(CHECK, timeout=60)
        assert r.stdout == EXPECTED, r.stderr
    finally:
        for sb in [src, *started]:
            with contextlib.suppress(Exception):
                await sb.stop()  # type: ignore[attr-defined]


async def test_fork_of_a_microvm_gives_microvms_of_its_state(
    client: DSecClient, vmplatform: PlatformProcess
) -> None:
    src = await client.run_microvm(vm_spec(), timeout=180)
    children: list[object] = []
    try:
        await src.run_shell("echo parent > /root/state && rm /bin/vi")
        children.extend(await src.fork(1, timeout=180))
        (child,) = children
        assert child.info.spec.backend == "microvm"  # type: ignore[attr-defined]
        r = await child.run_shell("cat /root/state; test -e /bin/vi || echo vi-gone")  # type: ignore[attr-defined]
        assert r.stdout == "parent\nvi-gone\n", r.stderr
        await child.run_shell("echo child > /root/state")  # type: ignore[attr-defined]
        assert (await src.run_shell("cat /root/state")).stdout == "parent\n"
        no_packer_left(vmplatform, src.id)
    finally:
        for sb in [src, *children]:
            with contextlib.suppress(Exception):
                await sb.stop()  # type: ignore[attr-defined]


async def test_pack_of_a_paused_microvm_keeps_it_paused(
    client: DSecClient, vmplatform: PlatformProcess
) -> None:
    job = "pkvm-job-" + secrets.token_hex(3)
    sb = await client.run_microvm(vm_spec(job_id=job), timeout=180)
    try:
        # Written, never synced by the agent: the pause must not lose it.
        await sb.run_shell("echo before-pause > /root/s")
        await client.pause_job(job)
        env = await sb.pack_diff(name="pkvm-paused-" + secrets.token_hex(3))
        assert (await sb.refresh()).state is SandboxState.PAUSED
        child = await client.run_container(env.run_args(memory_limit_mb=64))
        try:
            assert (await child.run_shell("cat /root/s")).stdout == "before-pause\n"
        finally:
            await child.stop()
        no_packer_left(vmplatform, sb.id)
        await client.resume_job(job)
        assert (await sb.run_shell("cat /root/s")).stdout == "before-pause\n"
    finally:
        await sb.stop()


def test_helper_vms_are_admitted_like_sandboxes() -> None:
    """A verifier or packer VM holds memory like a sandbox: on a host with room for one
    VM, verify and pack_diff are refused (503 ``admission_rejected``) before anything
    starts, and the sandbox goes on untouched (a fresh verify has not stopped it)."""
    from dsec import DSecSyncClient
    from dsec.errors import AdmissionRejected

    with (
        platform_process(DSEC_BACKENDS="microvm", DSEC_MAX_SANDBOXES="1") as plat,
        DSecSyncClient(plat.url, plat.api_key) as c,
    ):
        c.build_image("busybox")
        sb = c.run_microvm(vm_spec(), timeout=180)
        try:
            sb.run_shell("echo work > /root/w")
            with pytest.raises(AdmissionRejected, match="verifier VM") as err:
                sb.verify("true")
            assert err.value.status == 503
            with pytest.raises(AdmissionRejected, match="packer VM"):
                sb.pack_diff(name="pkvm-full")
            assert sb.refresh().state is SandboxState.RUNNING
            assert sb.run_shell("cat /root/w").stdout == "work\n"
        finally:
            sb.stop()
        # Nothing of the refused holds stays committed: the one slot is free again.
        c.run_microvm(vm_spec(), timeout=180).stop()
