"""FullVM backend: any OS from a VM image under QEMU (q35), its own guest agent, and
computer use through QMP.

Create = the image's blobs (disk, and kernel/initrd for a direct boot) from the layer
store, a private qcow2 overlay of the disk capped by ``disk_limit_mb``
(dsec.backends.fullvm.disk), the sandbox's cgroup, QEMU started jailed like a
microVM's (dsec.backends.microvm.jail and qemu: its own uid, namespaces, no
capabilities, the console in a bounded ring) on the q35 command line of machine.py,
then the standard QEMU guest agent (qga.py) until it answers a sync.

Job pause is a microVM's: SIGSTOP, then the VM's memory and device state saved to a
file through QMP and QEMU ended; resume starts the same command line again
(``machine.Launch``, kept next to the VM) with ``-incoming`` and restores the file.

Sessions, PTYs, streaming and background processes are DSec's own agent's
(agentlink.py): every VM gets its ``dsec.agent`` port, and a VM whose image runs the
agent there (debian-desktop does) declares ``sessions`` once the agent answers a
probe after qemu-ga (again after a resume, a restore or an edge restart); then
commands and files go through it too, the data path of containers and microVMs
(dsec.backends.agentpath). An image without it keeps qemu-ga's one-shot commands and
files, and the edge refuses sessions with 501 (``capabilities_of``). Not yet: verify
steps.

A snapshot of a VM with network rules keeps its NIC and rules (``VMMachine.nic``,
``network_rules``); a sandbox started from it gets a new slot, tap and lease (its own
rules, or the saved ones when its spec names none: ``spec_for_image``), and its NIC's
cable is unplugged and replugged after the restore (nic.relink) so the guest's DHCP
client asks again and moves to the new address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from dsec.api.desktop import ComputerAction
from dsec.api.events import AuditKind
from dsec.api.exec import ExecRequest, ExecResult
from dsec.api.images import ImageInfo
from dsec.api.spec import BackendKind, DSecFullVMRunArgs, RunArgs
from dsec.backends.agentpath import AgentDataPath
from dsec.backends.base import (
    Backend,
    BackendHost,
    Capability,
    CreateInput,
    ReclaimFigures,
    SandboxRecord,
)
from dsec.backends.fullvm import capture, guestops, nic, restore
from dsec.backends.fullvm.agentlink import OPEN_WAIT, RELINK_WAIT, AgentLink
from dsec.backends.fullvm.disk import create_overlay, overlay_size
from dsec.backends.fullvm.display import Display
from dsec.backends.fullvm.facts import FullVMFacts
from dsec.backends.fullvm.machine import (
    AGENT_SOCKET,
    OVMF_CODE,
    OVMF_VARS,
    VNC_SOCKET,
    DirectBoot,
    FullVMConfig,
    Launch,
)
from dsec.backends.fullvm.qga import GuestAgent, GuestAgentError, GuestCommandError
from dsec.backends.microvm import snapshot
from dsec.backends.microvm.accel import AccelChoice, probe_accelerator
from dsec.backends.microvm.jail import Jail, vm_uid
from dsec.backends.microvm.qemu import QemuProcess, find_running
from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.backends.qemuvm import QemuVMBackend, last_line, undo_failed_create
from dsec.errors import (
    BackendError,
    DSecError,
    FileNotFound,
    InvalidArgument,
    Unsupported,
)
from dsec.guest.channel import HoldWatch
from dsec.images.mounts import LayerMounts
from dsec.images.vmdisk import DiskInfo, VMImage, VMMachine
from dsec.net.vmtap import VMNetAttachment, attach_vm, attach_vm_ready, link_ready
from dsec.resources import qos
from dsec.resources.cgroups import CgroupHost
from dsec.security.audit import AuditSink

log = logging.getLogger(__name__)

MiB = 1 << 20
# QEMU's own memory beside the guest's RAM: TCG's translation cache (64 MiB), the
# VGA's 16 MiB of video memory, firmware and device state.
VMM_OVERHEAD_MB = 256
MIN_MEMORY_MB = 128
QEMU_PIDS = 256
BOOT_TIMEOUT = 300.0  # seconds from QEMU's start to a guest agent that answers
GUEST_END_POLL = 2.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROOT_USERS = (None, "root", "0", "0:0")
LAUNCH_FILE = "launch.json"  # machine.Launch: how to start this VM's QEMU again


def fullvm_spec(rec: SandboxRecord | CreateInput) -> DSecFullVMRunArgs:
    if not isinstance(rec.spec, DSecFullVMRunArgs):
        raise BackendError(f"sandbox {rec.id} has a {rec.spec.backend} spec, not a fullvm one")
    return rec.spec


@dataclass
class _VM:
    """The live parts of one VM in this edge process (the record's facts persist).
    ``proc`` is None while the VM is paused to its file (no QEMU); ``restoring`` is
    the restore of a resumed one, which every request waits for."""

    dir: Path
    launch: Launch
    proc: QemuProcess | None
    agent: GuestAgent
    display: Display
    link: AgentLink | None = None  # DSec's agent port (None: launched without one)
    relinking: asyncio.Task[None] | None = None
    qmp: Qmp | None = None
    ended: str | None = None
    stopped: bool = False  # SIGSTOPped by a pause: QMP would not answer
    restoring: asyncio.Task[None] | None = None
    qmp_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def snapshot(self) -> Path:
        return self.dir / "state.snap"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def busy(self) -> bool:
        """Paused, or being restored: not for the guest-end watcher to look at."""
        return self.stopped or (self.restoring is not None and not self.restoring.done())

    async def connect_qmp(self) -> Qmp:
        """One QMP link, opened on first use (QEMU serves one client at a time)."""
        async with self.qmp_lock:
            proc = self.proc
            if proc is None:
                raise BackendError("the VM has no running VMM (paused to its file)")
            if self.qmp is None:
                self.qmp = await Qmp.connect(proc.qmp_socket, alive=proc.is_alive)
            return self.qmp

    async def close(self) -> None:
        """Drop this process's links to the VM (QEMU itself runs on)."""
        if self.relinking is not None and not self.relinking.done():
            self.relinking.cancel()
            with contextlib.suppress(BaseException):
                await self.relinking
        await self.agent.close()
        if self.link is not None:
            await self.link.close()
        if self.qmp is not None:
            qmp, self.qmp = self.qmp, None
            with contextlib.suppress(Exception):
                await qmp.close()

    async def kill(self) -> None:
        """End the restore in flight, every link and QEMU; idempotent."""
        if self.restoring is not None and not self.restoring.done():
            self.restoring.cancel()
            with contextlib.suppress(BaseException):
                await self.restoring
        await self.close()
        if self.proc is not None:
            proc, self.proc = self.proc, None
            await asyncio.to_thread(proc.kill)


class FullVMBackend(QemuVMBackend, AgentDataPath, Backend):
    kind = BackendKind.FULLVM
    capabilities = frozenset(
        {
            Capability.FILES,
            Capability.DISK_LIMIT,
            Capability.COMPUTER_USE,
            Capability.PAUSE,
            Capability.SNAPSHOT,
            Capability.NETWORK_RULES,
            Capability.QOS,
        }
    )
    network_device: ClassVar[Literal["veth", "tap"]] = "tap"
    vmm_overhead_mb = VMM_OVERHEAD_MB
    min_memory_mb = MIN_MEMORY_MB
    min_memory_why = "firmware and a booting OS"
    vm_noun = "fullvm"
    destroy_needs_resume = False  # SIGKILL ends a stopped QEMU; a saved one has no process
    reclaim_drops_agent_links = True  # QEMU ends with its guest agent link

    @classmethod
    def probe(cls) -> str | None:
        if os.geteuid() != 0:
            return "needs root (cgroups, the QEMU jail)"
        if not os.path.ismount("/sys/fs/cgroup"):
            return "no cgroup file system at /sys/fs/cgroup"
        for tool, package in (
            ("qemu-system-x86_64", "qemu-system-x86"),
            ("qemu-img", "qemu-utils"),
        ):
            if shutil.which(tool) is None:
                return f"no {tool} on PATH (apt-get install {package})"
        return None

    @classmethod
    def from_host(cls, host: BackendHost) -> Self:
        return cls(
            vms_dir=host.config.data_dir / "fullvms",
            layers=host.layers,
            cgroups=host.cgroups,
            cgroup_parent=f"dsec/{host.config.edge_id}-fvm",
            audit=host.audit,
        )

    def __init__(
        self,
        *,
        vms_dir: Path,
        layers: LayerMounts,
        cgroups: CgroupHost,
        cgroup_parent: str,
        audit: AuditSink,
    ) -> None:
        self.vms_dir = vms_dir
        self.layers = layers
        self.cgroups = cgroups
        self.cgroup_parent = cgroup_parent.strip("/")
        self.audit = audit
        self.host_cpus = os.cpu_count() or 1
        self._vms: dict[str, _VM] = {}
        self._accel: AccelChoice | None = None

    # -- host -----------------------------------------------------------------------
    async def start(self) -> None:
        self.vms_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.vms_dir, 0o700)

    async def accelerator(self) -> AccelChoice:
        """KVM only if it really boots a guest (the microVM probe and its cache)."""
        if self._accel is None:
            from dsec.guest.kernel import guest_kernel

            kernel = await asyncio.to_thread(guest_kernel)
            self._accel = await probe_accelerator(kernel.vmlinuz)
        return self._accel

    def details(self) -> Mapping[str, str]:
        """The accelerator and whether latency VMs get core scheduling (detected)."""
        if self._accel is None:
            accel = {"accelerator": "not probed yet (at the first fullvm create)"}
        else:
            accel = {"accelerator": self._accel.accel, "accelerator_reason": self._accel.reason}
        return accel | qos.health_detail()

    async def close(self) -> None:
        for vm in list(self._vms.values()):
            await vm.close()  # QEMU runs on: the next edge adopts it
        self._vms.clear()
        await self.remove_parent_cgroup_if_empty()

    # -- DSec's agent, when the image has it (agentlink.py) ----------------------------
    def agent_socket(self, sandbox_id: str) -> Path:
        """The edge's socket of the VM's agent (root's; QEMU's chardev is in q/)."""
        return self.vm_dir(sandbox_id) / "agent.sock"

    def _link(self, sid: str, launch: Launch) -> AgentLink | None:
        chardev = launch.agent_socket
        return AgentLink(chardev, self.agent_socket(sid)) if chardev is not None else None

    def _has_agent(self, sid: str) -> bool:
        vm = self._vms.get(sid)
        return vm is not None and vm.link is not None and vm.link.ready

    def capabilities_of(self, rec: SandboxRecord) -> frozenset[Capability]:
        """Sessions (PTY, streaming, the agent's files) for a VM whose agent answered."""
        if self._has_agent(rec.id):
            return self.capabilities | {Capability.SESSIONS}
        return self.capabilities

    async def _probe_agent(self, sid: str, vm: _VM, *, open_wait: float = 0.0) -> None:
        """Link DSec's agent if the guest runs it (quick when it does not)."""
        if vm.link is None or vm.proc is None:
            return
        if await vm.link.probe(await vm.connect_qmp(), open_wait=open_wait):
            log.info("fullvm %s: DSec's agent answers: sessions on", sid)

    async def _relink(self, sid: str, vm: _VM, qmp: Qmp) -> None:
        """In the background, one probe at a time: a ready agent whose channel broke
        (or was dropped by a failed pause) gets a new one, and a failure turns its
        sessions off; a VM without a linked agent whose guest opened the port since
        (``AgentLink.look_again``) gets linked, and its sessions turn (back) on."""
        if vm.link is None or (vm.relinking is not None and not vm.relinking.done()):
            return
        if vm.link.needs_relink():
            log.warning("fullvm %s: agent channel lost, linking again", sid)
            wait = RELINK_WAIT
        elif await vm.link.look_again(qmp):
            log.info("fullvm %s: the guest opened DSec's agent port: linking it", sid)
            wait = 0.0
        else:
            return
        vm.relinking = asyncio.get_running_loop().create_task(
            self._probe_agent(sid, vm, open_wait=wait), name=f"fullvm-relink-{sid}"
        )

    # -- facts (paths, memory: dsec.backends.qemuvm) ----------------------------------
    def load_facts(self, data: Mapping[str, Any]) -> FullVMFacts:
        return FullVMFacts.from_json(data)

    def facts(self, rec: SandboxRecord) -> FullVMFacts:
        if not isinstance(rec.facts, FullVMFacts):
            rec.facts = FullVMFacts.of(rec.facts)
        return rec.facts

    # -- limits -----------------------------------------------------------------------
    def check_limits(self, spec: Any) -> None:
        self.check_memory(spec)
        if isinstance(spec, DSecFullVMRunArgs) and spec.firmware == "uefi":
            missing = [str(f) for f in (OVMF_CODE, OVMF_VARS) if not f.is_file()]
            if missing:
                raise Unsupported(
                    f"firmware='uefi' needs OVMF on this host ({', '.join(missing)} missing: "
                    "apt-get install ovmf)",
                    backend=self.kind.value,
                    capability="firmware_uefi",
                )

    # -- lifecycle --------------------------------------------------------------------
    async def create(self, inp: CreateInput) -> FullVMFacts:
        sid, spec = inp.id, fullvm_spec(inp)
        image = VMImage.of(inp.image.config, spec.vm_image)
        saved = restore.check(image, spec)  # a snapshot image: its machine, checked
        if saved is not None and saved.nic != (inp.net is not None):
            raise Unsupported(
                (
                    f"snapshot {spec.vm_image} was saved from a VM with network rules: a "
                    "sandbox started from it needs a network (give network_rules, or none "
                    "to keep the saved ones, on an edge that enforces them)"
                )
                if saved.nic
                else (
                    "a sandbox started from a snapshot has no NIC (the saved machine had "
                    "none): network_rules are not supported with it"
                ),
                backend=self.kind.value,
                capability="snapshot_network_rules",
            )
        root = self.vm_dir(sid)
        facts = FullVMFacts(dir=root)
        vm: _VM | None = None
        tap: VMNetAttachment | None = None
        try:
            accel = await self.accelerator()
            if saved is not None:
                restore.check_accel(saved, accel.accel)
            root.mkdir(mode=0o700)
            (root / "q").mkdir(mode=0o700)
            await self.layers.prepare(image.blobs(), "eager")
            blobs = {d: await asyncio.to_thread(self.layers.store.verify, d) for d in image.blobs()}
            size = overlay_size(DiskInfo(image.format, image.virtual_size), spec.disk_limit_mb)
            if saved is not None:  # the restored guest knows its disk's size already
                size = image.virtual_size
            overlay = root / "disk.qcow2"
            await asyncio.to_thread(create_overlay, overlay, blobs[image.disk], image.format, size)
            facts.disk_bytes = size
            await asyncio.to_thread(self.create_vm_cgroup, sid, spec, pids=QEMU_PIDS)
            efi_vars = None
            firmware = saved.firmware if saved is not None else spec.firmware
            if firmware == "uefi":
                efi_vars = root / "efivars.fd"
                await asyncio.to_thread(shutil.copyfile, OVMF_VARS, efi_vars)
            boot = None
            if image.kernel is not None:
                initrd = blobs[image.initrd] if image.initrd is not None else None
                cmdline = image.cmdline or ""
                if inp.net is not None:  # the guest's address (nic.py)
                    cmdline = f"{cmdline} {nic.guest_cmdline(inp.net)}".strip()
                boot = DirectBoot(blobs[image.kernel], initrd, cmdline)
            config = FullVMConfig(
                disk=overlay,
                ga_socket=root / "q" / "ga.sock",
                qmp_socket=root / "q" / "qmp.sock",
                log_path=root / "qemu.log",
                vcpus=max(1, min(self.host_cpus, math.ceil(spec.cpu_cores_limit))),
                memory_mb=spec.memory_limit_mb,
                accel=accel.accel,
                firmware=firmware,
                boot=boot,
                efi_vars=efi_vars,
                display=spec.display,
                vnc_socket=root / "q" / VNC_SOCKET,
                nic_mac=str(inp.net["mac"]) if inp.net is not None else None,
                agent_socket=root / "q" / AGENT_SOCKET,
            )
            if saved is not None:
                config = restore.shaped(config, saved)
            facts.accel, facts.vcpus, facts.memory_mb = accel.accel, config.vcpus, config.memory_mb
            launch = Launch.of(
                config,
                ro=[blobs[image.disk], *config.readable_files()],
                rw=[overlay, root / "q", *([efi_vars] if efi_vars is not None else [])],
            )
            await asyncio.to_thread(launch.save, root / LAUNCH_FILE)
            tap = await attach_vm_ready(dict(inp.net)) if inp.net is not None else None
            try:
                proc = launch.spawn(
                    self.jail_for(sid),
                    incoming=saved is not None,
                    tap_fd=tap.tap_fd if tap is not None else None,
                )
            finally:
                if tap is not None:
                    tap.close()  # QEMU holds its own copy
            facts.pid, facts.pid_start = proc.pid, proc.start_time
            self.start_qos(spec, proc.pid)  # known above first: a failure here tears it down
            vm = _VM(root, launch, proc, GuestAgent(config.ga_socket), Display(root / "q"))
            vm.link = self._link(sid, launch)
            self._vms[sid] = vm
            if image.state is not None:  # no boot: the saved guest runs on
                qmp = await vm.connect_qmp()
                await snapshot.load_into(qmp, blobs[image.state], timeout=BOOT_TIMEOUT)
                if inp.net is not None:  # the guest still holds the saved VM's address
                    await nic.relink(qmp)
            await self._wait_agent(vm, BOOT_TIMEOUT)
            # qemu-ga answered: a restored guest's port state is back (QEMU sets it when
            # the loaded VM runs), so no wait here either
            await self._probe_agent(sid, vm)
        except BaseException as exc:
            await undo_failed_create(
                exc, lambda: self._console_tail(vm), lambda: self._teardown(sid, facts)
            )
        self.audit.record(
            sid,
            AuditKind.LIFECYCLE,
            "fullvm_restored" if saved is not None else "fullvm_started",
            accel=facts.accel,
            dsec_agent=self._has_agent(sid),
        )
        return facts

    def jail_for(self, sid: str) -> Jail:
        return Jail(cgroup_dirs=tuple(self.cgroups.member_dirs(self.cgroup_of(sid))))

    async def _wait_agent(self, vm: _VM, timeout: float) -> None:
        """Until the guest agent answers, failing early if QEMU or the guest ends."""
        deadline = time.monotonic() + timeout
        while True:
            if vm.proc is None or not vm.proc.is_alive():
                tail = vm.proc.log_tail(400) if vm.proc is not None else ""
                raise BackendError(f"QEMU ended during the boot: {tail}")
            try:
                await vm.agent.sync(min(3.0, max(0.1, deadline - time.monotonic())))
                return
            except GuestAgentError as exc:
                if time.monotonic() >= deadline:
                    raise BackendError(
                        f"the guest agent did not answer within {timeout:g}s: {exc.message}"
                    ) from exc
            with contextlib.suppress(QmpError):
                if await (await vm.connect_qmp()).guest_ended(timeout=2):
                    raise BackendError("the guest shut down or panicked during the boot")
            await asyncio.sleep(0.2)

    async def _console_tail(self, vm: _VM | None) -> str:
        """The guest console's last line (guest-written: quoted by the caller)."""
        if vm is None or not vm.alive():
            return ""
        try:
            text = await (await vm.connect_qmp()).console(timeout=2)
        except QmpError:
            return ""
        return last_line(text)

    async def destroy(self, rec: SandboxRecord) -> None:
        await self._teardown(rec.id, self.facts(rec))

    async def _teardown(self, sid: str, facts: FullVMFacts) -> None:
        """Kill QEMU, remove its cgroup, overlay and sockets; idempotent."""
        errors: list[str] = []
        vm = self._vms.pop(sid, None)
        if vm is not None:
            await vm.kill()
        elif facts.pid is not None and facts.pid_start is not None:
            with contextlib.suppress(BackendError):
                proc = QemuProcess.adopt(facts.pid, facts.pid_start, Path("/"), Path("/"))
                await asyncio.to_thread(proc.kill)
        facts.pid = None
        if not await asyncio.to_thread(
            self.cgroups.kill_and_remove, self.cgroup_of(sid), timeout=5
        ):
            errors.append(f"cgroup {self.cgroup_of(sid)} not removed")
        await asyncio.to_thread(shutil.rmtree, self.vm_dir(sid), True)
        if self.vm_dir(sid).exists():
            errors.append(f"{self.vm_dir(sid)} not removed")
        if errors:
            raise BackendError(f"cleanup of {sid} incomplete: {'; '.join(errors)}")

    # -- recovery -----------------------------------------------------------------------
    async def still_running(self, rec: SandboxRecord) -> bool:
        """A VM this edge tracks lives while its QEMU does (a guest agent that fails a
        request fails that request only)."""
        known = self._vms.get(rec.id)
        return known is not None and known.alive()

    async def is_alive(self, rec: SandboxRecord) -> bool:
        """After a restart: its QEMU is adopted by pid and start time and must answer
        a guest agent sync."""
        vm = self._adopt(rec)
        if vm is None:
            return False
        await self._resume_interrupted_capture(rec.id, vm)
        try:
            await vm.agent.sync(20)
        except GuestAgentError as exc:
            log.warning("fullvm %s: guest agent did not answer after the restart: %s", rec.id, exc)
            await vm.close()
            return False
        self._vms[rec.id] = vm
        await self._probe_agent(rec.id, vm)
        return True

    async def _resume_interrupted_capture(self, sid: str, vm: _VM) -> None:
        """An edge that died during a snapshot left its VM frozen: let it run on."""
        if vm.proc is None:
            return
        try:
            if await capture.resume_interrupted(await vm.connect_qmp()):
                log.warning("fullvm %s: continued after a snapshot the edge never ended", sid)
                self.audit.record(sid, AuditKind.LIFECYCLE, "snapshot_interrupted")
        except QmpError as exc:
            log.warning("fullvm %s: run state unknown after the restart: %s", sid, exc)

    def _adopt(self, rec: SandboxRecord) -> _VM | None:
        """The VM of ``rec`` rebuilt after an edge restart from its facts and its
        saved launch: with its QEMU if that still runs (pid and start time), else
        without one (None: neither a QEMU nor a launch to start one)."""
        facts = self.facts(rec)
        root = self.vm_dir(rec.id)
        launch = Launch.load(root / LAUNCH_FILE)
        if launch is None:
            return None
        proc = None
        if facts.pid is not None and facts.pid_start is not None:
            with contextlib.suppress(BackendError):
                proc = QemuProcess.adopt(
                    facts.pid, facts.pid_start, Path(launch.qmp_socket), Path(launch.log_path)
                )
        display = Display(Path(launch.qmp_socket).parent)
        vm = _VM(root, launch, proc, GuestAgent(Path(launch.ga_socket)), display)
        vm.link = self._link(rec.id, launch)
        return vm

    async def adopt_paused(self, rec: SandboxRecord) -> bool:
        """A VM paused across an edge restart: saved to its file (no QEMU), or stopped
        (its QEMU adopted and kept stopped). False: it is gone."""
        vm = self._adopt(rec)
        if vm is None:
            return False
        facts = self.facts(rec)
        if vm.proc is None:
            if not vm.snapshot.is_file():
                return False
            facts.pid = None
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.proc.pid, signal.SIGSTOP)
            vm.stopped = True
        self._vms[rec.id] = vm
        return True

    async def sweep(self, known_ids: set[str]) -> list[str]:
        removed: list[str] = []
        for proc in await asyncio.to_thread(find_running, self.vms_dir):
            if proc.qmp_socket.parent.parent.name not in known_ids:
                await asyncio.to_thread(proc.kill)
        leftovers: set[str] = set()
        if self.vms_dir.is_dir():
            leftovers.update(e.name for e in os.scandir(self.vms_dir) if e.is_dir())
        leftovers.update(self.cgroups.children(f"/{self.cgroup_parent}"))
        for sid in sorted(leftovers - known_ids):
            try:
                await self._teardown(sid, FullVMFacts())
                removed.append(sid)
            except BackendError as exc:
                log.warning("sweep of %s incomplete: %s", sid, exc)
        return removed

    # -- guest end ------------------------------------------------------------------------
    def loops(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        return [("fullvm-guest-ends", self._watch_guest_ends)]

    async def _watch_guest_ends(self) -> None:
        """A guest that shut down or panicked leaves its QEMU paused (for the console):
        kill it, so that the edge's init watch fails the sandbox at once."""
        holds = HoldWatch()  # VMs seen paused or restoring: no request taken then
        while True:
            await asyncio.sleep(GUEST_END_POLL)
            holds.keep(self._vms)
            for sid, vm in list(self._vms.items()):
                if vm.proc is None or vm.busy():
                    holds.held(sid)
                    continue
                try:
                    qmp = await vm.connect_qmp()
                    if vm.link is not None:
                        if holds.freed(sid):
                            vm.link.restart_waits()
                        await vm.link.check(qmp)
                        await self._relink(sid, vm, qmp)
                    if not await qmp.guest_ended(timeout=2):
                        continue
                except Exception as exc:  # a VM torn down under us: not the loop's end
                    log.debug("fullvm %s: guest state unknown: %s", sid, exc)
                    continue
                tail = await self._console_tail(vm)
                self.audit.record(sid, AuditKind.LIFECYCLE, "guest_ended", console=tail)
                vm.ended = "the guest shut down, rebooted or panicked" + (
                    f" (its console's last line: {tail!r})" if tail else ""
                )
                await vm.kill()

    def death_reason(self, rec: SandboxRecord) -> str | None:
        vm = self._vms.get(rec.id)
        if vm is None:
            return None
        if vm.ended is not None:
            return vm.ended
        tail = vm.proc.log_tail(300) if vm.proc is not None else ""
        return f"QEMU ended on its own: {tail.splitlines()[-1][:160]!r}" if tail else None

    # -- pause: stop, save to a file, restore (dsec.backends.microvm.snapshot) ---------
    def pause(self, rec: SandboxRecord) -> None:
        """SIGSTOP QEMU: every vCPU stops at once, synchronously."""
        vm = self._vms.get(rec.id)
        if vm is None or vm.proc is None:
            raise BackendError(f"fullvm {rec.id} has no running VMM to pause")
        try:
            os.kill(vm.proc.pid, signal.SIGSTOP)
        except ProcessLookupError as exc:
            raise BackendError(f"fullvm {rec.id}: its VMM is gone") from exc
        vm.stopped = True

    async def reclaim(self, rec: SandboxRecord, *, swap: bool) -> ReclaimFigures:
        """Save the stopped VM's memory and device state to ``state.snap`` (its disk
        is its overlay, flushed by the save) and end QEMU: all of its memory goes back
        to the host."""
        vm = self._vms.get(rec.id)
        if vm is None or vm.proc is None:
            return ReclaimFigures(None, None, None, None, None)
        facts = self.facts(rec)
        proc = vm.proc
        before = self.cgroups.memory_usage(self.cgroup_of(rec.id))
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # QMP needs QEMU's main loop
        vm.stopped = False
        qmp = await vm.connect_qmp()
        await vm.agent.close()
        if vm.link is not None:  # its socket stays: requests wait for the restore
            await vm.link.park()
        facts.pid = None  # its exit is on purpose: the edge must not fail the sandbox
        try:
            await snapshot.pause_to_file(proc, qmp, vm.snapshot)
        except BaseException:
            facts.pid = proc.pid
            if vm.link is not None:  # QEMU runs on: the watcher links it again
                vm.link.parked = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGSTOP)
            vm.stopped = True
            raise
        vm.proc, vm.qmp = None, None
        facts.snapshot = True
        # The page cache QEMU filled (the state file, its disk) is still charged.
        await asyncio.to_thread(self.cgroups.drop_charges, self.cgroup_of(rec.id))
        after = self.cgroups.memory_usage(self.cgroup_of(rec.id))
        return ReclaimFigures(before, after or 0, None, 0, None)

    def resume(self, rec: SandboxRecord) -> None:
        """Continue a stopped QEMU, or start a new one that restores the VM's file:
        spawned here (synchronously, so the edge watches its pid), restored in the
        background; every request waits for the restore (``_vm``)."""
        vm = self._vms.get(rec.id)
        if vm is None:
            return
        if vm.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.proc.pid, signal.SIGCONT)
            vm.stopped = False
            return
        if not vm.snapshot.is_file():
            return
        facts = self.facts(rec)
        tap = attach_vm(dict(rec.net)) if rec.net is not None else None
        tap_name = str(rec.net["ifname"]) if rec.net is not None else None
        try:
            proc = vm.launch.spawn(
                self.jail_for(rec.id),
                incoming=True,
                tap_fd=tap.tap_fd if tap is not None else None,
            )
        finally:
            if tap is not None:
                tap.close()
        vm.proc = proc
        facts.pid, facts.pid_start, facts.snapshot = proc.pid, proc.start_time, False
        self.start_qos(rec.spec, proc.pid)  # a new QEMU: the class goes with the sandbox
        vm.restoring = asyncio.get_running_loop().create_task(
            self._finish_resume(rec.id, vm, tap_name), name=f"fullvm-resume-{rec.id}"
        )

    async def _finish_resume(self, sid: str, vm: _VM, tap: str | None) -> None:
        try:
            if tap is not None:  # the restored guest runs at once: its replies must flow
                await link_ready(tap)
            t0 = time.monotonic()
            await snapshot.load_into(await vm.connect_qmp(), vm.snapshot, timeout=120)
            vm.snapshot.unlink(missing_ok=True)
            log.info("fullvm %s resumed in %.3fs", sid, time.monotonic() - t0)
            if vm.link is not None:  # wait for the port only where an agent answered
                wait = OPEN_WAIT if vm.link.ready else 0.5
                await self._probe_agent(sid, vm, open_wait=wait)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("fullvm %s: resume failed: %s", sid, exc)
            vm.ended = f"the resume from its snapshot failed: {exc}"
            self.audit.record(sid, AuditKind.LIFECYCLE, "resume_failed", error=str(exc))
            await vm.close()
            if vm.proc is not None:  # the edge's init watch fails the sandbox
                await asyncio.to_thread(vm.proc.kill)

    # -- snapshots as VM images (capture.py; restored by create, restore.py) ------------
    async def snapshot(self, rec: SandboxRecord, *, state_out: Path, disk_out: Path) -> VMMachine:
        """The running VM's state and flattened disk, captured with the VM frozen
        across both (capture.py); the VM runs on after, unaware."""
        vm = await self._vm(rec)
        if (proc := vm.proc) is None:
            raise BackendError(f"fullvm {rec.id} has no running VMM")
        spec, facts = fullvm_spec(rec), self.facts(rec)
        image = VMImage.of(rec.image.config, spec.vm_image)
        base = await asyncio.to_thread(self.layers.store.verify, image.disk)
        qmp = await vm.connect_qmp()
        vm.stopped = True  # the guest-end watcher must not read a migrated VM as ended
        try:
            done = await capture.capture(
                qmp,
                overlay=self.vm_dir(rec.id) / "disk.qcow2",
                base=base,
                base_format=image.format,
                state_out=state_out,
                disk_out=disk_out,
                jail=Jail(as_uid=vm_uid(proc.pid)),  # qemu-img as this VM's QEMU
            )
        finally:
            vm.stopped = False
        self.audit.record(
            rec.id,
            AuditKind.LIFECYCLE,
            "fullvm_snapshot",
            frozen=round(done.frozen_seconds, 3),
            state_bytes=done.state_bytes,
            disk_bytes=done.disk_bytes,
        )
        machine = image.machine
        return VMMachine(
            memory_mb=facts.memory_mb,
            vcpus=facts.vcpus,
            firmware=machine.firmware if machine is not None else spec.firmware,
            display=machine.display if machine is not None else spec.display,
            accel="kvm" if facts.accel == "kvm" else "tcg",
            nic=rec.net is not None,
            network_rules=dict(rec.spec.network_rules) if rec.net is not None else None,
        )

    def spec_for_image(self, spec: RunArgs, image: ImageInfo) -> RunArgs:
        """A spec without rules started from a snapshot saved with a NIC gets the
        rules the VM had when saved (``VMMachine.network_rules``)."""
        if not isinstance(spec, DSecFullVMRunArgs) or spec.network_rules:
            return spec
        try:
            machine = VMImage.of(image.config, spec.vm_image).machine
        except DSecError:  # not a VM image: create says so
            return spec
        if machine is None or not machine.nic or not machine.network_rules:
            return spec
        return spec.model_copy(update={"network_rules": dict(machine.network_rules)})

    # -- data path: the guest agent ---------------------------------------------------
    async def _vm(self, rec: SandboxRecord) -> _VM:
        """The running VM of ``rec``, once a restore in flight is done."""
        vm = self._vms.get(rec.id)
        if vm is not None and vm.restoring is not None and not vm.restoring.done():
            with contextlib.suppress(Exception):  # its failure is the check below
                await asyncio.shield(vm.restoring)
        if vm is None or not vm.alive():
            raise BackendError(f"fullvm {rec.id} has no running VMM")
        return vm

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> ExecResult:
        vm = await self._vm(rec)
        if self._has_agent(rec.id):  # DSec's agent: any user, the containers' semantics
            return await AgentDataPath.exec(self, rec, req)
        if req.user not in ROOT_USERS:
            raise Unsupported(
                "the fullvm backend runs commands as the guest agent's user only (root): "
                f"user={req.user!r} is not supported",
                backend=self.kind.value,
                capability="exec_user",
            )
        workdir = req.workdir or (rec.spec.workdir if rec.spec.workdir != "/" else None)
        env = {"PATH": DEFAULT_PATH, **rec.spec.env, **req.env}
        try:
            done = await guestops.run(
                vm.agent,
                guestops.command_argv(req.command, workdir),
                env=env,
                stdin=req.stdin.encode() if req.stdin is not None else None,
                timeout=req.timeout,
                max_output=req.max_output_bytes,
            )
        except GuestCommandError as exc:  # e.g. no such program: what a shell says
            return ExecResult(exit_code=127, stdout="", stderr=exc.message + "\n", duration=0.0)
        return ExecResult(
            exit_code=done.exit_code,
            stdout=done.stdout.decode(errors="replace"),
            stderr=done.stderr.decode(errors="replace"),
            duration=done.duration,
            timed_out=done.timed_out,
            truncated=done.truncated,
        )

    async def read_file(self, rec: SandboxRecord, path: str, *, max_bytes: int) -> bytes:
        vm = await self._vm(rec)
        if self._has_agent(rec.id):
            return await AgentDataPath.read_file(self, rec, path, max_bytes=max_bytes)
        try:
            return await guestops.read_file(vm.agent, path, max_bytes=max_bytes)
        except GuestCommandError as exc:
            raise _file_error(exc, path) from None

    async def write_file(self, rec: SandboxRecord, path: str, data: bytes, *, mode: int) -> None:
        vm = await self._vm(rec)
        if self._has_agent(rec.id):
            await AgentDataPath.write_file(self, rec, path, data, mode=mode)
            return
        try:
            await guestops.write_file(vm.agent, path, data, mode=mode)
        except GuestCommandError as exc:
            raise _file_error(exc, path) from None

    # -- computer use: QMP ------------------------------------------------------------
    async def screenshot(self, rec: SandboxRecord) -> bytes:
        vm = await self._vm(rec)
        return await vm.display.screenshot(await vm.connect_qmp())

    async def desktop_socket(self, rec: SandboxRecord) -> Path:
        vm = await self._vm(rec)
        path = Path(vm.launch.qmp_socket).parent / VNC_SOCKET
        if f"unix:{path}" not in vm.launch.argv:  # a VM made before live views existed
            raise Unsupported(f"fullvm {rec.id} was started without a live view (no VNC server)")
        return path

    async def computer_input(self, rec: SandboxRecord, action: ComputerAction) -> None:
        vm = await self._vm(rec)
        qmp, display = await vm.connect_qmp(), vm.display
        match action.action:
            case "mouse_move":
                assert action.x is not None and action.y is not None
                await display.mouse_move(qmp, action.x, action.y)
            case "left_click" | "right_click" | "middle_click" | "double_click":
                button = (
                    "left" if action.action == "double_click" else action.action[: -len("_click")]
                )
                times = 2 if action.action == "double_click" else 1
                await display.click(qmp, button, times=times, x=action.x, y=action.y)
            case "scroll":
                await display.scroll(qmp, action.direction, action.amount)
            case "write":
                await display.write(qmp, action.text or "")
            case "press":
                await display.press(qmp, action.keys or [])

    async def stats(self, rec: SandboxRecord) -> dict[str, Any]:
        overlay = self.vm_dir(rec.id) / "disk.qcow2"
        try:
            disk = os.stat(overlay).st_blocks * 512
        except OSError:
            disk = None
        return {
            "memory_bytes": self.cgroups.memory_usage(self.cgroup_of(rec.id)),
            "cpu_seconds": self.cgroups.cpu_seconds(self.cgroup_of(rec.id)),
            "disk_bytes": disk,
            "accelerator": self.facts(rec).accel,
        }


def _file_error(exc: GuestCommandError, path: str) -> DSecError:
    """The guest agent's refusal of a file operation as the platform's typed error
    (its text is the guest's: already cut short by qga)."""
    if "No such file or directory" in exc.message:
        return FileNotFound(f"{path} does not exist in the sandbox", path=path)
    return InvalidArgument(exc.message, path=path)
