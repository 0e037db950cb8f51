"""``debian-desktop``: a bootable Debian bookworm VM image with Xorg, for computer use.

Why these pieces: the FullVM backend's display is QEMU's std VGA, which Linux drives
with ``bochs-drm``; Debian's cloud kernel (the microVM's and the small test image's,
dsec.guest.vmimage) is built without DRM at all, so this image carries Debian's
generic kernel (``linux-image-amd64``) and its initramfs-tools initrd, and boots them
directly (``-kernel``: no boot loader, no partition table; the root file system is the
whole virtio disk). systemd starts ``qemu-guest-agent`` when its virtio-serial port
appears, getty logs root in on tty1 by itself, and root's login starts X (the
modesetting driver on bochs-drm, at the display size the VGA's EDID prefers) with
matchbox, a window manager of one small binary, and an xterm. A VM with network rules
has an eth0 (virtio-net on its tap): systemd-networkd asks the edge's DHCP responder
(dsec.net.dhcp) for the slot's address, gateway and DNS server (systemd-resolved's
stub is /etc/resolv.conf), and asks again whenever the carrier comes back, which is how
a VM started from a snapshot moves to its new slot's address (the backend unplugs and
replugs the cable after the restore, dsec.backends.fullvm.nic.relink); without rules
there is no eth0 and nothing waits for one.

DSec's own agent (``dsec-init``, the containers' and microVMs' agent) serves what
qemu-ga cannot (sessions, PTY, streaming): ``dsec-agent.service`` runs
``dsec-vminit --service``, which finds the ``dsec.agent`` virtio-serial port, relays it
to the agent's root-only socket and execs the agent (dsec-vminit.c, service_main). Both
binaries are the project's static builds, copied root-owned into /usr/local/lib/dsec;
the key hashes their sources, so an agent change rebuilds the image (the host speaks
to the agent it was built with).

Built on the host with debootstrap (as ``debian-python``, dsec.images.builders), into
``$DSEC_CACHE_DIR/fullvm/debian-desktop-<key>`` (disk.qcow2, vmlinuz, initrd.img), in
a temporary directory renamed into place when complete, under a file lock; the key
hashes every input here. ``dsec image build debian-desktop`` builds it where the CLI
runs (root) and imports it like ``dsec image import-vm``.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsec.agent import build as agent_build
from dsec.errors import ImageBuildError
from dsec.guest.vmimage import VMImageFiles
from dsec.images.builders import ProgressFn, debootstrap, run_logged
from dsec.native import cache_dir

FORMAT_VERSION = "1"
SUITE = "bookworm"
PACKAGES = (
    "systemd-sysv", "udev", "kmod", "dbus", "procps",
    "linux-image-amd64", "initramfs-tools",
    "qemu-guest-agent",
    "systemd-resolved",
    "xserver-xorg-core", "xserver-xorg-input-libinput", "xserver-xorg-video-fbdev",
    "xinit", "xterm", "xfonts-base", "matchbox-window-manager",
)  # fmt: skip
SLACK_MB = 512  # free space in the root file system beyond what the tree takes
CMDLINE = "root=/dev/vda rw console=ttyS0 net.ifnames=0 quiet"

FILES: dict[str, str] = {
    "etc/fstab": "/dev/vda / ext4 rw,errors=remount-ro 0 1\n",
    "etc/hostname": "dsec-desktop\n",
    "etc/systemd/network/20-eth0.network": (
        "[Match]\nName=eth0\n\n[Network]\nDHCP=ipv4\n"
        "IgnoreCarrierLoss=no\nConfigureWithoutCarrier=no\n"
    ),
    # getty logs root in on tty1 without a password (the console is the VM's own)
    "etc/systemd/system/getty@tty1.service.d/autologin.conf": (
        "[Service]\nExecStart=\nExecStart=-/sbin/agetty --autologin root --noclear %I $TERM\n"
    ),
    # root's login on tty1 starts X on that VT; anywhere else it is a plain shell
    "root/.bash_profile": (
        '[ "$(tty)" = /dev/tty1 ] && [ -z "$DISPLAY" ] && '
        "exec startx -- -nolisten tcp vt1 >/var/log/startx.log 2>&1\n"
    ),
    "root/.xinitrc": (
        "xterm -geometry 100x30+10+10 &\nexec matchbox-window-manager -use_titlebar no\n"
    ),
    # the agent starts early (before sysinit's end: it needs only /run and /dev) and comes
    # back if it dies, its port closed for 5 s: longer than the host's check interval
    # (the backend's guest-end watcher), so the host sees it and links the new mux;
    # without the port it exits 0 and stays down
    "etc/systemd/system/dsec-agent.service": (
        "[Unit]\nDescription=DSec agent (sessions, PTY, streaming for the host)\n"
        "DefaultDependencies=no\nConflicts=shutdown.target\nBefore=shutdown.target\n\n"
        "[Service]\nExecStart=/usr/local/lib/dsec/dsec-vminit --service "
        "/usr/local/lib/dsec/dsec-init\nRestart=on-failure\nRestartSec=5\n"
        "KillMode=control-group\n\n[Install]\nWantedBy=sysinit.target\n"
    ),
}
AGENT_DIR = "usr/local/lib/dsec"
# the guest agent's unit is static (udev wants it when its port appears); wanted by
# multi-user too, so a missing udev rule cannot leave the VM without an agent; the
# network (networkd, resolved) enabled; resolv.conf is resolved's stub (symlinks all)
WANTS = {
    "etc/systemd/system/sysinit.target.wants/dsec-agent.service": (
        "/etc/systemd/system/dsec-agent.service"
    ),
    "etc/systemd/system/multi-user.target.wants/qemu-guest-agent.service": (
        "/lib/systemd/system/qemu-guest-agent.service"
    ),
    "etc/systemd/system/multi-user.target.wants/systemd-networkd.service": (
        "/lib/systemd/system/systemd-networkd.service"
    ),
    "etc/systemd/system/sockets.target.wants/systemd-networkd.socket": (
        "/lib/systemd/system/systemd-networkd.socket"
    ),
    "etc/systemd/system/multi-user.target.wants/systemd-resolved.service": (
        "/lib/systemd/system/systemd-resolved.service"
    ),
    "etc/resolv.conf": "/run/systemd/resolve/stub-resolv.conf",
}


def _key() -> str:
    parts = [FORMAT_VERSION, SUITE, ",".join(PACKAGES), str(SLACK_MB), CMDLINE, repr(FILES)]
    parts += [repr(WANTS), agent_build.source_digest(), agent_build.vminit_source_digest()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def image_dir() -> Path:
    return cache_dir() / "fullvm" / f"debian-desktop-{_key()}"


def cached() -> VMImageFiles | None:
    """The built image, None if it is not built yet."""
    final = image_dir()
    files = VMImageFiles(final / "disk.qcow2", final / "vmlinuz", final / "initrd.img", CMDLINE)
    ok = all(p.is_file() for p in (files.disk, files.kernel, files.initrd))
    return files if ok else None


def _configure(tree: Path) -> None:
    for rel, text in FILES.items():
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            path.unlink()
        path.write_text(text)
    resolv = tree / "etc/resolv.conf"
    if not resolv.is_symlink():  # debootstrap copied the host's: resolved's stub instead
        resolv.unlink(missing_ok=True)
    for rel, target in WANTS.items():
        link = tree / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(link):
            link.symlink_to(target)
    agent_dir = tree / AGENT_DIR
    agent_dir.mkdir(parents=True, exist_ok=True)
    for binary in (agent_build.agent_binary(), agent_build.vminit_binary()):
        dest = agent_dir / binary.name.rsplit("-", 1)[0]  # dsec-init-<digest> -> dsec-init
        shutil.copyfile(binary, dest)
        os.chown(dest, 0, 0)
        dest.chmod(0o755)
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_Packages"):
        for path in tree.glob(pattern):
            path.unlink()


def _boot_files(tree: Path, out: Path) -> None:
    kernels = sorted((tree / "boot").glob("vmlinuz-*"))
    initrds = sorted((tree / "boot").glob("initrd.img-*"))
    if len(kernels) != 1 or len(initrds) != 1:
        raise ImageBuildError(
            f"the tree has {len(kernels)} kernels and {len(initrds)} initrds, not one each",
            step="kernel",
        )
    shutil.copyfile(kernels[0], out / "vmlinuz")
    shutil.copyfile(initrds[0], out / "initrd.img")


def _tree_mb(tree: Path) -> int:
    used = subprocess.run(
        ["du", "-sxm", str(tree)], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    return int(used)


async def _disk(tree: Path, out: Path, progress: ProgressFn | None) -> None:
    raw = out.parent / "disk.raw"
    raw.touch()
    size_mb = await asyncio.to_thread(_tree_mb, tree) + SLACK_MB
    await asyncio.to_thread(os.truncate, raw, size_mb << 20)
    if progress:
        progress(f"mkfs.ext4: a {size_mb} MiB root file system", 0, None)
    await run_logged(
        ["mkfs.ext4", "-q", "-F", "-L", "dsec-desktop", "-d", str(tree), str(raw)], step="mkfs"
    )
    await run_logged(
        ["qemu-img", "convert", "-O", "qcow2", str(raw), str(out / "disk.qcow2")], step="qcow2"
    )
    raw.unlink()


async def build_desktop_image(
    *, rebuild: bool = False, progress: ProgressFn | None = None
) -> VMImageFiles:
    """The image, built on first use (as root; minutes and ~250 MB of packages)."""
    if not rebuild and (files := cached()) is not None:
        return files
    final = image_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_file = await asyncio.to_thread(open, final.parent / ".desktop.lock", "a+b")
    with lock_file:
        await asyncio.to_thread(fcntl.flock, lock_file, fcntl.LOCK_EX)
        if not rebuild and (files := cached()) is not None:
            return files
        work = Path(tempfile.mkdtemp(prefix=".build-desktop-", dir=final.parent))
        try:
            tree, out = work / "tree", work / "out"
            out.mkdir()
            await debootstrap(tree, suite=SUITE, include=PACKAGES, progress=progress)
            await asyncio.to_thread(_configure, tree)
            await asyncio.to_thread(_boot_files, tree, out)
            await _disk(tree, out, progress)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(out, final)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
    files = cached()
    assert files is not None
    return files
