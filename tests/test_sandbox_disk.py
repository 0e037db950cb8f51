"""The sandbox disk (dsec.resources.disk) on a real btrfs image: a full image heals.

One sandbox filling the whole image must not leave the file system unable to create a
file after it deletes what it wrote; that was the failure of a small image with
separate data and metadata block groups (see ``disk.MIXED_BELOW``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import linux
from dsec.resources import disk

pytestmark = pytest.mark.root

MiB = 1024 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[disk.SandboxDisk]:
    pool = disk.SandboxDisk(
        tmp_path / "sandboxes", tmp_path / "sandboxes.img", size_bytes=512 * MiB, preallocate=True
    )
    pool.open()
    try:
        assert pool.enabled, "btrfs sandbox disk did not mount"
        yield pool
    finally:
        for entry in os.scandir(pool.mount_point):
            pool.remove_dir(Path(entry.path))
        pool.close()
        assert not linux.is_mounted(pool.mount_point)


def fill(path: Path) -> int:
    """Write zeros to ``path`` until the file system refuses, as ``dd conv=fsync`` does
    (buffered, one fsync at the end); returns the errno."""
    block = b"\0" * MiB
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        try:
            while True:
                os.write(fd, block)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.fsync(fd)
            return exc.errno or 0
    finally:
        os.close(fd)


def test_a_small_image_uses_mixed_block_groups(small_disk: disk.SandboxDisk) -> None:
    out = subprocess.run(
        ["btrfs", "filesystem", "df", str(small_disk.mount_point)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Data+Metadata" in out, out


def test_after_one_sandbox_fills_the_image_and_deletes_everyone_can_write_again(
    small_disk: disk.SandboxDisk,
) -> None:
    hog, neighbour = small_disk.mount_point / "hog", small_disk.mount_point / "neighbour"
    # The hog may use the whole image: its quota is no bound here, the image is.
    small_disk.create_dir(hog, limit_bytes=small_disk.capacity)
    small_disk.create_dir(neighbour, limit_bytes=small_disk.capacity)
    assert fill(hog / "big") == errno.ENOSPC
    with pytest.raises(OSError) as full:  # the neighbour feels the full image...
        (neighbour / "small").write_bytes(b"x" * (4 * MiB))
    assert full.value.errno == errno.ENOSPC
    (hog / "big").unlink()
    os.sync()
    # ... and both create files soon after the hog deleted its file. With separate
    # block groups this stayed ENOSPC for more than 30 s (the empty data chunk was
    # never given back to metadata).
    deadline = time.monotonic() + 5
    while True:
        try:
            for d in (hog, neighbour):
                for i in range(50):
                    (d / f"f{i}").write_text("fine")
            break
        except OSError as exc:
            if exc.errno != errno.ENOSPC or time.monotonic() > deadline:
                raise
            os.sync()
            time.sleep(0.2)
    assert (neighbour / "f49").read_text() == "fine"
