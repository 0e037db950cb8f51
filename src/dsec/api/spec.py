"""Run specs: one per backend, one base for what every backend shares (paper Listing 1).

A sandbox is described by one spec; the backend is a field (``backend``), so the
create route, the edge's state DB and ``SandboxInfo`` carry any backend's spec as one
discriminated union (``RunArgs``) and switching backend changes only the argument class.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)

from dsec.api.base import Strict
from dsec.api.fields import (
    LABEL_KEY_RE,
    PROJECT_RE,
    TRAJECTORY_NAME_RE,
    USER_RE,
    check_abs_path,
    check_env,
    check_network_rules,
    parse_image_ref,
)
from dsec.api.layers import ImageLoading, LayerRef
from dsec.api.protected import ProtectedMount, check_protected


class BackendKind(StrEnum):
    """Every backend a sandbox can name. ``fncall`` runs calls, not sandboxes created
    through the create route (its per-call limits are ``dsec.api.fncall.DSecFnCallRunArgs``)."""

    CONTAINER = "container"
    FNCALL = "fncall"
    MICROVM = "microvm"
    FULLVM = "fullvm"
    MEMORY = "memory"  # in-process test backend (dsec.backends.memory), never on by default


def _image_name(v: str) -> str:
    parse_image_ref(v)  # ValueError with the reason: a 422 naming the field
    return v


# An image reference, checked the same way for every backend's spec.
ImageName = Annotated[str, AfterValidator(_image_name)]


class DSecRunArgs(Strict):
    """What every backend shares. Subclasses add what is specific to one backend."""

    memory_limit_mb: int = Field(512, ge=16, le=1024 * 1024, description="hard memory limit")
    cpu_cores_limit: float = Field(1.0, gt=0, le=1024, description="CPU quota in cores")
    pids_limit: int = Field(1024, ge=16, le=65536, description="max processes and threads")
    disk_limit_mb: int | None = Field(
        None,
        ge=64,
        le=16 * 1024 * 1024,
        description="writable disk (files written, metadata included), kernel-enforced; "
        "writes past it fail with EDQUOT inside the sandbox. None: 10 GiB, or the host's "
        "whole sandbox disk if that is smaller",
    )
    ttl_running_stop: int | None = Field(
        300, ge=1, le=30 * 86400, description="idle seconds before an automatic stop; None=never"
    )
    network_rules: dict[str, bool] = Field(
        default_factory=dict, description="egress by service name; empty = loopback only"
    )
    init_user: str = Field("root", description="user name in the image, or uid[:gid]")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    workdir: str = "/"
    job_id: str | None = Field(
        None,
        pattern=TRAJECTORY_NAME_RE.pattern,
        description="RL job this sandbox serves; tags audit and events ([A-Za-z0-9._:@-])",
    )
    trajectory_id: str | None = Field(
        None,
        pattern=TRAJECTORY_NAME_RE.pattern,
        description="rollout within the job; tags audit and events",
    )
    project: str | None = Field(
        None,
        pattern=PROJECT_RE.pattern,
        description="project charged for this sandbox (a path like 'rl/math'); None: the "
        "caller's default project",
    )
    qos: Literal["latency", "best_effort"] = Field(
        "latency",
        description="CPU class (dsec.resources.qos). latency (default: interactive "
        "sandboxes, where someone waits on every command): normal scheduling and a high "
        "CPU weight. best_effort (batch work nobody waits on): every process at "
        "SCHED_IDLE with the lowest weight, so it only uses cores latency sandboxes leave "
        "idle. Backends that cannot enforce best_effort refuse it (501)",
    )
    # Grader/answer content that only verify() runs see (dsec.api.protected).
    protected: list[ProtectedMount] = Field(
        default_factory=list, description="paths only verifier runs can read"
    )

    @field_validator("init_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not USER_RE.match(v):
            raise ValueError(f"init_user must be a user name or uid[:gid], got {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, val in v.items():
            if not LABEL_KEY_RE.match(key):
                raise ValueError(f"invalid label key {key!r}: use [A-Za-z0-9._/-], <= 63 chars")
            if len(val) > 256 or "\x00" in val:
                raise ValueError(f"label {key} value is longer than 256 chars or has a NUL")
        if len(v) > 64:
            raise ValueError("at most 64 labels")
        return v

    @field_validator("network_rules")
    @classmethod
    def _rules(cls, v: dict[str, bool]) -> dict[str, bool]:
        return check_network_rules(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        return check_abs_path(v, "workdir")

    @field_validator("protected")
    @classmethod
    def _protected(cls, v: list[ProtectedMount]) -> list[ProtectedMount]:
        return check_protected(v)


class DSecContainerRunArgs(DSecRunArgs):
    """A Linux container started from a layered image (paper Listing 1)."""

    backend: Literal["container"] = "container"
    container_image: ImageName = Field(..., description="image reference name[:tag]")
    # Composable layers (stacked on the base image in this order) and how they load.
    workspace: LayerRef | None = Field(None, description="layer name:version or digest")
    toolkit: LayerRef | None = Field(None, description="layer name:version or digest")
    image_loading: ImageLoading = Field(
        "lazy", description="lazy: fetch chunks on first read; eager: whole layers first"
    )

    @property
    def image_ref(self) -> str:
        """The image the sandbox boots from (placement and audit key on it)."""
        return self.container_image


class DSecMicroVMRunArgs(DSecRunArgs):
    """A lightweight VM (Firecracker or QEMU microvm) booted from the same EROFS layers
    as a container: the base ``image`` plus optional workspace and toolkit layers."""

    backend: Literal["microvm"] = "microvm"
    image: ImageName = Field(..., description="image reference name[:tag]")
    workspace: LayerRef | None = Field(None, description="layer name:version or digest")
    toolkit: LayerRef | None = Field(None, description="layer name:version or digest")
    # The guest reads a lazily loaded layer through the host's chunk cache: its drive
    # is the layer's dsec-lazyfs file, shared with containers.
    image_loading: ImageLoading = Field(
        "lazy", description="lazy: fetch chunks on first read; eager: whole layers first"
    )

    @property
    def image_ref(self) -> str:
        """The image the sandbox boots from (placement and audit key on it)."""
        return self.image


#: The specs whose sandbox starts from the platform's layered EROFS images (base +
#: workspace + toolkit): containers and microVMs share images, layers and their cache.
LayeredRunArgs = DSecContainerRunArgs | DSecMicroVMRunArgs


class DSecFullVMRunArgs(DSecRunArgs):
    """A full VM (QEMU) booted from a VM image of its own kernel and disk."""

    backend: Literal["fullvm"] = "fullvm"
    vm_image: ImageName = Field(..., description="VM image reference name[:tag]")
    firmware: Literal["bios", "uefi"] = Field("bios", description="bios: SeaBIOS; uefi: OVMF")
    display: tuple[
        Annotated[int, Field(ge=320, le=3840)], Annotated[int, Field(ge=200, le=2160)]
    ] = Field(
        (1280, 800),
        description="(width, height): the display adapter's preferred mode, which UEFI's "
        "framebuffer and a guest's X server take (a BIOS text console stays 720x400)",
    )

    @property
    def image_ref(self) -> str:
        """The image the sandbox boots from (placement and audit key on it)."""
        return self.vm_image


class DSecMemoryRunArgs(DSecRunArgs):
    """A sandbox of the in-memory test backend (dsec.backends.memory): no image, no
    processes; it exists so the edge and the conformance suite run without root."""

    backend: Literal["memory"] = "memory"
    image: str = Field("scratch", description="a name only: nothing is fetched")

    @property
    def image_ref(self) -> str:
        """The image name placement and audit key on."""
        return self.image


def _backend_of(value: Any) -> str:
    """A spec without ``backend`` is a container spec: what every caller and every
    edge.db row sent before the other backends existed."""
    if isinstance(value, dict):
        return str(value.get("backend", BackendKind.CONTAINER.value))
    return str(getattr(value, "backend", BackendKind.CONTAINER.value))


_BY_KIND: dict[str, type[DSecRunArgs]] = {
    BackendKind.CONTAINER.value: DSecContainerRunArgs,
    BackendKind.MICROVM.value: DSecMicroVMRunArgs,
    BackendKind.FULLVM.value: DSecFullVMRunArgs,
    BackendKind.MEMORY.value: DSecMemoryRunArgs,
}


def _untagged_errors(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a known kind as its own class, so an error names the field as it always
    has (``spec.memory_limit_mb``, not ``spec.container.memory_limit_mb``); the union
    answers the rest (an unknown ``backend``, a spec object already built)."""
    cls = None if isinstance(value, DSecRunArgs) else _BY_KIND.get(_backend_of(value))
    return cls.model_validate(value) if cls is not None else handler(value)


#: Any backend's run spec, told apart by ``backend`` (container when absent). The type
#: of every field and parameter that carries "a sandbox's spec".
RunArgs = Annotated[
    Annotated[DSecContainerRunArgs, Tag(BackendKind.CONTAINER.value)]
    | Annotated[DSecMicroVMRunArgs, Tag(BackendKind.MICROVM.value)]
    | Annotated[DSecFullVMRunArgs, Tag(BackendKind.FULLVM.value)]
    | Annotated[DSecMemoryRunArgs, Tag(BackendKind.MEMORY.value)],
    Discriminator(
        _backend_of,
        custom_error_type="invalid_backend",
        custom_error_message="backend must be one of: container, microvm, fullvm, memory "
        "(FnCall runs calls, not sandboxes: see run_code)",
    ),
    WrapValidator(_untagged_errors),
]
run_args_adapter: TypeAdapter[RunArgs] = TypeAdapter(RunArgs)
