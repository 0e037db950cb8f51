"""What the audit log records and what detectors raise, on the wire (paper §6.4, §6.5).

Two streams in one store: *audit records* say what a sandbox did (every command, file
operation and network decision), *events* say that it misbehaved. Both carry the
sandbox's job and trajectory ids so a trainer can discard or penalise a rollout. How
severe a kind is by default is the detectors' policy (dsec.security.audit).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import Field

from dsec.api.base import Reply


class AuditKind(StrEnum):
    """What an audit record is about."""

    LIFECYCLE = "lifecycle"  # create, stop, network update
    COMMAND = "command"  # exec, process start, session command
    FILE = "file"  # read, write, list, remove, move, chmod, upload, download
    NETWORK = "network"  # a connection or DNS answer allowed or denied
    EVENT = "event"  # a misbehaviour event (also listed by ``events()``)


class EventKind(StrEnum):
    """Misbehaviour a detector can raise. New kinds may appear; old SDKs keep working."""

    PROTECTED_PATH = "protected_path"  # touched a grader/answer path
    DENIED_CONNECTION = "denied_connection"  # egress outside its network rules
    HOST_ACCESS = "host_access"  # tried the host, the edge API or the metadata range
    SECCOMP_VIOLATION = "seccomp_violation"  # a refused system call (reboot, kexec, ...)
    BINARY_TAMPERING = "binary_tampering"  # changed system binaries or libraries
    RESOURCE_LIMIT = "resource_limit"  # hit its memory, pids, disk, or output limit
    ESCAPE_ATTEMPT = "escape_attempt"  # tried a path out of the sandbox (agent socket, ...)
    GRADED_LINK_ESCAPE = "graded_link_escape"  # a graded path's link leaves the graded tree
    SCAN_INCOMPLETE = "scan_incomplete"  # a detector could not finish its scan (fail closed)
    DETECTOR_ERROR = "detector_error"  # a detector raised; it goes on, the gap is on record
    DNS_REBINDING = "dns_rebinding"  # an allowed name answered with a private/metadata address
    DNS_TUNNEL_SUSPECTED = "dns_tunnel_suspected"  # query names or rates that carry data out
    SIGNAL_TO_INIT = "signal_to_init"  # a process inside signalled pid 1 (ignored)


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class AuditRecord(Reply):
    """One line of the audit log."""

    seq: int = Field(description="monotonic per edge; use as a cursor (since_seq)")
    time: datetime
    sandbox_id: str
    job_id: str | None = None
    trajectory_id: str | None = None
    kind: AuditKind
    action: str = Field(description="e.g. exec, read_file, connect, seccomp")
    detail: dict[str, Any] = Field(default_factory=dict)


class SecurityEvent(Reply):
    """A misbehaviour event: an audit record of kind ``event`` seen from the trainer."""

    seq: int
    time: datetime
    sandbox_id: str
    job_id: str | None = None
    trajectory_id: str | None = None
    kind: EventKind
    severity: Severity
    detail: dict[str, Any] = Field(default_factory=dict)
