"""Which accelerator the microVMs use: KVM only if it really boots a guest, else TCG.

``/dev/kvm`` existing is not enough: on our machines it is ``kvm_pvm``, which accepts
every ioctl and then hangs an ordinary guest after real-mode boot. So KVM is chosen
only when a probe VM, booted with our guest kernel under ``-accel kvm``, prints a late
boot line within a deadline. The probe costs up to ``deadline`` seconds once per
(QEMU version, host kernel, guest kernel); the answer and its reason are cached in a
file under the cache dir, so an edge start normally reads one small file.
``DSEC_MICROVM_ACCEL=tcg|kvm`` overrides (a forced kvm that cannot boot fails at
create, through the boot deadline, never as a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dsec.backends.microvm.qemu import Accel, QemuProcess, VMConfig, qemu_version
from dsec.backends.microvm.qmp import Qmp, QmpError
from dsec.errors import BackendError, InvalidArgument
from dsec.native import cache_dir

log = logging.getLogger(__name__)
ENV = "DSEC_MICROVM_ACCEL"
KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12
DEFAULT_DEADLINE = 4.0
# Lines the kernel prints only after it ran for real (the last two when there is no
# root file system: still proof that the accelerator runs a guest).
BOOT_MARKERS = ("Freeing unused kernel", "Run /init", "Kernel panic", "VFS: Unable to mount")


@dataclass(frozen=True)
class AccelChoice:
    accel: Accel
    reason: str
    qemu: str
    host_kernel: str
    forced: bool = False
    cached: bool = False


def kvm_device_usable(path: str = "/dev/kvm") -> str | None:
    """None if ``path`` opens read-write and speaks the KVM API, else why not."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as exc:
        return f"{path}: KVM_GET_API_VERSION failed: {exc.strerror}"
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return f"{path}: KVM API version {version}, want {KVM_API_VERSION}"
    return None


async def boots_under_kvm(kernel: Path, deadline: float) -> str | None:
    """Boot ``kernel`` (no initrd) under KVM; None if it reached a late boot line
    within ``deadline``, else why not. The probe VM is always killed."""
    with tempfile.TemporaryDirectory(prefix="dsec-accel-") as tmp:
        d = Path(tmp)
        config = VMConfig(
            kernel=kernel,
            initrd=None,
            agent_socket=d / "agent.sock",
            qmp_socket=d / "qmp.sock",
            log_path=d / "qemu.log",
            params={"loglevel": "7"},  # after 'quiet': the boot lines are the marker
            memory_mb=128,
            accel="kvm",
        )
        t0 = time.monotonic()
        try:
            proc = QemuProcess.launch(config)
        except BackendError as exc:
            return f"QEMU -accel kvm did not start: {exc.message}"
        qmp: Qmp | None = None
        try:
            qmp = await Qmp.connect(config.qmp_socket, timeout=deadline, alive=proc.is_alive)
            while time.monotonic() - t0 < deadline:
                text = await qmp.console()
                if any(m in text for m in BOOT_MARKERS):
                    return None
                if not proc.is_alive():
                    return f"QEMU -accel kvm exited: {proc.log_tail()}"
                await asyncio.sleep(0.02)
            return f"a guest under KVM printed no boot line within {deadline}s (hangs)"
        except QmpError as exc:
            return f"QEMU -accel kvm: {exc.message} {proc.log_tail()}".strip()
        finally:
            if qmp is not None:
                await qmp.close()
            await asyncio.to_thread(proc.kill)


def _cache_file() -> Path:
    return cache_dir() / "microvm" / "accel.json"


def _key(kernel: Path) -> dict[str, str]:
    st = kernel.stat()
    return {
        "qemu": qemu_version(),
        "host_kernel": os.uname().release,
        "guest_kernel": f"{kernel.resolve()}:{st.st_size}:{st.st_mtime_ns}",
    }


async def probe_accelerator(
    kernel: Path, *, deadline: float = DEFAULT_DEADLINE, use_cache: bool = True
) -> AccelChoice:
    """The accelerator for this host (see the module doc), probing at most once."""
    forced = os.environ.get(ENV, "").strip().lower()
    host = os.uname().release
    if forced:
        if forced not in ("kvm", "tcg"):
            raise InvalidArgument(f"{ENV}={forced!r}: want kvm or tcg")
        if forced == "kvm" and (why := kvm_device_usable()) is not None:
            raise BackendError(f"{ENV}=kvm but KVM is not usable: {why}")
        accel: Accel = "kvm" if forced == "kvm" else "tcg"
        return AccelChoice(accel, f"forced by {ENV}", qemu_version(), host, forced=True)
    key = _key(kernel)
    path = _cache_file()
    if use_cache:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            saved = json.loads(path.read_text())
            if saved["key"] == key and saved["accel"] in ("kvm", "tcg"):
                return AccelChoice(
                    saved["accel"], str(saved["reason"]), key["qemu"], host, cached=True
                )
    why = kvm_device_usable()
    if why is None:
        why = await boots_under_kvm(kernel, deadline)
    choice = (
        AccelChoice("tcg", f"KVM not usable: {why}", key["qemu"], host)
        if why is not None
        else AccelChoice("kvm", "a guest booted under KVM", key["qemu"], host)
    )
    log.info("microvm accelerator: %s (%s)", choice.accel, choice.reason)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, **asdict(choice)}))
    os.replace(tmp, path)
    return choice
