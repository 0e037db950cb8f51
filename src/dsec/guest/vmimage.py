"""A small bootable full-VM image the project builds itself: busybox + qemu-ga.

Why this image and not a distribution install: the FullVM backend's tests need a guest
that boots to a responding QEMU guest agent within seconds under TCG, and a
debootstrap'd Debian with systemd takes minutes there. This one is the pieces the
project already trusts: Debian's cloud kernel (dsec.guest.kernel, direct kernel boot),
a tiny initramfs (busybox and the virtio modules the cloud kernel lacks) that
mounts the virtio disk and switches to it, and an ext4 root with the host's static
busybox (dsec.images.builders.busybox_tree) plus Debian's ``qemu-guest-agent`` binary
and the libraries it links (fetched with ``apt-get download``, never installed on the
host). Its /sbin/init starts qemu-ga on the port named ``org.qemu.guest_agent.0`` and
a shell on tty1, the VGA text console, so typed keys show in a screenshot.

Everything is cached under ``<cache>/fullvm/<key>`` where the key hashes every input
(format version, kernel release, agent package, busybox), built in a temporary
directory renamed into place when complete, under a file lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import BackendError
from dsec.guest.initramfs import Entry, load_order, module_index, newc_archive
from dsec.guest.kernel import guest_kernel
from dsec.images.builders import HOST_BUSYBOX, busybox_tree
from dsec.native import cache_dir

FORMAT_VERSION = "2"
AGENT_PACKAGE = "qemu-guest-agent"
DISK_MB = 96
# What the cloud kernel has as modules and this guest needs before its root exists:
# the PCI transport, the disk, the agent's serial port, the tablet, the NIC (a sandbox
# with network rules: dsec.backends.fullvm.nic).
MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "virtio_input", "virtio_net")
CMDLINE = "console=ttyS0 quiet panic=-1"
READY_LINE = "dsec-fullvm: guest agent started"

INITRD_INIT = """#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /newroot
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
for m in $(/bin/busybox cat /modules.list); do /bin/busybox insmod /modules/$m; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do /bin/busybox usleep 50000; i=$((i+1)); done
/bin/busybox mount -t ext4 -o rw /dev/vda /newroot || /bin/busybox poweroff -f
/bin/busybox umount /proc /sys
/bin/busybox mount --move /dev /newroot/dev
exec /bin/busybox switch_root /newroot /sbin/init
"""

ROOT_INIT = f"""#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t tmpfs -o mode=0755 run /run
mount -t tmpfs -o mode=1777 tmp /tmp
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
hostname dsec-fullvm
ip link set lo up
# A sandbox with network rules: its address on the kernel command line (fullvm/nic.py).
for a in $(cat /proc/cmdline); do
  case "$a" in dsec.ip=*) addr=${{a#dsec.ip=}};; dsec.gw=*) gw=${{a#dsec.gw=}};; esac
done
if [ -n "$addr" ] && [ -n "$gw" ]; then
  ip link set eth0 up && ip addr add "$addr" dev eth0 && ip route add default via "$gw"
  echo "nameserver $gw" >/etc/resolv.conf
fi
port=
for p in /sys/class/virtio-ports/*; do
  [ "$(cat "$p/name" 2>/dev/null)" = org.qemu.guest_agent.0 ] && port=/dev/${{p##*/}}
done
(while true; do /usr/sbin/qemu-ga -m virtio-serial -p "$port" -t /run -f /run/qemu-ga.pid
  sleep 1; done) &
echo "{READY_LINE}" >/dev/console
while true; do setsid -c sh -l </dev/tty1 >/dev/tty1 2>&1; sleep 1; done
"""


@dataclass(frozen=True, slots=True)
class VMImageFiles:
    """A built image: what ``dsec image import-vm`` takes for a direct kernel boot."""

    disk: Path
    kernel: Path
    initrd: Path
    cmdline: str


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        raise BackendError(f"cannot {what}: {argv[0]} exited with {proc.returncode}: {tail}")
    return proc.stdout


def _fetch_agent(work: Path) -> Path:
    """Debian's qemu-ga binary, unpacked from its package under ``work``."""
    _run(["apt-get", "download", "-q", AGENT_PACKAGE], f"download {AGENT_PACKAGE}", cwd=work)
    debs = sorted(work.glob(f"{AGENT_PACKAGE}_*.deb"))
    if len(debs) != 1:
        raise BackendError(f"apt-get download {AGENT_PACKAGE} left {len(debs)} packages")
    _run(["dpkg-deb", "-x", str(debs[0]), str(work / "pkg")], f"unpack {debs[0].name}")
    binary = work / "pkg" / "usr" / "sbin" / "qemu-ga"
    if not binary.is_file():
        raise BackendError(f"{debs[0].name} has no usr/sbin/qemu-ga")
    return binary


def shared_libraries(binary: Path) -> list[Path]:
    """The host files ``binary`` links (ldd's answer, the loader included): the host
    is the guest's Debian release, so its libraries are the ones the package wants."""
    paths: list[Path] = []
    for line in _run(["ldd", str(binary)], f"list the libraries of {binary.name}").splitlines():
        words = line.split()
        if "not found" in line:
            raise BackendError(f"{binary.name} needs {words[0]}, which this host lacks")
        for word in words:
            if word.startswith("/"):
                paths.append(Path(word))
                break
    return paths


def _root_tree(dest: Path, agent: Path) -> None:
    busybox_tree(dest, HOST_BUSYBOX)
    (dest / "usr/sbin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(agent, dest / "usr/sbin/qemu-ga")
    for lib in shared_libraries(agent):
        target = dest / lib.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib.resolve(), target)
    init = dest / "sbin/init"
    if os.path.lexists(init):
        init.unlink()
    init.write_text(ROOT_INIT)
    os.chmod(init, 0o755)


def _disk(path: Path, tree: Path) -> None:
    with open(path, "wb") as fh:
        fh.truncate(DISK_MB << 20)
    _run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "dsec-fullvm", "-d", str(tree), str(path)],
        "make the image's root file system",
    )


def _initrd_entries() -> list[Entry]:
    kernel = guest_kernel()
    order = load_order([MODULES], module_index(kernel.modules))
    entries = [
        Entry("bin", stat.S_IFDIR | 0o755),
        Entry("bin/busybox", stat.S_IFREG | 0o755, HOST_BUSYBOX.read_bytes()),
        Entry("init", stat.S_IFREG | 0o755, INITRD_INIT.encode()),
        Entry("dev", stat.S_IFDIR | 0o755),
        Entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        Entry("modules", stat.S_IFDIR | 0o700),
        Entry(
            "modules.list", stat.S_IFREG | 0o600, "".join(f"{n}.ko\n" for _, n, _ in order).encode()
        ),
    ]
    entries += [Entry(f"modules/{n}.ko", stat.S_IFREG | 0o600, data) for _, n, data in order]
    return entries


def _key() -> str:
    kernel = guest_kernel()
    st = HOST_BUSYBOX.stat()
    parts = [
        FORMAT_VERSION,
        kernel.release,
        INITRD_INIT,
        str(DISK_MB),
        ",".join(MODULES),
        ROOT_INIT,
        f"{st.st_size}:{st.st_mtime_ns}",
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def busybox_vm_image() -> VMImageFiles:
    """The image, building it on first use (blocking: ~10 s and one small download)."""
    kernel = guest_kernel()
    final = cache_dir() / "fullvm" / f"busybox-qga-{_key()}"
    files = VMImageFiles(final / "disk.raw", kernel.vmlinuz, final / "initrd.cpio", CMDLINE)
    if files.disk.is_file() and files.initrd.is_file():
        return files
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / ".lock", "a+b") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if files.disk.is_file() and files.initrd.is_file():
            return files
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
        try:
            os.chmod(work, 0o755)  # apt's _apt user may write its download here
            agent = _fetch_agent(work)
            tree = work / "tree"
            tree.mkdir()
            _root_tree(tree, agent)
            out = work / "out"
            out.mkdir()
            _disk(out / "disk.raw", tree)
            (out / "initrd.cpio").write_bytes(newc_archive(_initrd_entries()))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(out, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return files
