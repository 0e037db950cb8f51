"""What the fullvm backend keeps about one VM, persisted with the record (edge.db).

Enough to find the VM again after an edge restart without trusting anything the guest
can write: the QEMU process by pid *and* start time, the directory holding its
overlay and sockets, and its shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.backends.base import BackendFacts


@dataclass
class FullVMFacts(BackendFacts):
    dir: Path | None = None
    pid: int | None = None
    pid_start: int | None = None
    accel: str = "tcg"
    vcpus: int = 1
    memory_mb: int = 512
    disk_bytes: int = 0  # the overlay's virtual size: the most its file can hold
    snapshot: bool = False  # paused to <dir>/state.snap (no QEMU meanwhile)

    @property
    def init_pid(self) -> int | None:
        return self.pid

    @property
    def accelerator(self) -> str | None:
        return self.accel

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "accel": self.accel,
            "vcpus": self.vcpus,
            "memory_mb": self.memory_mb,
            "disk_bytes": self.disk_bytes,
            "snapshot": self.snapshot,
        }
        if self.dir is not None:
            out["dir"] = str(self.dir)
        if self.pid is not None:
            out["pid"] = self.pid
        if self.pid_start is not None:
            out["pid_start"] = self.pid_start
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FullVMFacts:
        """A value of the wrong type reads as absent rather than failing the edge."""

        def num(key: str) -> int | None:
            v = data.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        d = data.get("dir")
        accel = data.get("accel")
        return cls(
            dir=Path(d) if isinstance(d, str) and d else None,
            pid=num("pid"),
            pid_start=num("pid_start"),
            accel=accel if accel in ("kvm", "tcg") else "tcg",
            vcpus=num("vcpus") or 1,
            memory_mb=num("memory_mb") or 512,
            disk_bytes=num("disk_bytes") or 0,
            snapshot=data.get("snapshot") is True,
        )

    @classmethod
    def of(cls, facts: BackendFacts) -> FullVMFacts:
        return facts if isinstance(facts, FullVMFacts) else cls.from_json(facts.to_json())
