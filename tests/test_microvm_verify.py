"""The trusted verify step and protected paths for microVMs, for real: QEMU under TCG,
one platform for the module (``dsec up --backends microvm``), leak-checked at its end.

Every attack is first shown to forge a PASS in the agent's own world (the grader run
there, as an untrusted platform would), then the verify step's verdict must be FAIL:
the grader runs in a fresh verifier VM from the pristine layers, the agent's disk only
as data under the graded paths (dsec.backends.microvm.verify).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from dsec import DSecClient, DSecMicroVMRunArgs
from dsec.api.events import EventKind
from dsec.api.sandbox import SandboxState
from tests.conftest import PlatformProcess, platform_process

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU"),
    pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-utils"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

SECRET = "ANSWER-5b1e07c4"
# The honest grader: the agent's answer compared with the hidden one.
GRADER = "cmp -s /work/out.txt /grader/expected.txt"
# The agent's own writable disk, as its guest sees it (root there may open it raw).
RW_DEV = '$(for d in /sys/block/vd*; do [ "$(cat $d/serial)" = dsec-rw ] && echo ${d##*/}; done)'


@pytest.fixture(scope="module")
def vmplatform() -> Iterator[PlatformProcess]:
    with platform_process(DSEC_BACKENDS="microvm") as plat:
        from dsec import DSecSyncClient

        with DSecSyncClient(plat.url, plat.api_key) as c:
            c.build_image("busybox")
        try:
            yield plat
        finally:  # where the steps' time went (the log goes with the data dir)
            for line in plat.log_path.read_text(errors="replace").splitlines():
                if ": verify (" in line or "template" in line:
                    print(line[-200:])


@pytest.fixture
async def client(vmplatform: PlatformProcess) -> AsyncIterator[DSecClient]:
    c = DSecClient(vmplatform.url, vmplatform.api_key)
    await c.open()
    try:
        yield c
    finally:
        await c.close()


def spec(**kw: object) -> DSecMicroVMRunArgs:
    kw.setdefault("memory_limit_mb", 256)
    kw.setdefault("disk_limit_mb", 64)
    kw.setdefault("protected", [{"path": "/grader", "files": {"expected.txt": SECRET}}])
    return DSecMicroVMRunArgs.model_validate({"image": "busybox:latest", **kw})


async def sh(sb: object, cmd: str) -> tuple[int, str]:
    r = await sb.run_shell(cmd, timeout=60)  # type: ignore[attr-defined]
    return r.exit_code, r.stdout + r.stderr


def verifier_leftovers(platform: PlatformProcess, sandbox_id: str) -> list[str]:
    vid = sandbox_id + ".v"
    found = []
    if (platform.data_dir / "vms" / vid).exists():
        found.append("dir")
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and vid.encode() in (proc / "cmdline").read_bytes():
                found.append(f"process {proc.name}")
    return found


# The agent's code run the recommended way: as nobody, kept out of the answers and the
# result directory by Landlock (dsec-untrusted), in the verifier VM's kernel.
UNTRUSTED_GRADER = """
out=$($DSEC_UNTRUSTED sh /work/solution.sh) || exit 2
[ "$out" = "$(cat /grader/expected.txt)" ] || exit 3
$DSEC_UNTRUSTED cat /grader/expected.txt && exit 4
$DSEC_UNTRUSTED sh -c 'echo forged > /.dsec/result/verdict' && exit 5
[ "$($DSEC_UNTRUSTED id -u)" = 65534 ] || exit 6
exit 0
"""


async def test_honest_grader_protected_paths_and_modes(
    client: DSecClient, vmplatform: PlatformProcess
) -> None:
    sb = await client.run_microvm(spec(), timeout=300)
    try:
        # The answers are on no device of the agent's VM, nor anywhere in its tree.
        code, out = await sh(sb, "ls /grader; cat /sys/block/*/serial; echo")
        assert "dsec-p" not in out and "expected" not in out, out
        code, out = await sh(sb, "for f in /sys/block/vd*/serial; do cat $f; echo; done")
        assert sorted(out.split()) == ["dsec-l0", "dsec-rw"], out  # no protected drive
        # A wrong answer fails, a right one passes; isolated: the agent goes on.
        await sh(sb, "mkdir -p /work && echo wrong > /work/out.txt")
        t0 = time.monotonic()
        r = await sb.verify(GRADER, graded=["/work"], mode="isolated")
        first = time.monotonic() - t0
        assert not r.passed and r.error is None, r
        await sh(sb, f"printf %s {SECRET} > /work/out.txt")
        t0 = time.monotonic()
        r = await sb.verify(
            f"{GRADER} && echo ok > $DSEC_RESULT_DIR/verdict", graded=["/work"], mode="isolated"
        )
        second = time.monotonic() - t0
        assert r.passed, r
        assert r.results == {"verdict": "ok\n"}
        print(f"verify isolated: first {first:.2f}s, second {second:.2f}s")
        code, out = await sh(sb, "cat /work/out.txt")
        assert code == 0 and out == SECRET  # the agent continues, its work intact
        assert verifier_leftovers(vmplatform, sb.id) == []
        # Running the agent's code through $DSEC_UNTRUSTED: its output is graded, the
        # answers and the result directory are out of its reach.
        await sh(sb, f"printf 'printf %s {SECRET}\\n' > /work/solution.sh")
        r = await sb.verify(UNTRUSTED_GRADER, graded=["/work"], mode="isolated")
        assert r.passed, r
        # The grader's world is the pristine image: the agent's other files are not there.
        await sh(sb, "echo agent > /etc/agent-was-here")
        r = await sb.verify("test ! -e /etc/agent-was-here", graded=["/work"], mode="isolated")
        assert r.passed, r
        # fresh (the default): the sandbox ends stopped.
        t0 = time.monotonic()
        r = await sb.verify(GRADER, graded=["/work"])
        print(f"verify fresh: {time.monotonic() - t0:.2f}s")
        assert r.passed, r
        info = await sb.refresh()
        assert info.state == SandboxState.STOPPED
    finally:
        await sb.stop()


async def forged_then_failed(sb: object, attack: str, grader: str = GRADER) -> None:
    """Run ``attack`` as the agent, show ``grader`` passes in the agent's own world,
    then verify: the verdict must be FAIL."""
    code, out = await sh(sb, "mkdir -p /work && echo wrong > /work/out.txt && " + attack)
    assert code == 0, out
    code, out = await sh(sb, grader)
    assert code == 0, f"the attack does not forge a PASS in the agent's world: {out}"
    r = await sb.verify(grader, graded=["/work"], mode="isolated")  # type: ignore[attr-defined]
    assert not r.passed, r


async def test_a_request_held_by_a_long_verify_is_served_after_it(client: DSecClient) -> None:
    """An isolated verify holds the agent's VM stopped for the whole step; a request
    sent meanwhile waits. It must not count as a request the guest's mux never took
    (the link's stall detector, dsec.guest.channel): once the VM runs again, it is
    served, however long the verify lasted."""
    sb = await client.run_microvm(spec(), timeout=300)
    try:
        await sh(sb, "mkdir -p /work && echo held > /work/f")
        verify = asyncio.create_task(sb.verify("sleep 20", graded=["/work"], mode="isolated"))
        await asyncio.sleep(4)  # the agent's VM is held by now (a verifier boots for long)
        t0 = time.monotonic()
        assert await sb.read_file("/work/f") == b"held\n"
        print(f"the held read was served after {time.monotonic() - t0:.1f}s")
        r = await verify
        assert r.passed, r
        assert (await sb.refresh()).state is SandboxState.RUNNING
        code, out = await sh(sb, "cat /work/f")
        assert (code, out) == (0, "held\n")
    finally:
        await sb.stop()


async def test_replaced_system_binaries(client: DSecClient) -> None:
    """A PATH shadow in /usr/local/bin, then /bin/sh and busybox itself replaced (one
    VM, the attacks one after the other: each verify must still say FAIL)."""
    sb = await client.run_microvm(spec(), timeout=300)
    try:
        # busybox runs its own applets before a PATH search, so the forge is shown by
        # calling the PATH's cmp; in the verifier PATH finds no shadow (pristine image).
        await forged_then_failed(
            sb,
            "mkdir -p /usr/local/bin && printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/cmp && "
            "chmod 755 /usr/local/bin/cmp",
            grader='c=$(which cmp) && "$c" -s /work/out.txt /grader/expected.txt',
        )
        await forged_then_failed(
            sb,
            "mkdir -p /opt && cp /bin/busybox /opt/busybox && rm /bin/sh && "
            "printf '#!/opt/busybox sh\\nexit 0\\n' > /bin/sh && chmod 755 /bin/sh && "
            "rm /bin/busybox && printf '#!/opt/busybox sh\\nexit 0\\n' > /bin/busybox && "
            "/opt/busybox chmod 755 /bin/busybox",
        )
    finally:
        await sb.stop()


async def test_symlink_to_a_protected_path(client: DSecClient) -> None:
    """In the verifier the link would resolve to the answer itself (the forge a
    verifier that follows links would give): it is shown, never followed."""
    sb = await client.run_microvm(spec(), timeout=300)
    try:
        await sh(
            sb,
            "mkdir -p /work/d && ln -s /grader/expected.txt /work/out.txt && "
            "ln -s ../out.txt /work/d/inside && mkfifo /work/fifo",
        )
        r = await sb.verify(GRADER, graded=["/work"], mode="isolated")
        assert not r.passed, r
        # Reported as the container verifier reports what it leaves out: the link that
        # leaves the tree and the FIFO, not the link that stays inside it.
        assert sorted(x.path for x in r.refused) == ["/work/fifo", "/work/out.txt"], r.refused
        events = await client.events(sandbox=sb.id, kinds=[EventKind.GRADED_LINK_ESCAPE])
        assert events
        r = await sb.verify(
            '[ "$(readlink /work/out.txt)" = /grader/expected.txt ] && ! cat /work/out.txt',
            graded=["/work"],
            mode="isolated",
        )
        assert r.passed, r  # the link is there as data, and the kernel refuses to follow it
        # The graded root itself replaced by a link to the answers: refused, shown empty.
        grader = "cmp -s /work/expected.txt /grader/expected.txt"
        await sh(sb, "rm -rf /work && ln -s /grader /work")
        r = await sb.verify(grader, graded=["/work"], mode="isolated")
        assert not r.passed, r
        assert [x.path for x in r.refused] == ["/work"], r
    finally:
        await sb.stop()


async def test_layer_backed_protected_path(client: DSecClient, tmp_path: Path) -> None:
    src = tmp_path / "suite"
    (src / "tests").mkdir(parents=True)
    (src / "tests" / "answer.txt").write_text(SECRET)
    layer = await client.build_layer("mvm-grader-suite:v1", "dir", str(src), prefix="/")
    protected = [
        {"path": "/opt/grader", "layer": layer.ref},
        {"path": "/grader", "files": {"expected.txt": SECRET}},
    ]
    sb = await client.run_microvm(spec(protected=protected), timeout=300)
    try:
        code, out = await sh(sb, "ls -R /opt/grader /grader")
        assert code != 0 and "answer" not in out, out
        r = await sb.verify(
            "cmp -s /opt/grader/tests/answer.txt /grader/expected.txt",
            graded=["/work"],
            mode="isolated",
        )
        assert r.passed, r
        # Nothing of it can be written by the grader either (read-only EROFS).
        r = await sb.verify("echo x > /opt/grader/tests/answer.txt", graded=["/work"])
        assert not r.passed, r
    finally:
        await sb.stop()


SETXATTR_C = r"""
#include <stdio.h>
#include <string.h>
#include <sys/xattr.h>
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    if (setxattr(argv[1], argv[2], argv[3], strlen(argv[3]), 0)) { perror("setxattr"); return 1; }
    return 0;
}
"""


def setxattr_binary(tmp: Path) -> bytes:
    (tmp / "s.c").write_text(SETXATTR_C)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(tmp / "s"), str(tmp / "s.c")], check=True)
    return (tmp / "s").read_bytes()


async def test_crafted_overlay_redirect_xattr(client: DSecClient, tmp_path: Path) -> None:
    """The agent mounts its own disk a second time (root in its guest) and plants a
    trusted.overlay.redirect on its graded directory pointing at the answers."""
    sb = await client.run_microvm(spec(), timeout=300)
    try:
        await sb.write_file("/setxattr", setxattr_binary(tmp_path), mode=0o755)
        code, out = await sh(
            sb,
            f"mkdir -p /work/sub /mnt2 && sync && mount /dev/{RW_DEV} /mnt2 && "
            "/setxattr /mnt2/upper/work/sub trusted.overlay.redirect /grader && "
            "/setxattr /mnt2/upper/work/sub trusted.overlay.metacopy y; sync; umount /mnt2",
        )
        assert code == 0, f"the agent could not plant the xattr: {out}"
        r = await sb.verify(
            "test ! -e /work/sub/expected.txt && ! grep -rq ANSWER /work",
            graded=["/work"],
            mode="isolated",
        )
        assert r.passed, r  # the redirect was not followed: no answer under /work
    finally:
        await sb.stop()


async def test_hostile_agent_disk_fails_closed(
    client: DSecClient, vmplatform: PlatformProcess
) -> None:
    sb = await client.run_microvm(spec(), timeout=300)
    try:
        # First its upper/ swapped for a link: showing the pristine content in place of
        # its work could pass a grader it never satisfied, so the step fails closed.
        code, out = await sh(
            sb,
            f"mkdir -p /mnt2 && sync && mount /dev/{RW_DEV} /mnt2 && mv /mnt2/upper /mnt2/u2 && "
            "ln -s u2 /mnt2/upper && sync && umount /mnt2",
        )
        assert code == 0, out
        r = await sb.verify("true", graded=["/work"], mode="isolated")
        assert not r.passed and r.error and "upper" in r.error, r
        # Then garbage over its whole file system.
        await sh(sb, f"dd if=/dev/urandom of=/dev/{RW_DEV} bs=64k count=64 conv=fsync 2>&1")
        r = await sb.verify("true", graded=["/work"], mode="isolated")
        assert not r.passed and r.error, r
        print("corrupt disk:", r.error)
        assert "Traceback" not in r.error
        events = await client.events(sandbox=sb.id, kinds=[EventKind.SCAN_INCOMPLETE])
        assert events, "no scan_incomplete event"
        assert verifier_leftovers(vmplatform, sb.id) == []
        async with httpx.AsyncClient() as http:
            health = await http.get(f"{vmplatform.url}/v1/health", timeout=5)
        assert health.status_code == 200
        # The edge goes on: the same sandbox still runs commands.
        _, out = await sh(sb, "echo alive")
        assert out.strip() == "alive"
    finally:
        await sb.stop()


async def test_edge_crash_mid_verify(vmplatform: PlatformProcess) -> None:
    """The edge dies (SIGKILL) while a grader runs: the restarted edge ends the
    verifier and continues the agent's stopped VM, which answers again."""
    c = DSecClient(vmplatform.url, vmplatform.api_key)
    await c.open()
    sb = await c.run_microvm(spec(), timeout=300)
    sid = sb.id
    step = asyncio.create_task(sb.verify("sleep 120", graded=["/work"], mode="isolated"))
    try:
        deadline = time.monotonic() + 60
        while not any(p.startswith("process") for p in verifier_leftovers(vmplatform, sid)):
            assert time.monotonic() < deadline, "no verifier started"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        vmplatform.kill()
        with contextlib.suppress(Exception):
            await step
    finally:
        await c.close()
    vmplatform.start()
    c = DSecClient(vmplatform.url, vmplatform.api_key)
    await c.open()
    try:
        sb = await c.get(sid)
        _, out = await sh(sb, "echo alive")
        assert out.strip() == "alive"
        assert verifier_leftovers(vmplatform, sid) == []
        await sb.stop()
    finally:
        await c.close()


async def test_deletions_stay_deleted(client: DSecClient) -> None:
    """What the agent deleted under a graded path is not brought back from the
    pristine image: a whiteout shows the path empty (listed in ``refused``), a
    directory it re-made (opaque) hides the pristine content below it."""
    sb = await client.run_microvm(spec(), timeout=300)
    try:
        code, out = await sh(sb, "rm -rf /home && mkdir -p /home/new && echo x > /home/new/f")
        assert code == 0, out
        r = await sb.verify(
            "[ -f /home/new/f ] && [ ! -e /home/user ]", graded=["/home"], mode="isolated"
        )
        assert r.passed and r.refused == [], r
        r = await sb.verify('[ -z "$(ls -A /home/user)" ]', graded=["/home/user"], mode="isolated")
        assert r.passed, r
        assert [(x.path, x.reason) for x in r.refused] == [("/home/user", "deleted by the agent")]
    finally:
        await sb.stop()


def test_boot_parameters_of_a_verifier_are_checked() -> None:
    """The host refuses what dsec-vminit would power the verifier off for."""
    from dsec.errors import InvalidArgument
    from dsec.guest.bootparams import BootParams

    ok = BootParams(
        layers=2, rw=False, verify=True, graded=("/work", "/root"), protected=("/grader",)
    )
    assert ok.params()["graded"] == "/work,/root" and ok.params()["verify"] == "1"
    for bad in (
        {"graded": ("/etc",)},  # a system directory
        {"graded": ("/w,x",)},  # splits the list
        {"graded": ("/a/../b",)},
        {"graded": tuple(f"/w{i}" for i in range(17))},
        {"protected": ("/a b",)},
        {"protected": ("/a:b",)},
        {"protected": ("relative",)},
        {"rw": True},  # a verifier has no disk of its own
        {"verify": False},  # graded paths outside a verifier
    ):
        args: dict[str, object] = {
            "layers": 1,
            "rw": False,
            "verify": True,
            "graded": ("/work",),
            **bad,
        }
        with pytest.raises(InvalidArgument):
            BootParams(**args)  # type: ignore[arg-type]
