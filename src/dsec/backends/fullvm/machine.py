"""The QEMU command line of one full VM (q35, PCI, firmware, a display).

Why q35 and not the microVM machine: a full VM boots an OS from its own disk through
firmware (SeaBIOS, which ships with QEMU; OVMF for UEFI), needs a display adapter for
computer use (std VGA: QEMU's screendump reads it, no guest software involved), a
keyboard (the PS/2 one q35 has) and an absolute pointer (virtio-tablet), and ordinary
PCI devices any OS has drivers for. A direct kernel boot (``-kernel``) is still
offered, for images that carry their kernel (the project's test image does); under
UEFI, OVMF loads that kernel itself (fw_cfg), so both firmwares boot either kind.

The process is started like a microVM's (dsec.backends.microvm.qemu.QemuProcess.spawn:
own session, jailed, console in a bounded ring, ``-action shutdown=pause``), and its
QMP socket is named the same way, so ``find_running`` finds leftovers of either.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from dsec.backends.fullvm import nic
from dsec.backends.microvm.jail import Jail
from dsec.backends.microvm.qemu import (
    CONSOLE_RING_BYTES,
    SANDBOX,
    Accel,
    QemuProcess,
    cpu_memory_argv,
    guest_end_argv,
    qemu_binary,
    supports_sandbox,
)
from dsec.errors import BackendError

Firmware = Literal["bios", "uefi"]
GA_PORT = "org.qemu.guest_agent.0"  # the name every qemu-ga looks for
# DSec's own agent, in images that have it (dsec.backends.fullvm.agentlink): its port
# name is the one the guest end looks for (dsec-vminit.c, service mode)
AGENT_PORT = "dsec.agent"
AGENT_CHARDEV = "dsecagent"
AGENT_SOCKET = "agent.sock"  # in the VM's socket directory, beside qmp.sock
# Debian's OVMF (package ovmf): the firmware code, shared read-only, and the template
# of the variable store each UEFI VM gets a private copy of (it writes boot entries).
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
DEFAULT_DISPLAY = (1280, 800)  # QEMU's std VGA's own preferred mode
VGA_MEMORY_MB = 32  # enough for 3840x2160 at 32 bits per pixel
# QEMU's VNC server listens on this unix socket in the VM's socket directory (never a TCP
# port): only the edge (root) can reach it, so it has no password (dsec.edge.liveview).
VNC_SOCKET = "vnc.sock"


@dataclass(frozen=True)
class DirectBoot:
    """A kernel the image carries, booted without a boot loader."""

    kernel: Path
    initrd: Path | None
    cmdline: str


@dataclass(frozen=True)
class FullVMConfig:
    """Everything that decides one full VM's QEMU command line."""

    disk: Path  # the sandbox's private qcow2 overlay
    ga_socket: Path
    qmp_socket: Path
    log_path: Path
    vcpus: int = 1
    memory_mb: int = 512
    accel: Accel = "tcg"
    firmware: Firmware = "bios"
    boot: DirectBoot | None = None
    efi_vars: Path | None = None  # the VM's own copy of OVMF_VARS (firmware="uefi")
    display: tuple[int, int] = DEFAULT_DISPLAY
    vnc_socket: Path | None = None  # the live view's VNC server (unix socket), if any
    nic_mac: str | None = None  # a virtio-net NIC on the sandbox's tap (dsec.net.vmtap)
    agent_socket: Path | None = None  # the chardev of DSec's agent port, if any

    def readable_files(self) -> list[Path]:
        """What QEMU reads besides the disk chain (for the jail's read-only binds);
        firmware is under /usr, which the jail shows read-only as a whole."""
        files: list[Path] = []
        if self.boot is not None:
            files.append(self.boot.kernel)
            if self.boot.initrd is not None:
                files.append(self.boot.initrd)
        return files


def build_argv(config: FullVMConfig, *, binary: str | None = None) -> list[str]:
    """The full qemu-system-x86_64 argv (pure: no files touched)."""
    if config.firmware == "uefi" and config.efi_vars is None:
        raise BackendError("a UEFI VM needs its own copy of the OVMF variable store")
    if config.vcpus < 1 or config.memory_mb < 64:
        raise BackendError(f"bad VM size: {config.vcpus} vCPUs, {config.memory_mb} MiB")
    paths = (config.disk, config.ga_socket, config.qmp_socket, config.vnc_socket or "")
    for path in (*paths, config.agent_socket or ""):
        if "," in str(path):
            raise BackendError(f"a VM path contains a comma: {path}")
    argv = [
        binary or qemu_binary(),
        "-M", "q35",
        *cpu_memory_argv(config.accel, config.memory_mb, config.vcpus),
        "-nodefaults", "-no-user-config",
        "-display", "none",
        # std VGA; its EDID offers the display size as the preferred mode, which OVMF's
        # framebuffer and a guest's X server take (a BIOS text console stays 720x400).
        "-device",
        f"VGA,vgamem_mb={VGA_MEMORY_MB},xres={config.display[0]},yres={config.display[1]}",
        *guest_end_argv(CONSOLE_RING_BYTES),
        "-chardev", f"socket,id=qmp,path={config.qmp_socket},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-drive", f"id=d0,file={config.disk},format=qcow2,if=none,discard=unmap",
        # The disk boots first, unless a kernel is loaded directly (its option ROM
        # takes boot index 0 then).
        "-device", "virtio-blk-pci,drive=d0" + ("" if config.boot else ",bootindex=0"),
        "-device", "virtio-serial-pci",
        "-chardev", f"socket,id=ga,path={config.ga_socket},server=on,wait=off",
        "-device", f"virtserialport,chardev=ga,name={GA_PORT}",
        "-device", "virtio-tablet-pci",
    ]  # fmt: skip
    if config.agent_socket is not None:
        argv += [
            "-chardev", f"socket,id={AGENT_CHARDEV},path={config.agent_socket},server=on,wait=off",
            "-device", f"virtserialport,chardev={AGENT_CHARDEV},name={AGENT_PORT}",
        ]  # fmt: skip
    if config.nic_mac is not None:
        argv += nic.qemu_args(config.nic_mac)
    if config.firmware == "uefi":
        assert config.efi_vars is not None
        argv += [
            "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
            "-drive", f"if=pflash,format=raw,unit=1,file={config.efi_vars}",
        ]  # fmt: skip
    if config.boot is not None:
        argv += ["-kernel", str(config.boot.kernel), "-append", config.boot.cmdline]
        if config.boot.initrd is not None:
            argv += ["-initrd", str(config.boot.initrd)]
    if config.vnc_socket is not None:
        argv += ["-vnc", f"unix:{config.vnc_socket}"]
    if supports_sandbox():
        argv += ["-sandbox", SANDBOX]
    return argv


@dataclass(frozen=True)
class Launch:
    """How one VM's QEMU is started: its argv (no launcher) and what its jail shows.

    Written next to the VM at create (``launch.json`` in the root-only VM directory,
    which neither QEMU nor the guest can write) and read back to start the same
    machine again: a resume from a pause file must restore into an identical command
    line, also after an edge restart, when the create's inputs are gone."""

    argv: tuple[str, ...]
    ro: tuple[str, ...]
    rw: tuple[str, ...]
    kvm: bool
    qmp_socket: str
    ga_socket: str
    log_path: str

    @classmethod
    def of(cls, config: FullVMConfig, ro: list[Path], rw: list[Path]) -> Launch:
        return cls(
            argv=tuple(build_argv(config)),
            ro=tuple(map(str, ro)),
            rw=tuple(map(str, rw)),
            kvm=config.accel == "kvm",
            qmp_socket=str(config.qmp_socket),
            ga_socket=str(config.ga_socket),
            log_path=str(config.log_path),
        )

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Launch | None:
        """The saved launch, None if there is none or it does not parse."""
        try:
            doc = json.loads(path.read_text())
            return cls(
                argv=tuple(str(a) for a in doc["argv"]),
                ro=tuple(str(a) for a in doc["ro"]),
                rw=tuple(str(a) for a in doc["rw"]),
                kvm=doc["kvm"] is True,
                qmp_socket=str(doc["qmp_socket"]),
                ga_socket=str(doc["ga_socket"]),
                log_path=str(doc["log_path"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def agent_socket(self) -> Path | None:
        """The agent port's chardev, None for a VM launched without one (before the
        port existed: its launch.json is read back after an edge restart)."""
        path = Path(self.qmp_socket).parent / AGENT_SOCKET
        chardev = f"socket,id={AGENT_CHARDEV},path={path},server=on,wait=off"
        return path if chardev in self.argv else None

    def _agent_stale(self) -> tuple[Path, ...]:
        return (self.agent_socket,) if self.agent_socket is not None else ()

    def spawn(
        self, jail: Jail, *, incoming: bool = False, tap_fd: int | None = None
    ) -> QemuProcess:
        """Start this QEMU jailed (``incoming``: waiting for a restore, see
        dsec.backends.microvm.snapshot.load_into); ``tap_fd``: the sandbox's tap,
        opened for this launch (a VM with a NIC needs one, see nic.py)."""
        prefix = jail.prefix_for(
            ro=[Path(p) for p in self.ro], rw=[Path(p) for p in self.rw], kvm=self.kvm
        )
        argv = [*prefix, *nic.with_fd(self.argv, tap_fd)]
        argv += ["-incoming", "defer"] if incoming else []
        return QemuProcess.spawn(
            argv,
            qmp_socket=Path(self.qmp_socket),
            log_path=Path(self.log_path),
            stale=(Path(self.qmp_socket), Path(self.ga_socket), *self._agent_stale()),
            pass_fds=[tap_fd] if tap_fd is not None else [],
        )
