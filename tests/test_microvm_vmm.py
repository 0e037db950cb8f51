"""The microVM VMM layer against real QEMU under TCG: command line, jailed boot, pause
and resume of a running counter, template snapshots, adoption after the starter died,
and the accelerator probe.

Every QEMU started here is killed and every file removed in the fixtures' teardown,
also when a test fails; the last test checks that no QEMU of ours is left.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsec.backends.microvm import accel, snapshot
from dsec.backends.microvm.jail import Jail, vm_uid
from dsec.backends.microvm.qemu import (
    Drive,
    NetAttachment,
    QemuProcess,
    VMConfig,
    build_argv,
    find_running,
)
from dsec.backends.microvm.qmp import Qmp
from dsec.errors import BackendError, InvalidArgument
from dsec.resources import cgroups
from tests.microvm_guest import GuestKernel, guest_kernel, initramfs

pytestmark = pytest.mark.root
REPO = Path(__file__).resolve().parent.parent

# One guest for every test: prints a marker, optionally (dsec.wait=1, the template
# mode) blocks until the host writes a line on the agent port, then counts in a
# shell variable (guest memory) on the console.
GUEST = """echo DSEC-UP
if grep -q dsec.wait=1 /proc/cmdline; then
  until read -r go < /dev/vport0p1; do sleep 0.05; done
  echo "GOT $go"
fi
late
for b in /sys/block/vd*; do
  [ -e "$b" ] || continue
  echo "DISK $(cat $b/serial) ro=$(cat $b/ro) size=$(cat $b/size) $(head -c 12 /dev/${b##*/})"
  if [ "$(cat $b/serial)" = dsec-rw ]; then echo written-by-guest > /dev/${b##*/}; sync; fi
  if [ "$(cat $b/serial)" = dsec-l0 ]; then
    echo x > /dev/${b##*/} 2>/dev/null || echo RO-REFUSED
  fi
done
if ip link show eth0 >/dev/null 2>&1; then
  ip addr add 10.213.77.2/24 dev eth0 && ip link set eth0 up
  ping -c 1 -W 10 10.213.77.1 >/dev/null && echo PING-OK || echo PING-FAIL
fi
echo DSEC-CHECKED
i=0
while :; do i=$((i+1)); echo "count $i"; sleep 0.2; done
"""


@dataclass
class World:
    root: Path
    kernel: GuestKernel
    initrd: Path
    procs: list[QemuProcess] = field(default_factory=list)
    clients: list[Qmp] = field(default_factory=list)
    n: int = 0

    def config(self, **kw: object) -> VMConfig:
        self.n += 1
        d = self.root / f"vm{self.n}"
        d.mkdir(mode=0o700)
        kw.setdefault("initrd", self.initrd)
        return VMConfig(
            kernel=self.kernel.vmlinuz,
            agent_socket=d / "agent.sock",
            qmp_socket=d / "qmp.sock",
            log_path=self.root / f"vm{self.n}.log",
            **kw,  # type: ignore[arg-type]
        )

    def track(self, proc: QemuProcess, qmp: Qmp | None = None) -> None:
        self.procs.append(proc)
        if qmp is not None:
            self.clients.append(qmp)

    async def boot(self, config: VMConfig, jail: Jail | None = None) -> tuple[QemuProcess, Qmp]:
        proc = QemuProcess.launch(config, prefix=jail.prefix(config) if jail else ())
        self.track(proc)
        try:
            qmp = await Qmp.connect(config.qmp_socket, alive=proc.is_alive)
        except BackendError as exc:
            raise BackendError(f"{exc}; QEMU: {proc.log_tail()}") from exc
        self.clients.append(qmp)
        return proc, qmp


@pytest.fixture(scope="module")
def guest_files() -> Iterator[tuple[Path, GuestKernel, Path]]:
    root = Path(tempfile.mkdtemp(prefix="dsec-vmm-test-"))
    os.chmod(root, 0o755)  # the jailed QEMU (its own uid) reads the initrd here
    try:
        kernel = guest_kernel()
        yield root, kernel, initramfs(kernel, GUEST, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def world(guest_files: tuple[Path, GuestKernel, Path]) -> AsyncIterator[World]:
    base, kernel, initrd = guest_files
    root = Path(tempfile.mkdtemp(prefix="w-", dir=base))
    os.chmod(root, 0o755)
    w = World(root, kernel, initrd)
    try:
        yield w
    finally:
        for qmp in w.clients:
            await qmp.close()
        for proc in w.procs:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def counts(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"count (\d+)", text)]


def test_argv_shape(tmp_path: Path) -> None:
    k = tmp_path / "k"
    config = VMConfig(
        kernel=k,
        initrd=None,
        agent_socket=tmp_path / "a",
        qmp_socket=tmp_path / "q",
        log_path=tmp_path / "l",
        params={"dsec.layers": "2", "dsec.rw": "1"},
        drives=(Drive(tmp_path / "l0", "dsec-l0"), Drive(tmp_path / "rw", "dsec-rw", False)),
        incoming=tmp_path / "snap",
    )
    argv = build_argv(config, binary="qemu")
    joined = " ".join(argv)
    assert argv[:3] == ["qemu", "-M", "microvm"]
    for flag in ("-nodefaults", "-no-user-config", "-nographic", "-no-reboot"):
        assert flag in argv
    cmdline = argv[argv.index("-append") + 1]
    assert "panic=-1" in cmdline and "tsc_early_khz=" in cmdline and "dsec.layers=2" in cmdline
    assert "serial=dsec-l0" in joined and "readonly=on" in joined and "readonly=off" in joined
    assert argv[-2:] == ["-incoming", "defer"]
    assert "-initrd" not in argv
    assert "-sandbox" in argv  # Debian's QEMU has seccomp
    kvm = build_argv(VMConfig(**{**config.__dict__, "accel": "kvm"}), binary="qemu")
    assert "tsc_early_khz" not in " ".join(kvm) and "host" in kvm
    with pytest.raises(BackendError):
        build_argv(VMConfig(**{**config.__dict__, "params": {"a b": "c"}}), binary="qemu")


async def test_jailed_boot_pause_resume_keeps_counting(world: World) -> None:
    host = cgroups.detect()
    rel = f"dsec-test-vmm-{os.getpid()}"
    for d in host.dirs(rel):
        d.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # v1 cpuset starts empty
            if (d / name).exists():
                (d / name).write_text((d.parent / name).read_text())
    try:
        jail = Jail(cgroup_dirs=tuple(host.dirs(rel)))
        config = world.config()
        t0 = time.monotonic()
        proc, qmp = await world.boot(config, jail)
        await qmp.wait_console("count 3", 60)
        print(f"\ncold boot to counting: {time.monotonic() - t0:.2f}s")

        # The jail: own uid, no capabilities, no_new_privs, seccomp, own namespaces,
        # in the sandbox's cgroup.
        status = await asyncio.to_thread(Path(f"/proc/{proc.pid}/status").read_text)
        uid = vm_uid(proc.pid)
        assert re.search(rf"^Uid:\s+{uid}\s+{uid}\s+{uid}\s+{uid}$", status, re.M)
        assert re.search(r"^CapEff:\s+0+$", status, re.M)
        assert re.search(r"^CapBnd:\s+0+$", status, re.M)
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M)
        assert re.search(r"^Seccomp:\s+2$", status, re.M)
        for ns in ("mnt", "net", "ipc", "uts"):
            assert os.readlink(f"/proc/{proc.pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
        assert proc.pid in host.pids(rel)
        assert config.qmp_socket.stat().st_uid == uid

        before = await qmp.console()
        rss = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        assert rss is not None
        print(f"QEMU RSS before pause: {int(rss.group(1)) >> 10} MiB (freed by the pause)")
        snap = world.root / "pause.vmstate"
        stats = await snapshot.pause_to_file(proc, qmp, snap)
        assert not proc.is_alive()  # the process really ended while paused
        assert proc.pid not in host.pids(rel)
        print(f"pause of a 256 MiB guest: {stats.seconds * 1000:.0f} ms, {stats.size >> 20} MiB")
        last = max(counts(before))

        t1 = time.monotonic()
        proc2, qmp2 = await snapshot.resume_from_file(config, snap, prefix=jail.prefix(config))
        world.track(proc2, qmp2)
        print(f"resume: {(time.monotonic() - t1) * 1000:.0f} ms")
        assert not snap.exists()
        text = await qmp2.wait_console(f"count {last + 3}", 30)
        after = counts(text)
        # It went on from where it was (a count or two may have been printed between
        # our last console read and the stop), and did not start again from 1.
        assert last < after[0] <= last + 5, (last, after[:3])
        assert 1 not in after
        assert proc2.pid in host.pids(rel)
        proc2.kill()
        assert not proc2.is_alive()
    finally:
        host.kill_and_remove(rel)


TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


@pytest.fixture
def tap() -> Iterator[tuple[str, int]]:
    """A tap in the host netns (10.213.77.1/24), gone when its fd is closed."""
    name = f"dsvt{os.getpid() % 100000}"
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
        subprocess.run(["ip", "addr", "add", "10.213.77.1/24", "dev", name], check=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        yield name, fd
    finally:
        os.close(fd)
    assert not Path(f"/sys/class/net/{name}").exists()


async def test_jailed_vm_gets_its_drives_and_tap(tap: tuple[str, int], world: World) -> None:
    """Only through the jail's binds and the inherited tap fd (QEMU sits in an empty
    netns): the guest sees both drives by serial, writes the writable one (chowned to
    QEMU's uid), cannot write the read-only one, and reaches the host over the tap."""
    layer = _image(world.root / "layer.img", b"layer-content", 1 << 20, 0o644)
    disk = _image(world.root / "rw.img", b"", 8 << 20, 0o600)
    config = world.config(
        drives=(Drive(layer, "dsec-l0"), Drive(disk, "dsec-rw", readonly=False)),
        net=NetAttachment(tap[1], "52:54:00:12:34:56"),
    )
    proc, qmp = await world.boot(config, Jail())
    text = await qmp.wait_console("DSEC-CHECKED", 90)
    assert re.search(r"DISK dsec-l0 ro=1 size=2048 layer-conten", text)
    assert re.search(r"DISK dsec-rw ro=0 size=16384 ", text)
    assert "RO-REFUSED" in text
    assert "PING-OK" in text, text
    assert disk.stat().st_uid == vm_uid(proc.pid)
    assert (await asyncio.to_thread(disk.read_bytes))[:16] == b"written-by-guest"
    assert (await asyncio.to_thread(layer.read_bytes))[:13] == b"layer-content"
    assert os.readlink(f"/proc/{proc.pid}/ns/net") != os.readlink("/proc/self/ns/net")


async def _say(agent_socket: Path, line: str, qmp: Qmp, answer: str) -> str:
    """Write ``line`` on the agent port and keep the connection open until the guest
    printed ``answer`` (closing earlier could race with a slow guest's open)."""
    _reader, writer = await asyncio.open_unix_connection(str(agent_socket))
    try:
        writer.write(line.encode() + b"\n")
        await writer.drain()
        return await qmp.wait_console(answer, 60)
    finally:
        writer.close()
        await writer.wait_closed()


def _image(path: Path, content: bytes, size: int, mode: int) -> Path:
    path.write_bytes(content.ljust(size, b"\0"))
    path.chmod(mode)
    return path


async def test_template_snapshot_starts_many_vms(world: World) -> None:
    """One waiting guest saved once; three VMs restored from that one read-only
    file, each with its OWN drives (other files, other sizes) that the guest probes
    only after the GO, as the real guest does in template mode."""
    template_dir = world.root / "templates"
    params = {"dsec.wait": "1"}

    def drives(tag: str, rw_mib: int) -> tuple[Drive, ...]:
        layer = _image(world.root / f"l0-{tag}.img", f"layer-{tag}".encode(), 1 << 20, 0o644)
        disk = _image(world.root / f"rw-{tag}.img", b"", rw_mib << 20, 0o600)
        return (Drive(layer, "dsec-l0"), Drive(disk, "dsec-rw", readonly=False))

    config = world.config(params=params, drives=drives("tmpl", 4))
    t0 = time.monotonic()
    proc, qmp = await world.boot(config)
    await qmp.wait_console("DSEC-UP", 60)
    await asyncio.sleep(0.3)  # into the wait loop
    cold = time.monotonic() - t0
    path = await snapshot.save_template(proc, qmp, config, template_dir)
    assert path == snapshot.template_path(template_dir, config)
    assert not os.stat(path).st_mode & 0o222 and not proc.is_alive()

    # Other drive files and VM dirs are not part of the key; the machine's shape is.
    assert world.config(params=params, drives=drives("x", 8)).machine_key() == config.machine_key()
    assert world.config(params=params, memory_mb=512).machine_key() != config.machine_key()

    async def one(i: int) -> tuple[float, float]:
        cfg = world.config(params=params, drives=drives(f"vm{i}", 4 + 4 * i))
        t = time.monotonic()
        p, q = await snapshot.restore_template(cfg, template_dir, prefix=Jail().prefix(cfg))
        world.track(p, q)
        restored = time.monotonic() - t
        await _say(cfg.agent_socket, f"go-{i}", q, f"GOT go-{i}")
        text = await q.wait_console("DSEC-CHECKED", 60)
        assert f"DISK dsec-l0 ro=1 size=2048 layer-vm{i}" in text, text
        assert f"DISK dsec-rw ro=0 size={(4 + 4 * i) * 2048} " in text, text
        assert (await asyncio.to_thread(cfg.drives[1].path.read_bytes))[:7] == b"written"
        return restored, time.monotonic() - t

    times = await asyncio.gather(*(one(i) for i in range(3)))
    print(
        f"\ncold boot to waiting: {cold:.2f}s; template restore to running: "
        + ", ".join(
            f"{r * 1000:.0f} ms (guest checked its drives at {a * 1000:.0f} ms)" for r, a in times
        )
    )
    assert all(r < cold for r, _ in times)
    with pytest.raises(BackendError):
        await snapshot.restore_template(world.config(memory_mb=128), template_dir)


async def test_guest_end_keeps_qemu_for_its_console(world: World) -> None:
    """pid 1 exits (a kernel panic, panic=-1): QEMU does not exit but pauses in
    'shutdown', so the panic is still readable; then kill it."""
    config = world.config(initrd=initramfs(world.kernel, "echo GUEST-BYE\nexit 3\n", world.root))
    proc, qmp = await world.boot(config)
    await qmp.wait_console("Attempted to kill init", 60)
    deadline = time.monotonic() + 10
    while not await qmp.guest_ended():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert proc.is_alive()
    assert "GUEST-BYE" in await qmp.console()
    proc.kill()
    assert not proc.is_alive()


STARTER = """
import json, sys
from pathlib import Path
from dsec.backends.microvm.qemu import QemuProcess, VMConfig
c = json.loads(sys.argv[1])
cfg = VMConfig(kernel=Path(c["kernel"]), initrd=Path(c["initrd"]),
               agent_socket=Path(c["agent"]), qmp_socket=Path(c["qmp"]), log_path=Path(c["log"]))
p = QemuProcess.launch(cfg)
print(json.dumps({"pid": p.pid, "start": p.start_time}))
"""


async def test_qemu_outlives_its_starter_and_is_adopted(world: World) -> None:
    config = world.config()
    spec = {
        "kernel": str(config.kernel),
        "initrd": str(config.initrd),
        "agent": str(config.agent_socket),
        "qmp": str(config.qmp_socket),
        "log": str(config.log_path),
    }
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", STARTER, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=60,
    )
    info = json.loads(out.stdout)
    proc = QemuProcess.adopt(info["pid"], info["start"], config.qmp_socket, config.log_path)
    world.track(proc)  # killed in teardown even if an assert below fails
    assert proc.is_alive()  # the starter is gone, QEMU is not
    qmp = await Qmp.connect(config.qmp_socket)
    world.clients.append(qmp)
    await qmp.wait_console("count 1", 60)
    assert await qmp.status() == "running"
    swept = find_running(world.root)
    assert [(p.pid, p.start_time) for p in swept] == [(proc.pid, proc.start_time)]
    with pytest.raises(BackendError):
        QemuProcess.adopt(info["pid"], info["start"] + 1, config.qmp_socket, config.log_path)
    proc.kill()
    assert not proc.is_alive()
    proc.kill()  # idempotent


async def test_accelerator_probe(
    guest_files: tuple[Path, GuestKernel, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DSEC_CACHE_DIR", str(tmp_path))
    kernel = guest_files[1].vmlinuz
    monkeypatch.setenv(accel.ENV, "tcg")
    forced = await accel.probe_accelerator(kernel)
    assert forced.accel == "tcg" and forced.forced
    monkeypatch.setenv(accel.ENV, "bogus")
    with pytest.raises(InvalidArgument):
        await accel.probe_accelerator(kernel)
    monkeypatch.delenv(accel.ENV)

    t0 = time.monotonic()
    choice = await accel.probe_accelerator(kernel, deadline=3.0)
    took = time.monotonic() - t0
    print(f"\nprobe: {choice.accel} in {took:.2f}s ({choice.reason})")
    assert took < 10
    pvm_only = await asyncio.to_thread(Path("/sys/module/kvm_pvm").exists)
    if accel.kvm_device_usable() is None and pvm_only:
        assert choice.accel == "tcg"  # PVM-only KVM: detected, not used
        assert "KVM" in choice.reason
    again = await accel.probe_accelerator(kernel)
    assert again.cached and again.accel == choice.accel and again.reason == choice.reason


async def test_forced_kvm_that_cannot_boot_fails_typed(
    world: World, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """DSEC_MICROVM_ACCEL=kvm on a host whose KVM cannot run our guest: a typed error
    within the boot deadline, never a hang."""
    monkeypatch.setenv("DSEC_CACHE_DIR", str(tmp_path))
    if accel.kvm_device_usable() is not None:
        pytest.skip("no usable /dev/kvm at all: the forced choice itself is refused")
    choice = await accel.probe_accelerator(world.kernel.vmlinuz, use_cache=False, deadline=3.0)
    if choice.accel == "kvm":
        pytest.skip("KVM boots guests on this host: nothing fails")
    monkeypatch.setenv(accel.ENV, "kvm")
    forced = await accel.probe_accelerator(world.kernel.vmlinuz)
    assert forced.accel == "kvm" and forced.forced
    t0 = time.monotonic()
    with pytest.raises(BackendError):
        _proc, qmp = await world.boot(world.config(accel=forced.accel))
        await qmp.wait_console("DSEC-UP", 10)
    assert time.monotonic() - t0 < 15


def test_no_qemu_left(guest_files: tuple[Path, GuestKernel, Path]) -> None:
    root = str(guest_files[0])
    left = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if root in cmd and stat[stat.rindex(")") + 2] != "Z":
                left.append(pid)
    assert not left
