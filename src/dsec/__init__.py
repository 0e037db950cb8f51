"""DSec: elastic, isolated, stateful sandboxes for agentic RL (open implementation).

The top level is libdsec, the SDK (paper Listing 1)::

    from dsec import DSecClient, DSecContainerRunArgs

    client = DSecClient()
    await client.open()
    sandbox = await client.run_container(
        DSecContainerRunArgs(container_image="debian-python:bookworm"), timeout=120
    )
    result = await sandbox.run_shell("echo hello world")
    await sandbox.stop()

Importing ``dsec`` pulls in only httpx and pydantic; the platform lives in subpackages.
"""

from dsec.api.exec import ExecResult, ExitInfo, ProcessInfo, SessionInfo
from dsec.api.files import FileInfo, FileList
from dsec.api.images import ImageInfo
from dsec.api.layers import LayerInfo, LayerRef
from dsec.api.protected import ProtectedMount
from dsec.api.rollouts import (
    FnCallJudge,
    ModelEndpoint,
    RolloutInfo,
    RolloutResult,
    RolloutSpec,
    RolloutState,
)
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import (
    DSecContainerRunArgs,
    DSecFullVMRunArgs,
    DSecMicroVMRunArgs,
    DSecRunArgs,
)
from dsec.api.verify import GradedRefusal, VerifyRequest, VerifyResult
from dsec.errors import (
    AdmissionRejected,
    AlreadyExists,
    BackendError,
    Conflict,
    CorruptBlob,
    DSecError,
    FileNotFound,
    ImageBuildError,
    ImageNotFound,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    PlatformUnavailable,
    ProcessNotFound,
    SandboxNotFound,
    SandboxNotRunning,
    SessionNotFound,
    Timeout,
    Unauthenticated,
    Unsupported,
)
from dsec.sdk import (
    CommandResult,
    DSecClient,
    DSecSyncClient,
    OutputChunk,
    Process,
    Sandbox,
    Session,
    SyncProcess,
    SyncSandbox,
    SyncSession,
)

__version__ = "0.1.0"

__all__ = [
    "AdmissionRejected",
    "AlreadyExists",
    "BackendError",
    "CommandResult",
    "Conflict",
    "CorruptBlob",
    "DSecClient",
    "DSecContainerRunArgs",
    "DSecError",
    "DSecFullVMRunArgs",
    "DSecMicroVMRunArgs",
    "DSecRunArgs",
    "DSecSyncClient",
    "ExecResult",
    "ExitInfo",
    "FileInfo",
    "FileList",
    "FileNotFound",
    "FnCallJudge",
    "GradedRefusal",
    "ImageBuildError",
    "ImageInfo",
    "ImageNotFound",
    "InvalidArgument",
    "LayerInfo",
    "LayerRef",
    "LimitExceeded",
    "ModelEndpoint",
    "NotFound",
    "OutputChunk",
    "PermissionDenied",
    "PlatformUnavailable",
    "Process",
    "ProcessInfo",
    "ProcessNotFound",
    "ProtectedMount",
    "RolloutInfo",
    "RolloutResult",
    "RolloutSpec",
    "RolloutState",
    "Sandbox",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxNotRunning",
    "SandboxState",
    "Session",
    "SessionInfo",
    "SessionNotFound",
    "SyncProcess",
    "SyncSandbox",
    "SyncSession",
    "Timeout",
    "Unauthenticated",
    "Unsupported",
    "VerifyRequest",
    "VerifyResult",
    "__version__",
]
