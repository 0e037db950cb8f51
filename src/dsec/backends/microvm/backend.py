"""MicroVM backend: a QEMU microVM per sandbox, booted from the sandbox's own EROFS
layers, with the same agent and data path as a container.

Create = the image's layers (the same blobs, mounts and chunk cache as containers)
attached read-only by serial, a private sparse ext4 disk of ``disk_limit_mb`` for the
overlay's upper, the guest kernel and the project's initramfs (dsec.guest), a tap when
the spec has network rules (dsec.net.vmtap: the same slot, rules and DNS responder as a
container), QEMU started jailed (jail.py: its own uid, namespaces, no capabilities) in
the sandbox's cgroup, then the agent channel (dsec.guest.channel) until the guest's
agent answers. The agent in the guest is the container's dsec-init, so exec, sessions,
PTY, files and streaming are the container's code (dsec.backends.agentpath).

Fast start: every guest boots in template mode (``dsec.wait=1``: the kernel comes up and
waits before it touches a drive). The first create of a machine shape (vCPUs, memory,
NIC or not, accelerator) boots cold and, once it runs, a template of that shape is saved
in the background from a second, drive-less boot; later creates restore the template
(a QEMU migration from one shared read-only file) and send the guest its boot
parameters. Pause writes the VM's state to a file and ends QEMU (its memory goes back
to the host); resume starts a new QEMU that restores it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from dsec.api.events import AuditKind
from dsec.api.spec import BackendKind, DSecMicroVMRunArgs, DSecRunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.backends.agentpath import AgentDataPath
from dsec.backends.base import (
    Backend,
    BackendHost,
    Capability,
    CreateInput,
    PackedWritable,
    ReclaimFigures,
    SandboxRecord,
)
from dsec.backends.microvm import snapshot
from dsec.backends.microvm.accel import AccelChoice, probe_accelerator
from dsec.backends.microvm.disk import create_disk, disk_usage
from dsec.backends.microvm.facts import MicroVMFacts
from dsec.backends.microvm.jail import Jail
from dsec.backends.microvm.machine import Machine, rss_bytes, wait_until
from dsec.backends.microvm.qemu import Drive, NetAttachment, QemuProcess, VMConfig, find_running
from dsec.backends.qemuvm import QemuVMBackend, last_line, undo_failed_create
from dsec.errors import BackendError
from dsec.guest.bootparams import RW_SERIAL, BootParams, layer_serial
from dsec.guest.channel import ST_READY, GuestChannel, HoldWatch
from dsec.images.mounts import LayerMounts
from dsec.net.vmtap import VMNetAttachment, attach_vm, attach_vm_ready, link_ready, scratch_tap
from dsec.resources import qos
from dsec.resources.cgroups import CgroupHost
from dsec.security.audit import AuditSink
from dsec.security.init_signals import InitSignalWatcher
from dsec.security.limits import LimitReading, read_cgroup_counters

log = logging.getLogger(__name__)

MiB = 1 << 20
# QEMU's own memory beside the guest's RAM (its code, TCG's translation cache, device
# state), charged to the sandbox's cgroup too: measured ~100 MiB under TCG.
VMM_OVERHEAD_MB = 160
MIN_MEMORY_MB = 128  # the guest kernel and initramfs need this much to boot
QEMU_PIDS = 256  # QEMU's threads (vCPUs, I/O workers)
GUEST_END_POLL = 2.0  # seconds between checks that a guest has not shut down
RELINK_TIMEOUT = 10.0  # seconds a guest has to answer a new agent channel
GUEST_END_GRACE = 3.0  # seconds a guest whose agent port closed has to be seen powered off
PORT_POLL = 0.5  # seconds between asking QEMU, during a relink, whether the port is open
ADOPT_LINK_ATTEMPTS = 2  # links to a re-adopted VM's agent before it counts as gone


def _placeholder(path: Path) -> None:
    """A 1 MiB sparse file standing in for a drive a template guest never reads."""
    with open(path, "wb") as f:
        f.truncate(1 * MiB)


def _forget(tasks: dict[str, asyncio.Task[None]], key: str, _done: object) -> None:
    tasks.pop(key, None)


def inline_image(image: Path, files: Mapping[str, str], staging: Path) -> None:
    """An EROFS image (root 0600) holding ``files`` (relative names, checked by the
    API), built from a staging tree that is removed afterwards."""
    try:
        staging.mkdir(mode=0o700)
        for name, content in files.items():
            target = staging / name
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as fh:
                fh.write(content.encode())
        os.chmod(staging, 0o755)
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        done = subprocess.run(
            ["mkfs.erofs", "--quiet", "--all-root", str(image), str(staging)],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise BackendError(f"mkfs.erofs: {done.stderr.decode(errors='replace')[:300]}")
        os.chmod(image, 0o600)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def microvm_spec(rec: SandboxRecord | CreateInput) -> DSecMicroVMRunArgs:
    """``rec``'s spec as the microVM spec it is (another kind here is a platform bug)."""
    if not isinstance(rec.spec, DSecMicroVMRunArgs):
        raise BackendError(
            f"sandbox {rec.id} has a {rec.spec.backend} spec: the microvm backend cannot run it"
        )
    return rec.spec


class MicroVMBackend(AgentDataPath, QemuVMBackend, Backend):
    kind = BackendKind.MICROVM
    capabilities = frozenset(
        {
            Capability.SESSIONS,
            Capability.FILES,
            Capability.PAUSE,
            Capability.NETWORK_RULES,
            Capability.DISK_LIMIT,
            Capability.QOS,
            Capability.VERIFY,
            Capability.PROTECTED_PATHS,
            Capability.PACK,
            Capability.FORK,
        }
    )
    network_device: ClassVar[Literal["veth", "tap"]] = "tap"
    vmm_overhead_mb = VMM_OVERHEAD_MB
    min_memory_mb = MIN_MEMORY_MB
    min_memory_why = "the guest kernel's own need"
    vm_noun = "microVM"
    destroy_needs_resume = False  # SIGKILL ends a stopped QEMU; a saved one has no process
    reclaim_drops_agent_links = True  # QEMU ends with its agent channel

    @classmethod
    def probe(cls) -> str | None:
        """Root (cgroups, the jail), a cgroup file system and QEMU on PATH. The guest
        kernel and initramfs are built at start if missing (install.sh builds them)."""
        if os.geteuid() != 0:
            return "needs root (cgroups, the QEMU jail, taps)"
        if not os.path.ismount("/sys/fs/cgroup"):
            return "no cgroup file system at /sys/fs/cgroup"
        if shutil.which("qemu-system-x86_64") is None:
            return "no qemu-system-x86_64 on PATH (apt-get install qemu-system-x86)"
        return None

    @classmethod
    def from_host(cls, host: BackendHost) -> Self:
        config = host.config
        return cls(
            vms_dir=config.data_dir / "vms",
            templates_dir=config.data_dir / "vm-templates",
            layers=host.layers,
            cgroups=host.cgroups,
            cgroup_parent=f"dsec/{config.edge_id}-vm",
            audit=host.audit,
        )

    def __init__(
        self,
        *,
        vms_dir: Path,
        templates_dir: Path,
        layers: LayerMounts,
        cgroups: CgroupHost,
        cgroup_parent: str,
        audit: AuditSink,
        templates: bool = True,
    ) -> None:
        self.vms_dir = vms_dir
        self.templates_dir = templates_dir
        self.layers = layers
        self.cgroups = cgroups
        self.cgroup_parent = cgroup_parent.strip("/")
        self.audit = audit
        self.templates = templates
        self.host_cpus = os.cpu_count() or 1
        self._machines: dict[str, Machine] = {}
        self._kernel: Path | None = None
        self._initrd: Path | None = None
        self._accel: AccelChoice | None = None
        self._ready: asyncio.Task[None] | None = None
        self._template_builds: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        # pid 1's reports of signals sent to it from inside the guest: the same agent,
        # the same reports as containers (dsec.security.init_signals).
        self.init_signals = InitSignalWatcher(audit)
        self.verifying: set[str] = set()  # sandboxes with a verify step in flight

    # -- host -----------------------------------------------------------------------
    async def start(self) -> None:
        self.init_signals.start()
        self.vms_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.vms_dir, 0o700)
        # The guest image and the accelerator probe are prepared at the first microVM
        # create, not here: an edge that runs no VM pays nothing for them (resolving
        # the kernel alone asks apt, ~1 s of CPU per process).

    async def _prepare_guest(self) -> None:
        from dsec.guest.initramfs import guest_initramfs
        from dsec.guest.kernel import guest_kernel

        kernel = await asyncio.to_thread(guest_kernel)
        self._initrd = await asyncio.to_thread(guest_initramfs)
        self._kernel = kernel.vmlinuz
        self._accel = await probe_accelerator(kernel.vmlinuz)

    async def guest(self) -> tuple[Path, Path, AccelChoice]:
        """The guest kernel, initramfs and accelerator, prepared on first use."""
        if self._ready is None or (self._ready.done() and self._ready.exception()):
            # First use, or a failed attempt (e.g. apt could not fetch): try (again).
            self._ready = asyncio.create_task(self._prepare_guest(), name="microvm-guest")
        await asyncio.shield(self._ready)
        assert self._kernel is not None and self._initrd is not None and self._accel is not None
        return self._kernel, self._initrd, self._accel

    async def guest_ready(self) -> AccelChoice:
        """Wait until the guest kernel, initramfs and accelerator probe are ready (the
        first create waits for this anyway; a benchmark times it apart)."""
        return (await self.guest())[2]

    def details(self) -> Mapping[str, str]:
        """The accelerator (and why), and core scheduling for latency-class VMs."""
        return self._accel_details() | qos.health_detail()

    def _accel_details(self) -> dict[str, str]:
        if self._accel is None:
            if self._ready is None:
                return {"accelerator": "not probed yet (at the first microVM create)"}
            if self._ready.done() and self._ready.exception():
                return {"accelerator": "unknown", "error": str(self._ready.exception())}
            return {"accelerator": "probing"}
        return {"accelerator": self._accel.accel, "accelerator_reason": self._accel.reason}

    async def close(self) -> None:
        for task in [*self._template_builds.values(), *self._background]:
            task.cancel()
        for task in [*self._template_builds.values(), *self._background]:
            with contextlib.suppress(BaseException):
                await task
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
            with contextlib.suppress(BaseException):
                await self._ready
        self.init_signals.close()
        for machine in list(self._machines.values()):
            await machine.close()
        self._machines.clear()
        await self.remove_parent_cgroup_if_empty()

    def track(self, vm_id: str, machine: Machine) -> None:
        """Count ``machine`` among this backend's VMs (the guest-end watcher, close):
        the verifier VMs of dsec.backends.microvm.verify are VMs too."""
        self._machines[vm_id] = machine

    def untrack(self, vm_id: str) -> Machine | None:
        return self._machines.pop(vm_id, None)

    # -- paths (the VM directory and cgroup: dsec.backends.qemuvm) ----------------------
    def agent_socket(self, sandbox_id: str) -> Path:
        return self.vm_dir(sandbox_id) / "agent.sock"

    def load_facts(self, data: Mapping[str, Any]) -> MicroVMFacts:
        return MicroVMFacts.from_json(data)

    def facts(self, rec: SandboxRecord) -> MicroVMFacts:
        if not isinstance(rec.facts, MicroVMFacts):
            rec.facts = MicroVMFacts.of(rec.facts)
        return rec.facts

    # -- limits -------------------------------------------------------------------------
    def check_limits(self, spec: Any) -> None:
        self.check_memory(spec)

    def helper_vm_memory_mb(self, spec: DSecRunArgs, overcommit: float) -> int | None:
        """A verifier or packer VM has the sandbox's shape (microvm_spec), so it
        commits what the sandbox does, while the sandbox's own VM stays resident."""
        return self.committed_memory_mb(spec, overcommit)

    def _vcpus(self, spec: DSecMicroVMRunArgs) -> int:
        return max(1, min(self.host_cpus, math.ceil(spec.cpu_cores_limit)))

    # -- configuration -------------------------------------------------------------------
    def vm_config(
        self,
        sid: str,
        spec: DSecMicroVMRunArgs,
        kernel: Path,
        initrd: Path,
        accel: AccelChoice,
        drives: tuple[Drive, ...],
        net: NetAttachment | None,
    ) -> VMConfig:
        q = self.vm_dir(sid) / "q"
        return VMConfig(
            kernel=kernel,
            initrd=initrd,
            agent_socket=q / "chardev.sock",
            qmp_socket=q / "qmp.sock",
            log_path=self.vm_dir(sid) / "qemu.log",
            params={"dsec.wait": "1"},  # boot parameters come with GO (see the module doc)
            vcpus=self._vcpus(spec),
            memory_mb=spec.memory_limit_mb,
            drives=drives,
            net=net,
            accel=accel.accel,
        )

    def jail_for(self, sid: str | None) -> Jail:
        dirs = tuple(self.cgroups.member_dirs(self.cgroup_of(sid))) if sid is not None else ()
        return Jail(cgroup_dirs=dirs)

    @staticmethod
    def _boot_params(sid: str, layers: int, facts: MicroVMFacts) -> BootParams:
        """What GO tells the guest: its drives, name, address when it has a NIC, and
        the host's clock (a guest restored from a template would run on the
        snapshot's time)."""
        return BootParams(
            layers=layers,
            rw=True,
            ip=facts.guest_ip,
            gw=facts.gateway,
            hostname=sid[:63],
            time_us=time.time_ns() // 1000,
        )

    # -- lifecycle ----------------------------------------------------------------------
    async def create(self, inp: CreateInput) -> MicroVMFacts:
        sid, spec = inp.id, microvm_spec(inp)
        deadline = time.monotonic() + 600
        root = self.vm_dir(sid)
        facts = MicroVMFacts(dir=root, layers=list(inp.image.layers))
        net: VMNetAttachment | None = None
        machine: Machine | None = None
        try:
            kernel, initrd, accel = await self.guest()
            root.mkdir(mode=0o700)
            (root / "q").mkdir(mode=0o700)
            await self.layers.prepare(inp.image.layers, spec.image_loading)
            drives: list[Drive] = []
            for i, digest in enumerate(reversed(inp.image.layers)):  # top layer first
                self.layers.acquire(digest, holder=sid)
                facts.layers_held.append(digest)
                drives.append(Drive(self.layers.blob(digest), layer_serial(i), readonly=True))
            facts.disk_bytes = await asyncio.to_thread(
                create_disk, root / "disk.img", spec.disk_limit_mb
            )
            drives.append(Drive(root / "disk.img", RW_SERIAL, readonly=False))
            if spec.protected:  # for verifier VMs only: nothing of it is attached here
                await self._prepare_protected(inp, root, facts)
            await asyncio.to_thread(self.create_vm_cgroup, sid, spec, pids=QEMU_PIDS)
            if inp.net is not None:
                net = await attach_vm_ready(dict(inp.net))
                facts.mac, facts.guest_ip, facts.gateway = net.mac, net.guest_ip, net.gateway
            tap = NetAttachment(net.tap_fd, net.mac) if net is not None else None
            config = self.vm_config(sid, spec, kernel, initrd, accel, tuple(drives), tap)
            facts.accel, facts.vcpus, facts.memory_mb = accel.accel, config.vcpus, config.memory_mb
            machine = Machine(root, config)
            self._machines[sid] = machine
            template = snapshot.template_path(self.templates_dir, config)
            restored = self.templates and template.is_file()
            async with machine.lock:
                machine.listen()
                proc = machine.launch(prefix=self.jail_for(sid).prefix(config), incoming=restored)
                facts.pid, facts.pid_start = proc.pid, proc.start_time
                self.start_qos(spec, proc.pid)
                if net is not None:
                    net.close()
                    net = None
                if restored:
                    await machine.restore(template, wait_until(deadline))
                channel = await machine.connect_channel(wait_until(deadline))
                await channel.wait_template(wait_until(deadline))
                await channel.go(self._boot_params(sid, len(inp.image.layers), facts).params())
                await channel.wait_ready(wait_until(deadline))
            self.init_signals.watch(sid, self.agent_socket(sid))
            await self.check_init_user(sid, spec.init_user)
            if self.templates and not restored:
                self.build_template_later(config)
        except BaseException as exc:

            async def console_tail() -> str:
                return await machine.console_tail() if machine is not None else ""

            async def teardown() -> None:
                if net is not None:
                    net.close()
                await self._teardown(sid, facts)

            await undo_failed_create(exc, console_tail, teardown)
        self.audit.record(sid, AuditKind.LIFECYCLE, "microvm_started", accel=facts.accel)
        return facts

    async def _prepare_protected(self, inp: CreateInput, root: Path, facts: MicroVMFacts) -> None:
        """Each protected path as an EROFS image a verifier VM shows read-only: a layer
        (resolved by the edge) is held and its blob used; inline files are written
        into ``protected-<i>.erofs`` in the VM's directory (root 0600)."""
        spec = microvm_spec(inp)
        if len(inp.protected_layers) != len(spec.protected):
            raise BackendError("protected layers were not resolved before create")
        contents = [dict(f) for f in inp.protected_files] or [dict(m.files) for m in spec.protected]
        for i, (m, digest) in enumerate(zip(spec.protected, inp.protected_layers, strict=True)):
            if digest is not None:
                await self.layers.prepare([digest], spec.image_loading)
                self.layers.acquire(digest, holder=inp.id)
                facts.layers_held.append(digest)
                facts.protected.append((m.path, str(self.layers.blob(digest))))
                continue
            image = root / f"protected-{i}.erofs"
            await asyncio.to_thread(inline_image, image, contents[i], root / f".protected-{i}")
            facts.protected.append((m.path, str(image)))

    async def verify(self, rec: SandboxRecord, req: VerifyRequest) -> VerifyResult:
        """The grader in a fresh verifier VM from the pristine layers; the agent's disk
        only as data (dsec.backends.microvm.verify)."""
        from dsec.backends.microvm.verify import run_verify

        return await run_verify(self, rec, req)

    def machine_of(self, sandbox_id: str) -> Machine | None:
        """The Machine this backend tracks for ``sandbox_id`` (with or without a QEMU:
        a VM paused to its file has none), None when it tracks none."""
        return self._machines.get(sandbox_id)

    async def pack_writable(
        self, rec: SandboxRecord, out: Path, *, compression: str | None, paused: bool
    ) -> PackedWritable:
        """The agent's changes as an EROFS layer, its disk parsed by a packer VM
        (dsec.backends.microvm.pack)."""
        from dsec.backends.microvm.pack import pack_writable

        return await pack_writable(self, rec, out, compression=compression, paused=paused)

    def running_machine(self, rec: SandboxRecord) -> Machine:
        """The live Machine of a running VM (BackendError if it has no QEMU)."""
        machine = self._machines.get(rec.id)
        if machine is None or machine.proc is None or not machine.proc.is_alive():
            raise BackendError(f"microvm {rec.id} has no running VMM")
        return machine

    def build_template_later(self, config: VMConfig) -> None:
        """Save a template of ``config``'s machine shape from a second boot with
        placeholder drives (the guest never reads them: it waits before it probes
        drives), so the next create of this shape restores instead of booting."""
        key = config.machine_key()
        if key in self._template_builds:
            return
        task = asyncio.create_task(self._build_template(config), name=f"vm-template-{key}")
        self._template_builds[key] = task

    async def _build_template(self, config: VMConfig) -> None:
        work = self.templates_dir / f".build-{config.machine_key()}"
        proc: QemuProcess | None = None
        machine: Machine | None = None
        scratch: int | None = None
        net: NetAttachment | None = None
        try:
            await asyncio.to_thread(shutil.rmtree, work, True)
            (work / "q").mkdir(parents=True, mode=0o700)
            drives = []
            for d in config.drives:
                placeholder = work / f"{d.serial}.img"
                await asyncio.to_thread(_placeholder, placeholder)
                drives.append(Drive(placeholder, d.serial, readonly=d.readonly))
            if config.net is not None:
                # The NIC is part of the saved machine: the template has one too, on a
                # throwaway tap (its guest never loads the NIC driver before GO).
                scratch = scratch_tap()
                net = NetAttachment(scratch, config.net.mac)
            tconfig = dataclasses.replace(
                config,
                agent_socket=work / "q" / "chardev.sock",
                qmp_socket=work / "q" / "qmp.sock",
                log_path=work / "qemu.log",
                drives=tuple(drives),
                net=net,
            )
            machine = Machine(work, tconfig)
            jail = dataclasses.replace(self.jail_for(None), die_with_parent=True)
            proc = machine.launch(prefix=jail.prefix(tconfig))
            if scratch is not None:
                os.close(scratch)  # QEMU holds its own copy: the tap goes with QEMU
                scratch = None
            channel = await machine.connect_channel(120)
            await channel.wait_template(120)
            await machine.close_channel()
            qmp = await machine.connect_qmp()
            machine.qmp = None
            await snapshot.save_template(proc, qmp, tconfig, self.templates_dir)
            # The key was computed from the sandbox's config: same shape, same file.
            built = snapshot.template_path(self.templates_dir, tconfig)
            target = snapshot.template_path(self.templates_dir, config)
            if built != target:
                os.replace(built, target)
            log.info("microvm template saved for machine %s", config.machine_key())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("microvm template for %s not saved: %s", config.machine_key(), exc)
        finally:
            if scratch is not None:
                os.close(scratch)
            if machine is not None:
                await machine.kill()
                machine.close_listener()
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def destroy(self, rec: SandboxRecord) -> None:
        await self._teardown(rec.id, self.facts(rec))

    async def _teardown(self, sid: str, facts: MicroVMFacts) -> None:
        """Kill QEMU, remove its cgroup, files and sockets, release layers; idempotent.
        The layers are released also when a step fails or the teardown is cancelled
        midway (as in the container backend's ``teardown``)."""
        try:
            await self._remove_objects(sid, facts)
        finally:
            self.layers.release_held(facts.layers_held, holder=sid)

    async def _remove_objects(self, sid: str, facts: MicroVMFacts) -> None:
        """Everything of ``_teardown`` but the layers (BackendError: what is left)."""
        errors: list[str] = []
        self.init_signals.unwatch(sid)
        machine = self._machines.pop(sid, None)
        if machine is not None:
            if machine.restoring is not None and not machine.restoring.done():
                machine.restoring.cancel()
                with contextlib.suppress(BaseException):
                    await machine.restoring
            await machine.kill()
            machine.close_listener()
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
    def _adopt_process(self, rec: SandboxRecord) -> QemuProcess | None:
        facts = self.facts(rec)
        if facts.pid is None or facts.pid_start is None:
            return None
        q = self.vm_dir(rec.id) / "q"
        try:
            return QemuProcess.adopt(
                facts.pid, facts.pid_start, q / "qmp.sock", self.vm_dir(rec.id) / "qemu.log"
            )
        except BackendError:
            return None

    async def _machine_for(self, rec: SandboxRecord) -> Machine:
        """The Machine of an adopted VM, rebuilt from its facts and the guest files."""
        machine = self._machines.get(rec.id)
        if machine is not None:
            return machine
        kernel, initrd, _accel = await self.guest()
        facts = self.facts(rec)
        drives = [
            Drive(self.layers.blob(d), layer_serial(i), readonly=True)
            for i, d in enumerate(reversed(rec.image.layers))
        ]
        drives.append(Drive(self.vm_dir(rec.id) / "disk.img", RW_SERIAL, readonly=False))
        tap = NetAttachment(-1, facts.mac) if facts.mac is not None else None
        config = VMConfig(
            kernel=kernel,
            initrd=initrd,
            agent_socket=self.vm_dir(rec.id) / "q" / "chardev.sock",
            qmp_socket=self.vm_dir(rec.id) / "q" / "qmp.sock",
            log_path=self.vm_dir(rec.id) / "qemu.log",
            params={"dsec.wait": "1"},
            vcpus=facts.vcpus,
            memory_mb=facts.memory_mb,
            drives=tuple(drives),
            net=tap,
            accel="kvm" if facts.accel == "kvm" else "tcg",
        )
        machine = Machine(self.vm_dir(rec.id), config)
        self._machines[rec.id] = machine
        return machine

    def _hold_layers(self, rec: SandboxRecord) -> None:
        facts = self.facts(rec)
        held = []
        for digest in rec.image.layers:
            self.layers.acquire(digest, holder=rec.id)
            held.append(digest)
        facts.layers_held = held

    async def still_running(self, rec: SandboxRecord) -> bool:
        """A VM this edge tracks lives while its QEMU does: a broken agent channel is
        the guest-end watch's to mend or end (``_watch_guest_ends``), and a VM held
        stopped by a verify or pack has a live QEMU."""
        machine = self._machines.get(rec.id)
        return machine is not None and machine.proc is not None and machine.proc.is_alive()

    async def is_alive(self, rec: SandboxRecord) -> bool:
        proc = self._adopt_process(rec)
        if proc is None:
            return False
        from dsec.backends.microvm.verify import recover

        await recover(self, rec.id, proc.pid)  # a verify step a crashed edge left behind
        await self.layers.prepare(rec.image.layers, microvm_spec(rec).image_loading)
        machine = await self._machine_for(rec)
        machine.proc = proc
        for attempt in range(1, ADOPT_LINK_ATTEMPTS + 1):
            try:
                channel = await machine.connect_channel(10)
                await channel.wait_ready(20)
                await self.agent(rec).ping(timeout=10)
                return True
            except Exception as exc:
                # The guest's mux learns of a new host end from the port's open event;
                # one seen while it was busy (a loaded TCG host) is linked anew once.
                log.warning(
                    "microvm %s: agent did not answer after the restart (attempt %d: %s)",
                    rec.id,
                    attempt,
                    exc,
                )
        await machine.close()
        self._machines.pop(rec.id, None)
        return False

    async def adopt(self, rec: SandboxRecord) -> None:
        self._hold_layers(rec)
        self.init_signals.watch(rec.id, self.agent_socket(rec.id))  # and what pid 1 kept

    async def adopt_paused(self, rec: SandboxRecord) -> bool:
        facts = self.facts(rec)
        await self.layers.prepare(rec.image.layers, microvm_spec(rec).image_loading)
        machine = await self._machine_for(rec)
        if machine.snapshot.is_file():
            facts.pid = None
            facts.snapshot = True
            self._hold_layers(rec)
            machine.listen()
            return True
        proc = self._adopt_process(rec)
        if proc is None:
            return False
        machine.proc = proc  # paused (SIGSTOPped) but never reclaimed: still there
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGSTOP)
        machine.stopped = True
        self._hold_layers(rec)
        return True

    async def sweep(self, known_ids: set[str]) -> list[str]:
        removed: list[str] = []
        for proc in await asyncio.to_thread(find_running, self.vms_dir):
            sid = proc.qmp_socket.parent.parent.name
            if sid not in known_ids:
                await asyncio.to_thread(proc.kill)
        # Template builds of a crashed edge (none of this process runs yet).
        for proc in await asyncio.to_thread(find_running, self.templates_dir):
            await asyncio.to_thread(proc.kill)
        leftovers: set[str] = set()
        if self.vms_dir.is_dir():
            leftovers.update(e.name for e in os.scandir(self.vms_dir) if e.is_dir())
        leftovers.update(self.cgroups.children(f"/{self.cgroup_parent}"))
        for sid in sorted(leftovers - known_ids):
            try:
                await self._teardown(sid, MicroVMFacts())
                removed.append(sid)
            except BackendError as exc:
                log.warning("sweep of %s incomplete: %s", sid, exc)
        if self.templates_dir.is_dir():  # half-built templates of a crashed edge
            for entry in os.scandir(self.templates_dir):
                if entry.name.startswith(".build-"):
                    await asyncio.to_thread(shutil.rmtree, entry.path, True)
        return removed

    # -- guest end ------------------------------------------------------------------------
    def loops(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        return [("microvm-guest-ends", self._watch_guest_ends)]

    async def _watch_guest_ends(self) -> None:
        """A guest that shut down or panicked leaves its QEMU paused (for the console):
        kill it, so that the edge's init watch fails the sandbox at once. An agent
        channel the guest broke (garbage on its port, its mux killed) is linked anew
        once; if the guest does not answer, the VM is killed the same way: requests
        waiting for it fail instead of hanging in the agent socket's backlog. A link
        whose guest end closed the port (its mux ended, then maybe no garbage at all)
        is broken the same way: nothing on it could ever answer. A link whose mux
        took no request in time (stopped, or the guest hung: the port stays
        open and quiet) is linked anew, and if no HELLO comes, the VM ends too."""
        relinks: dict[str, asyncio.Task[None]] = {}
        holds = HoldWatch()  # VMs seen stopped or locked (a pause, verify, snapshot)
        try:
            while True:
                await asyncio.sleep(GUEST_END_POLL)
                holds.keep(self._machines)
                for sid, machine in list(self._machines.items()):
                    try:
                        if await machine.guest_ended():
                            await self._end_ended_guest(sid, machine)
                            continue
                    except Exception as exc:  # a VM torn down under us: not the loop's end
                        log.debug("microvm %s: guest state unknown: %s", sid, exc)
                        continue
                    channel = machine.channel
                    busy = machine.lock.locked() or machine.stopped or sid in relinks
                    if busy:
                        holds.held(sid)
                    if channel is None or busy:
                        continue
                    if holds.freed(sid):
                        channel.restart_waits()
                    if channel.lost is not None:
                        mend = self._relink(sid, machine, channel)
                    elif not (channel.state == ST_READY and channel.connected):
                        continue
                    elif await machine.agent_port_closed():
                        mend = self._abandon(sid, machine, channel)
                    elif (why := channel.stalled()) is not None:
                        self.audit.record(sid, AuditKind.LIFECYCLE, "agent_channel_stalled")
                        channel.abandon(why)
                        mend = self._relink(sid, machine, channel)
                    else:
                        continue
                    task = asyncio.create_task(mend, name=f"vm-relink-{sid}")
                    relinks[sid] = task
                    task.add_done_callback(functools.partial(_forget, relinks, sid))
        finally:
            for task in list(relinks.values()):
                task.cancel()

    async def _relink(self, sid: str, machine: Machine, lost: GuestChannel) -> None:
        async with machine.lock:
            if machine.channel is not lost or machine.proc is None or machine.stopped:
                return  # paused, resumed or ended meanwhile: that path owns the channel
            why = lost.lost or "lost"
            try:
                channel = await machine.connect_channel(RELINK_TIMEOUT)
                await self._wait_answer(machine, channel)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._end_unanswerable(sid, machine, why, f"no answer: {exc}")
                return
            log.warning("microvm %s: agent channel linked again after: %s", sid, why)
            self.audit.record(sid, AuditKind.LIFECYCLE, "agent_channel_relinked", why=why)

    async def _wait_answer(self, machine: Machine, channel: GuestChannel) -> None:
        """Until a new link's guest answers READY, at most RELINK_TIMEOUT; BackendError
        at once when the guest's agent port is closed meanwhile (its mux ended: nothing
        will answer, however long the wait) or the guest is over (the watch's own check
        skips a VM whose lock is held, as it is for this whole wait)."""
        deadline = time.monotonic() + RELINK_TIMEOUT
        while True:
            try:
                await channel.wait_ready(max(0.0, min(PORT_POLL, deadline - time.monotonic())))
                return
            except BackendError:
                if channel.lost is not None or time.monotonic() >= deadline:
                    raise
            if await machine.agent_port_closed():
                raise BackendError("the guest closed its agent port (its mux ended)")
            if await machine.ends_within(0):
                raise BackendError("the guest ended")

    async def _abandon(self, sid: str, machine: Machine, channel: GuestChannel) -> None:
        """The guest closed its agent port: its mux, which opens the port once and
        holds it for its whole life, has ended, and nothing in the guest starts another.
        No link could be answered again, so the VM ends now rather than after a relink's
        wait (and a request sent meanwhile fails now rather than after its deadline)."""
        async with machine.lock:
            if machine.channel is not channel or machine.proc is None or machine.stopped:
                return
            why = "the guest closed its agent port (its mux ended)"
            await self._end_unanswerable(sid, machine, why, "its port stays closed")

    async def _end_ended_guest(self, sid: str, machine: Machine) -> None:
        """End a VM whose guest is over (QEMU paused in a shutdown or panic state):
        its console's end is audited and becomes the reason ``death_reason`` gives."""
        tail = await machine.console_tail(300)
        log.warning("microvm %s: the guest ended; console: %r", sid, tail)
        self.audit.record(sid, AuditKind.LIFECYCLE, "guest_ended", console=tail)
        machine.ended = "the guest shut down, rebooted or panicked" + (
            f" (its console's last line: {last_line(tail)!r})" if tail else ""
        )
        await machine.kill()

    async def _end_unanswerable(self, sid: str, machine: Machine, why: str, error: str) -> None:
        """End a VM whose agent channel can no longer be served (the caller holds its
        lock): requests waiting in the agent socket fail now, the edge's init watch
        fails the sandbox, and the reason is audited and kept for ``death_reason``.
        A guest that is powering off closes its agent port before QEMU sees it end;
        such a guest gets GUEST_END_GRACE to be seen ended, and is then reported as
        ended, not as having broken its channel."""
        machine.close_listener()
        if await machine.ends_within(GUEST_END_GRACE):
            await self._end_ended_guest(sid, machine)
            return
        log.warning("microvm %s: agent channel lost (%s): %s", sid, why, error)
        self.audit.record(sid, AuditKind.LIFECYCLE, "agent_channel_lost", why=why, error=error)
        machine.ended = f"the guest broke its agent channel ({why}) and did not answer"
        await machine.kill()

    def death_reason(self, rec: SandboxRecord) -> str | None:
        """Why the VM ended: what the backend recorded when it ended it, else what the
        host saw of a QEMU that ended on its own (the OOM killer in its cgroup, QEMU's
        own last words: its log, which the guest cannot write)."""
        machine = self._machines.get(rec.id)
        if machine is None:
            return None
        if machine.ended is not None:
            return machine.ended
        with contextlib.suppress(Exception):
            if self.limit_counters(rec).oom_kills:
                return "QEMU was killed by the OOM killer of its cgroup (guest + VMM memory)"
        tail = machine.proc.log_tail(300) if machine.proc is not None else ""
        return f"QEMU ended on its own: {last_line(tail)!r}" if tail else None

    # -- pause ----------------------------------------------------------------------------
    def pause(self, rec: SandboxRecord) -> None:
        """SIGSTOP QEMU: every vCPU stops at once, synchronously (reclaim then saves the
        state to a file and ends the process)."""
        machine = self._machines.get(rec.id)
        pid = machine.proc.pid if machine is not None and machine.proc is not None else None
        if pid is None:
            raise BackendError(f"microvm {rec.id} has no running VMM to pause")
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError as exc:
            raise BackendError(f"microvm {rec.id}: its VMM is gone") from exc
        assert machine is not None
        machine.stopped = True

    async def reclaim(self, rec: SandboxRecord, *, swap: bool) -> ReclaimFigures:
        """Save the paused VM's memory and device state to ``state.snap`` and end QEMU:
        all of its memory goes back to the host."""
        machine = self._machines.get(rec.id)
        if machine is None or machine.proc is None:
            return ReclaimFigures(None, None, None, None, None)
        facts = self.facts(rec)
        async with machine.lock:
            proc = machine.proc
            if proc is None:
                return ReclaimFigures(None, None, None, None, None)
            before = self.cgroups.memory_usage(self.cgroup_of(rec.id)) or rss_bytes(proc.pid)
            anon = rss_bytes(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # QMP needs QEMU's main loop
            machine.stopped = False
            # Its disk must hold what it wrote (pack_diff of a paused VM reads the
            # disk, not the saved memory): the guest runs for this sync only.
            from dsec.backends.microvm.verify import sync_guest

            await sync_guest(self, rec)
            qmp = await machine.connect_qmp()
            self.init_signals.unwatch(rec.id)
            await machine.close_channel()
            facts.pid = None  # its exit is on purpose: the edge must not fail the sandbox
            try:
                await snapshot.pause_to_file(proc, qmp, machine.snapshot)
            except BaseException:
                facts.pid = proc.pid
                with contextlib.suppress(Exception):
                    await machine.connect_channel(10)
                    self.init_signals.watch(rec.id, machine.agent_socket)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGSTOP)
                machine.stopped = True
                raise
            machine.proc, machine.qmp = None, None
            facts.snapshot = True
        # No process is left in the cgroup, but the page cache QEMU filled (its writes
        # of the snapshot and the disk, its reads of layers) is still charged to it.
        await asyncio.to_thread(self.cgroups.drop_charges, self.cgroup_of(rec.id))
        after = self.cgroups.memory_usage(self.cgroup_of(rec.id))
        return ReclaimFigures(before, after or 0, anon, 0, None)

    def resume(self, rec: SandboxRecord) -> None:
        """Continue a stopped QEMU, or start the restore of a VM paused to its file:
        the new QEMU is spawned here (synchronously, so the edge watches its pid) and
        restored in the background; requests wait in the agent socket's backlog."""
        machine = self._machines.get(rec.id)
        if machine is None:
            return
        facts = self.facts(rec)
        if machine.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(machine.proc.pid, signal.SIGCONT)
            machine.stopped = False
            if machine.channel is None:  # adopted paused after an edge restart
                machine.listen()
                machine.restoring = asyncio.get_running_loop().create_task(
                    self._reconnect(rec.id, machine), name=f"vm-reconnect-{rec.id}"
                )
            return
        if not machine.snapshot.is_file():
            return
        config = machine.config
        net_record = self._net_record(rec) if facts.mac is not None else None
        net = attach_vm(net_record) if net_record is not None else None
        try:
            if net is not None:
                config = dataclasses.replace(config, net=NetAttachment(net.tap_fd, net.mac))
                machine.config = config
            proc = machine.launch(prefix=self.jail_for(rec.id).prefix(config), incoming=True)
            self.start_qos(rec.spec, proc.pid)  # a new QEMU: the class goes with the sandbox
        finally:
            if net is not None:
                net.close()
        facts.pid, facts.pid_start, facts.snapshot = proc.pid, proc.start_time, False
        machine.listen()
        tap = str(net_record["ifname"]) if net_record is not None else None
        machine.restoring = asyncio.get_running_loop().create_task(
            self._finish_resume(rec.id, machine, tap), name=f"vm-resume-{rec.id}"
        )

    def _net_record(self, rec: SandboxRecord) -> dict[str, Any]:
        if rec.net is None:
            raise BackendError(f"microvm {rec.id} has a NIC but no network record")
        return dict(rec.net)

    async def _reconnect(self, sid: str, machine: Machine) -> None:
        """The channel of a VM adopted while paused, once it runs again."""
        try:
            async with machine.lock:
                channel = await machine.connect_channel(30)
                await channel.wait_ready(60)
            self.init_signals.watch(sid, machine.agent_socket)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("microvm %s: no agent channel after the resume: %s", sid, exc)
            machine.close_listener()
            await machine.kill()  # the edge's init watch fails the sandbox

    async def _finish_resume(self, sid: str, machine: Machine, tap: str | None) -> None:
        try:
            async with machine.lock:
                if tap is not None:  # the restored guest runs at once: its replies must flow
                    await link_ready(tap)
                t0 = time.monotonic()
                await machine.restore(machine.snapshot, 120)
                t1 = time.monotonic()
                channel = await machine.connect_channel(30)
                await channel.wait_ready(60)
                machine.snapshot.unlink(missing_ok=True)
                log.info(
                    "microvm %s resumed: restore %.3fs, agent %.3fs",
                    sid,
                    t1 - t0,
                    time.monotonic() - t1,
                )
            self.init_signals.watch(sid, machine.agent_socket)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("microvm %s: resume failed: %s", sid, exc)
            machine.ended = f"the resume from its snapshot failed: {exc}"
            self.audit.record(sid, AuditKind.LIFECYCLE, "resume_failed", error=str(exc))
            machine.close_listener()
            await machine.kill()  # the edge's init watch fails the sandbox

    # -- data path ----------------------------------------------------------------------
    def limit_cgroup(self, rec: SandboxRecord) -> str | None:
        return self.cgroup_of(rec.id)

    def limit_counters(self, rec: SandboxRecord) -> LimitReading:
        oom, pids = read_cgroup_counters(self.cgroups, self.cgroup_of(rec.id))
        return LimitReading(oom_kills=oom, pids_refused=pids, disk=None)

    async def stats(self, rec: SandboxRecord) -> dict[str, Any]:
        return {
            "memory_bytes": self.cgroups.memory_usage(self.cgroup_of(rec.id)),
            "cpu_seconds": self.cgroups.cpu_seconds(self.cgroup_of(rec.id)),
            "disk_bytes": disk_usage(self.vm_dir(rec.id) / "disk.img"),
            "accelerator": self.facts(rec).accel,
        }
