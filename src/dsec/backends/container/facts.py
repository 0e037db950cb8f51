"""What the container backend keeps about one container, typed.

Persisted in edge.db as the same flat JSON object the backend wrote before these
facts had a type (keys ``dir``, ``layers``, ``layers_held``, ``disk_qgroup``, ``pid``,
``protected``, ``seccomp``), so records of every release load, and a record written
now still reads as before. Unknown keys are ignored; keys of the edge that older
releases kept in the same object (``net``, ``sessions``) are the edge's to read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.backends.base import BackendFacts
from dsec.security import protected as protected_paths


@dataclass
class ContainerFacts(BackendFacts):
    """Mutable on purpose: ``layers_held`` follows what this process holds (filled by
    create and adopt, emptied by teardown, which makes a second teardown harmless)."""

    dir: Path | None = None  # the container's host directory (upper, work, socket)
    layers: list[str] = field(default_factory=list)  # the image's layers, bottom first
    layers_held: list[str] = field(default_factory=list)  # held in LayerMounts by us
    disk_qgroup: int | None = None  # its quota group on the sandbox disk
    pid: int | None = None  # its init (the agent, pid 1 inside)
    protected: list[protected_paths.Prepared] = field(default_factory=list)
    seccomp: str | None = None  # "notify" or "errno" while a filter is attached

    @property
    def init_pid(self) -> int | None:
        return self.pid

    @property
    def upper(self) -> Path | None:
        """The overlay's upper dir: where the container's file changes land."""
        return self.dir / "upper" if self.dir is not None else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.layers), "layers_held": list(self.layers_held)}
        if self.dir is not None:
            out["dir"] = str(self.dir)
        if self.disk_qgroup is not None:
            out["disk_qgroup"] = self.disk_qgroup
        if self.pid is not None:
            out["pid"] = self.pid
        if self.protected:
            out["protected"] = [p.as_json() for p in self.protected]
        if self.seccomp is not None:
            out["seccomp"] = self.seccomp
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ContainerFacts:
        """Reads what ``to_json`` (or a release before it) wrote; a value of the wrong
        type reads as absent rather than failing the edge's start."""
        d = data.get("dir")
        qgroup, pid, seccomp = data.get("disk_qgroup"), data.get("pid"), data.get("seccomp")
        return cls(
            dir=Path(d) if isinstance(d, str) else None,
            layers=[str(x) for x in data.get("layers") or []],
            layers_held=[str(x) for x in data.get("layers_held") or []],
            disk_qgroup=qgroup if isinstance(qgroup, int) else None,
            pid=pid if isinstance(pid, int) else None,
            protected=[protected_paths.Prepared.from_json(p) for p in data.get("protected") or []],
            seccomp=seccomp if isinstance(seccomp, str) else None,
        )

    @classmethod
    def of(cls, facts: BackendFacts) -> ContainerFacts:
        """``facts`` as container facts (parsed if they were stored ones)."""
        return facts if isinstance(facts, ContainerFacts) else cls.from_json(facts.to_json())
