"""pack_diff and fork (DSEC.md §6.1) on a real platform: a sandbox's overlay upper
becomes an EROFS layer (whiteouts, opaque dirs, owners, modes kept; platform files and
protected paths left out), only builders may pack, forks are isolated from each other."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest

from dsec import DSecClient, DSecContainerRunArgs, SandboxState
from dsec.control.db import make_engine, sqlite_url
from dsec.control.keys import KeyStore
from dsec.errors import PermissionDenied, Unsupported
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root

SECRET = "PACK-SECRET-4c1d"
SETUP = """
set -e
test -L /bin/vi
rm /bin/vi
rm -rf /usr/sbin && mkdir /usr/sbin && echo only > /usr/sbin/only
mkdir -p /root/app /root/sticky
printf 'echo hi\\n' > /root/app/run.sh && chmod 0750 /root/app/run.sh
echo s > /root/suid && chown 1234:5678 /root/suid && chmod 4755 /root/suid
echo p > /root/private && chmod 0600 /root/private
chmod 1777 /root/sticky
ln -s /root/app/run.sh /root/link
"""
CHECK = (
    "test ! -e /bin/vi && echo vi-gone; ls /usr/sbin; "
    "stat -c '%a %u:%g %n' /root/app/run.sh /root/suid /root/private /root/sticky; "
    "readlink /root/link; sh /root/app/run.sh"
)
EXPECTED = (
    "vi-gone\nonly\n750 0:0 /root/app/run.sh\n4755 1234:5678 /root/suid\n"
    "600 0:0 /root/private\n1777 0:0 /root/sticky\n/root/app/run.sh\nhi\n"
)


async def _key_for(platform: PlatformProcess, principal: str) -> str:
    engine = make_engine(sqlite_url(platform.data_dir / "control.db"))
    try:
        return await KeyStore(engine).create(principal)
    finally:
        await engine.dispose()


async def test_pack_diff_keeps_deletions_and_modes_and_leaves_out_platform_files(
    client: DSecClient, busybox_image: str
) -> None:
    src = await client.run_container(
        DSecContainerRunArgs(
            container_image=busybox_image,
            memory_limit_mb=64,
            protected=[{"path": "/grader", "files": {"ans.txt": SECRET}}],
        )
    )
    started: list[object] = []
    try:
        r = await src.run_shell(SETUP)
        assert r.exit_code == 0, r.stderr
        assert (await src.run_shell(CHECK)).stdout == EXPECTED
        name = "pk-" + secrets.token_hex(3)
        env = await src.pack_diff(name=name, version="v1")
        assert env.layer.kind == "workspace" and env.workspace == f"{name}:v1"
        assert {"/.dsec", "/grader", "/etc/resolv.conf", "/proc"} <= set(env.excluded)
        assert (await src.refresh()).state is SandboxState.RUNNING  # thawed after
        assert (await client.get_layer(f"{name}:v1")).digest == env.layer.digest

        child = await client.run_container(env.run_args(memory_limit_mb=64))
        started.append(child)
        r = await child.run_shell(CHECK)
        assert r.stdout == EXPECTED, r.stderr
        # neither the protected content nor its mount stub came along
        r = await child.run_shell(
            f"test -e /grader; echo $?; grep -rs {SECRET} /root /etc /usr /bin /home /var /tmp",
            timeout=30,
        )
        assert r.stdout == "1\n"

        # A layer from a sandbox that has a workspace goes in the toolkit slot, above it.
        await child.run_shell("echo gen2 > /root/gen")
        env2 = await child.pack_diff(name=name, version="v2")
        assert env2.toolkit == f"{name}:v2" and env2.workspace == env.layer.digest
        grandchild = await client.run_container(env2.run_args(memory_limit_mb=64))
        started.append(grandchild)
        r = await grandchild.run_shell(CHECK + "; cat /root/gen")
        assert r.stdout == EXPECTED + "gen2\n"
        with pytest.raises(Unsupported, match="toolkit"):
            await grandchild.pack_diff(name=name, version="v3")
    finally:
        for sb in [src, *started]:
            with contextlib.suppress(Exception):
                await sb.stop()  # type: ignore[attr-defined]


async def test_pack_of_a_paused_sandbox_keeps_it_paused(
    client: DSecClient, busybox_image: str
) -> None:
    job = "pk-job-" + secrets.token_hex(3)
    sb = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64, job_id=job)
    )
    try:
        await sb.run_shell("echo frozen-state > /root/s")
        await client.pause_job(job)
        env = await sb.pack_diff(name="pk-paused-" + secrets.token_hex(3))
        assert (await sb.refresh()).state is SandboxState.PAUSED
        child = await client.run_container(env.run_args(memory_limit_mb=64))
        try:
            assert (await child.run_shell("cat /root/s")).stdout == "frozen-state\n"
        finally:
            await child.stop()
    finally:
        await sb.stop()


async def test_only_builders_may_pack(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> None:
    principal = "runner-" + secrets.token_hex(3)
    key = await _key_for(platform, principal)
    # Sandboxes belong to projects: a key needs a role on the sandbox's project to see
    # it at all (dsec.apiserver.sandboxaccess), here runtime on the default project.
    await client.create_principal(principal)
    await client.grant(principal, "runtime", project="default")
    other = DSecClient(platform.url, key)
    await other.open()
    sb = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64)
    )
    try:
        handle = await other.get(sb.id)
        with pytest.raises(PermissionDenied, match="builder"):
            await handle.pack_diff(name="denied")
        with pytest.raises(PermissionDenied):
            await handle.fork(1)
        with pytest.raises(PermissionDenied):  # only the admin grants roles
            await other.grant_role(principal, "builder")
        await client.grant_role(principal, "builder")
        env = await handle.pack_diff(name="granted-" + secrets.token_hex(3))
        assert env.source_sandbox == sb.id
        await client.revoke_role(principal, "builder")
        with pytest.raises(PermissionDenied):
            await handle.pack_diff(name="denied")
        # a runtime key still runs sandboxes and pauses jobs
        assert (await handle.run_shell("echo ok")).stdout == "ok\n"
    finally:
        await sb.stop()
        await other.close()


async def test_fork_children_see_the_state_and_are_isolated(
    client: DSecClient, busybox_image: str
) -> None:
    parent = await client.run_container(
        DSecContainerRunArgs(container_image=busybox_image, memory_limit_mb=64)
    )
    children: list[object] = []
    try:
        await parent.run_shell("echo at-fork > /root/state; rm /bin/vi")
        kids = await parent.fork(3)
        children.extend(kids)
        assert len({k.id for k in kids}) == 3
        outs = await asyncio.gather(
            *(k.run_shell("cat /root/state; test -e /bin/vi || echo no-vi") for k in kids)
        )
        assert all(o.stdout == "at-fork\nno-vi\n" for o in outs)
        await kids[0].run_shell("echo child0 > /root/state; echo mine > /root/only0")
        await parent.run_shell("echo parent-later > /root/state")
        for k in kids[1:]:
            r = await k.run_shell("cat /root/state; test -e /root/only0 || echo isolated")
            assert r.stdout == "at-fork\nisolated\n"
        assert (await kids[0].run_shell("cat /root/state")).stdout == "child0\n"
        assert (await parent.run_shell("cat /root/state")).stdout == "parent-later\n"
        assert kids[0].info.labels.get("dsec.fork-of") == parent.id
    finally:
        for sb in [parent, *children]:
            with contextlib.suppress(Exception):
                await sb.stop()  # type: ignore[attr-defined]
