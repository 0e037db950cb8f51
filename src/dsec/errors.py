"""Typed errors shared by the SDK, the apiserver and the edge.

Every failure a caller can see has its own class, a stable machine-readable ``code``
and an HTTP status, so the SDK can re-raise exactly what the server raised and no
failure is ever reported as a generic timeout or a 500.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DSecError(Exception):
    """Base of every error this project raises on purpose."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def to_payload(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}

    def __str__(self) -> str:
        return self.message


class InvalidArgument(DSecError):
    """The request is malformed or a value is out of range; fix the request."""

    code = "invalid_argument"
    status = 422


class Unauthenticated(DSecError):
    """No API key, or a key the platform does not know."""

    code = "unauthenticated"
    status = 401


class PermissionDenied(DSecError):
    """The principal is known but may not do this."""

    code = "permission_denied"
    status = 403


class NotFound(DSecError):
    code = "not_found"
    status = 404


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class ImageNotFound(NotFound):
    code = "image_not_found"


class FileNotFound(NotFound):
    """A path inside a sandbox does not exist."""

    code = "file_not_found"


class SessionNotFound(NotFound):
    """No shell session with that id in the sandbox (closed, or the sandbox restarted)."""

    code = "session_not_found"


class ProcessNotFound(NotFound):
    """No data-path process with that id in the sandbox."""

    code = "process_not_found"


class BatchNotFound(NotFound):
    """No batch with that id on this apiserver (batches live in the apiserver's memory)."""

    code = "batch_not_found"


class Conflict(DSecError):
    code = "conflict"
    status = 409


class SandboxNotRunning(Conflict):
    """The sandbox exists but is stopped, stopping or failed."""

    code = "sandbox_not_running"


class AlreadyExists(Conflict):
    code = "already_exists"


class IdempotencyKeyReused(Conflict):
    """The Idempotency-Key was already used for a create with a different spec: use a
    new key for a new sandbox, or resend the original spec to get its sandbox."""

    code = "idempotency_key_reused"


class TrajectoryStateLost(DSecError):
    """A trajectory step must run for real but the sandbox it is bound to is gone or
    failed: the log cannot answer it and the state it would run on no longer exists."""

    code = "trajectory_state_lost"
    status = 410


class TrajectoryStepInDoubt(Conflict):
    """The platform stopped while this step ran: whether it changed the sandbox is
    unknown, so it is neither replayed nor run again (discard it to go on)."""

    code = "trajectory_step_in_doubt"


class LimitExceeded(DSecError):
    """A requested size or limit is larger than the platform allows."""

    code = "limit_exceeded"
    status = 422


class PayloadTooLarge(LimitExceeded):
    """A request body is larger than its route accepts: refused (413) before the
    server reads past the cap, so one huge upload cannot fill the server's memory."""

    code = "payload_too_large"
    status = 413


class AdmissionRejected(DSecError):
    """The host is full; retry later or elsewhere."""

    code = "admission_rejected"
    status = 503


class QuotaExceeded(DSecError):
    """A project's quota (or one of its ancestors') would be exceeded; details say which."""

    code = "quota_exceeded"
    status = 429


class TooManyViewers(QuotaExceeded):
    """A sandbox's live view already has as many viewers as the edge relays for one."""

    code = "too_many_viewers"


class ResourceExhausted(DSecError):
    """The host ran out of something the platform needs (file descriptors, memory,
    processes): retry later; ``details.resource`` says which, and ``/v1/health`` reports
    ``degraded`` until it is back. Nothing needs a restart: the platform recovers alone."""

    code = "resource_exhausted"
    status = 503


class InsufficientStorage(DSecError):
    """The platform's data disk is full, so nothing new can be recorded durably: free
    space on the data dir's file system (or move it); creates resume by themselves."""

    code = "insufficient_storage"
    status = 507


class ClusterFull(DSecError):
    """No edge of the cluster can take the sandbox; details carry the capacity figures."""

    code = "cluster_full"
    status = 503


class EdgeUnavailable(DSecError):
    """The edge that holds the sandbox does not answer (cluster mode); retry later."""

    code = "edge_unavailable"
    status = 503


class Unsupported(DSecError):
    """The backend or this version of the platform cannot do what was asked."""

    code = "unsupported"
    status = 501


class Timeout(DSecError):
    """An operation did not finish within the time the caller allowed."""

    code = "timeout"
    status = 504


class BackendError(DSecError):
    """The sandbox runtime failed; the message carries its own words."""

    code = "backend_error"
    status = 500


class ImageBuildError(DSecError):
    """Building or importing an image failed; the message says which step."""

    code = "image_build_failed"
    status = 422


class CorruptBlob(DSecError):
    """A layer blob does not match its digest; it is never mounted."""

    code = "corrupt_blob"
    status = 502


class RegistryError(DSecError):
    """An OCI registry failed, refused our credentials or sent something malformed
    (``dsec image pull``); the message names the registry and what it said."""

    code = "registry_error"
    status = 502


class PlatformUnavailable(DSecError):
    """The SDK could not reach the platform at all."""

    code = "unavailable"
    status = 503


class DatabaseUnavailable(DSecError):
    """The control database cannot be reached or opened (down, wrong URL, no such db)."""

    code = "database_unavailable"
    status = 503


class CannotListen(DSecError):
    """A server process cannot listen on its address: the port is taken, no interface
    has the address, or the port is privileged (dsec.net.ports.listen). Said at
    start, before the process has done any work."""

    code = "cannot_listen"
    status = 503


def _all_subclasses(cls: type[DSecError]) -> list[type[DSecError]]:
    out: list[type[DSecError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_class_for(code: str) -> type[DSecError]:
    """The class the SDK re-raises for a server error ``code``."""
    for cls in _all_subclasses(DSecError):
        if cls.code == code:
            return cls
    return DSecError


def error_from_payload(status: int, payload: Any) -> DSecError:
    """Rebuild a typed error from an HTTP error body (never raises itself)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        return DSecError(f"HTTP {status}: {str(payload)[:500]}")
    cls = error_class_for(str(err.get("code", "")))
    details = err.get("details")
    exc = cls(str(err.get("message", f"HTTP {status}")))
    exc.details = (
        dict(details) if isinstance(details, dict) else {}
    )  # not as kwargs: a detail may be called "message"
    return exc
