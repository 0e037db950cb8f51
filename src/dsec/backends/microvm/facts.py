"""What the microVM backend keeps about one VM, typed and persisted (edge.db).

Enough to find the VM again after an edge restart without trusting anything the guest
can write: the QEMU process by pid *and* its start time (a reused pid is not the VM),
the host directory holding its sockets, disk and snapshot, the layers it holds, and
the shape a snapshot can only be restored into (vCPUs, memory, accelerator).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends.base import BackendFacts


@dataclass
class MicroVMFacts(BackendFacts):
    """Mutable on purpose (as ContainerFacts): ``pid`` is None while the VM is paused to
    its snapshot (no process), ``layers_held`` follows what this edge process holds."""

    dir: Path | None = None
    layers: list[str] = field(default_factory=list)  # the image's layers, bottom first
    layers_held: list[str] = field(default_factory=list)
    pid: int | None = None  # the QEMU process
    pid_start: int | None = None  # its start time (/proc/PID/stat field 22)
    accel: str = "tcg"
    vcpus: int = 1
    memory_mb: int = 512
    disk_bytes: int = 0
    mac: str | None = None
    guest_ip: str | None = None
    gateway: str | None = None
    snapshot: bool = False  # paused to <dir>/state.snap
    # (path, host file) per spec.protected mount: the EROFS image a verifier VM shows
    # read-only at path (a held layer's blob, or the VM dir's image of inline files).
    # Never attached to the agent's own VM.
    protected: list[tuple[str, str]] = field(default_factory=list)

    @property
    def init_pid(self) -> int | None:
        return self.pid

    @property
    def accelerator(self) -> str | None:
        return self.accel

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layers": list(self.layers),
            "layers_held": list(self.layers_held),
            "accel": self.accel,
            "vcpus": self.vcpus,
            "memory_mb": self.memory_mb,
            "disk_bytes": self.disk_bytes,
            "snapshot": self.snapshot,
        }
        if self.protected:
            out["protected"] = [list(x) for x in self.protected]
        for key in ("pid", "pid_start", "mac", "guest_ip", "gateway"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.dir is not None:
            out["dir"] = str(self.dir)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MicroVMFacts:
        """A value of the wrong type reads as absent rather than failing the edge."""

        def num(key: str) -> int | None:
            v = data.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        def text(key: str) -> str | None:
            v = data.get(key)
            return v if isinstance(v, str) else None

        d = text("dir")
        return cls(
            dir=Path(d) if d else None,
            layers=[str(x) for x in data.get("layers") or []],
            layers_held=[str(x) for x in data.get("layers_held") or []],
            pid=num("pid"),
            pid_start=num("pid_start"),
            accel=text("accel") or "tcg",
            vcpus=num("vcpus") or 1,
            memory_mb=num("memory_mb") or 512,
            disk_bytes=num("disk_bytes") or 0,
            mac=text("mac"),
            guest_ip=text("guest_ip"),
            gateway=text("gateway"),
            snapshot=data.get("snapshot") is True,
            protected=[
                (str(x[0]), str(x[1]))
                for x in data.get("protected") or []
                if isinstance(x, list) and len(x) == 2
            ],
        )

    @classmethod
    def of(cls, facts: BackendFacts) -> MicroVMFacts:
        return facts if isinstance(facts, MicroVMFacts) else cls.from_json(facts.to_json())
