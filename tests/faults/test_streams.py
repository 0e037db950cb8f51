"""Bounded memory per request: a memory-limited platform takes 512 MiB bodies.

The platform (a real `dsec up`, idle) is moved into a memory cgroup of its own that
lets it charge at most 300 MiB more than it holds when it moves in, and then every
large-body route carries 512 MiB+ each way. A route that buffered a body whole would
get the platform OOM-killed (the issue's finding: one 128 MiB upload did it); here it
must survive with every file intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec import DSecSyncClient
from tests.conftest import PlatformProcess, platform_process

pytestmark = pytest.mark.root

MiB = 1 << 20
SIZE = 512 * MiB + 12345  # not a multiple of any chunk size
HEADROOM = 300 * MiB
MEMORY_V1 = Path("/sys/fs/cgroup/memory")
MEMORY_V2 = Path("/sys/fs/cgroup/unified")


class MemoryCgroup:
    """A memory cgroup of this test (v1 where the memory controller is on v1, as on our
    hybrid hosts; v2 otherwise), removed on exit whatever happened."""

    def __init__(self) -> None:
        name = "dsec-memtest-" + secrets.token_hex(4)
        self.v1 = (MEMORY_V1 / "memory.limit_in_bytes").exists()
        self.path = (MEMORY_V1 if self.v1 else MEMORY_V2) / name
        self.path.mkdir()
        if self.v1:  # the platform's idle pages move with it, so the limit counts them
            with contextlib.suppress(OSError):
                (self.path / "memory.move_charge_at_immigrate").write_text("3")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def usage(self) -> int:
        name = "memory.usage_in_bytes" if self.v1 else "memory.current"
        return int((self.path / name).read_text())

    def peak(self) -> int:
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return int((self.path / name).read_text())

    def reset_peak(self) -> None:
        with contextlib.suppress(OSError):
            (self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")).write_text(
                "0"
            )

    def limit(self, limit: int) -> None:
        (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))

    def oom_kills(self) -> int:
        text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # back to the root: its pages too
                (self.path.parent / "cgroup.procs").write_text(pid)
        self.path.rmdir()


@contextlib.contextmanager
def memory_cgroup() -> Iterator[MemoryCgroup]:
    cg = MemoryCgroup()
    try:
        yield cg
    finally:
        cg.remove()


def payload(size: int = SIZE) -> Iterator[bytes]:
    """Deterministic, incompressible-enough chunks (the same on every call)."""
    base = hashlib.sha256(b"dsec").digest() * (MiB // 32)
    sent = 0
    i = 0
    while sent < size:
        chunk = i.to_bytes(8, "big") + base[8:]
        chunk = chunk[: size - sent]
        sent += len(chunk)
        i += 1
        yield chunk


def payload_sha(size: int = SIZE) -> str:
    h = hashlib.sha256()
    for chunk in payload(size):
        h.update(chunk)
    return h.hexdigest()


def tar_stream(name: str, size: int = SIZE) -> Iterator[bytes]:
    """A one-member tar, generated on the fly (never whole in this process either)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    yield info.tobuf(format=tarfile.PAX_FORMAT)
    yield from payload(size)
    yield b"\0" * ((-size) % 512) + b"\0" * 1024


class _Reader(io.RawIOBase):
    """A file object over a response's chunks, for tarfile's stream mode."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self.buf:
            try:
                self.buf = next(self.chunks)
            except StopIteration:
                return 0
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n


def hash_body(resp: httpx.Response) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    for chunk in resp.iter_bytes(MiB):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def hash_tar_member(resp: httpx.Response, name: str) -> tuple[str, int]:
    with tarfile.open(fileobj=_Reader(resp.iter_bytes(MiB)), mode="r|") as tar:
        for member in tar:
            if member.name.lstrip("./") == name:
                fh = tar.extractfile(member)
                assert fh is not None
                h = hashlib.sha256()
                while block := fh.read(MiB):
                    h.update(block)
                return h.hexdigest(), member.size
    raise AssertionError(f"{name} not in the archive")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[PlatformProcess, MemoryCgroup]]:
    with platform_process() as plat, memory_cgroup() as cg:
        assert plat.proc is not None
        with DSecSyncClient(plat.url, plat.api_key) as client:
            client.build_image("busybox")
        cg.add(plat.proc.pid)
        cg.limit(cg.usage() + HEADROOM)
        cg.reset_peak()
        try:
            yield plat, cg
        finally:
            cg.limit(-1 if cg.v1 else 2**62)  # let it shut down unhindered


def test_large_bodies_under_a_memory_limit(
    limited: tuple[PlatformProcess, MemoryCgroup],
) -> None:
    plat, cg = limited
    assert plat.proc is not None
    idle = cg.usage()
    idle_rss = _rss_kib(plat.proc.pid) * 1024
    want = payload_sha()
    headers = {"Authorization": f"Bearer {plat.api_key}"}
    timeout = httpx.Timeout(300, connect=10)
    with httpx.Client(base_url=plat.url, headers=headers, timeout=timeout) as http:
        spec = {"spec": {"container_image": "busybox:latest", "memory_limit_mb": 128}}
        r = http.post("/v1/sandboxes", json=spec)
        assert r.status_code == 201, r.text
        info = r.json()
        sid = info["id"]
        token = info["data_path"]["token"]
        edge = {"Authorization": f"Bearer {token}"}
        try:
            peaks: dict[str, int] = {}

            def check(route: str) -> None:
                assert plat.proc is not None and plat.proc.poll() is None, f"died on {route}"
                assert cg.oom_kills() == 0, f"OOM kill on {route}"
                peaks[route] = cg.peak()

            # 1. control route, streamed (the route that was OOM-killed at 128 MiB)
            r = http.put(
                f"/v1/sandboxes/{sid}/files", params={"path": "/root/a"}, content=payload()
            )
            assert r.status_code == 204, r.text
            check("PUT /v1/sandboxes/{id}/files")
            with http.stream("GET", f"/v1/sandboxes/{sid}/files", params={"path": "/root/a"}) as r:
                assert r.status_code == 200
                assert hash_body(r) == (want, SIZE)
            check("GET /v1/sandboxes/{id}/files")
            # 2. the data path's file routes (sandbox token)
            r = http.put(
                f"/v1/edge/sandboxes/{sid}/files",
                params={"path": "/root/b"},
                content=payload(),
                headers=edge,
            )
            assert r.status_code == 204, r.text
            check("PUT /v1/edge/sandboxes/{id}/files")
            with http.stream(
                "GET", f"/v1/edge/sandboxes/{sid}/files", params={"path": "/root/b"}, headers=edge
            ) as r:
                assert r.status_code == 200
                assert hash_body(r) == (want, SIZE)
            check("GET /v1/edge/sandboxes/{id}/files")
            http.post(f"/v1/sandboxes/{sid}/fs/remove", json={"path": "/root/a"})
            http.post(f"/v1/sandboxes/{sid}/fs/remove", json={"path": "/root/b"})
            # 3. archives, both mounts
            for prefix, hdrs in (
                (f"/v1/sandboxes/{sid}", headers),
                (f"/v1/edge/sandboxes/{sid}", edge),
            ):
                r = http.post(f"/v1/sandboxes/{sid}/fs/mkdir", json={"path": "/root/t"})
                assert r.status_code == 204, r.text
                r = http.put(
                    f"{prefix}/archive",
                    params={"path": "/root/t"},
                    content=tar_stream("big.bin"),
                    headers=hdrs,
                )
                assert r.status_code == 200, r.text
                check(f"PUT {prefix.replace(sid, '{id}')}/archive")
                with http.stream(
                    "GET", f"{prefix}/archive", params={"path": "/root/t"}, headers=hdrs
                ) as r:
                    assert r.status_code == 200
                    assert hash_tar_member(r, "big.bin") == (want, SIZE)
                check(f"GET {prefix.replace(sid, '{id}')}/archive")
                r = http.post(
                    f"/v1/sandboxes/{sid}/fs/remove", json={"path": "/root/t", "recursive": True}
                )
                assert r.status_code == 204, r.text
            # 4. a body over its cap is a typed 413 before the server reads it
            r = http.put(
                f"/v1/sandboxes/{sid}/files",
                params={"path": "/root/x", "job_id": "j", "rollout_id": "r", "step": 0},
                content=payload(40 * MiB),
            )
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "payload_too_large"
            check("PUT /v1/sandboxes/{id}/files (trajectory step over its cap)")
        finally:
            http.delete(f"/v1/sandboxes/{sid}")
    peak = max(peaks.values())
    report = ", ".join(f"{k}: {v // MiB} MiB" for k, v in peaks.items())
    print(
        f"\nplatform RSS {idle_rss // MiB} MiB, charged {idle // MiB} MiB, limit "
        f"+{HEADROOM // MiB} MiB; cgroup peak after each route: {report}"
    )
    assert peak - idle < HEADROOM  # the limit held and nothing was killed (checked above)
    assert os.path.exists(f"/proc/{plat.proc.pid}")
