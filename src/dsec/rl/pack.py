"""pack_diff and fork (DSEC.md §6.1): a sandbox's changes become a layer; new sandboxes
start from it.

A container sandbox's changes are exactly its overlay upper: new and modified files,
whiteouts (char 0:0) for deletions and ``trusted.overlay.opaque`` on replaced
directories. mkfs.erofs copies all of that as is (devices, xattrs, owners, modes,
mtimes), and overlayfs honours whiteouts and opaque directories in a *lower* layer too,
so the upper packed into EROFS and stacked above the source's own layers reproduces the
source's file system. No tar round trip, no OCI whiteout conversion.

Consistency: the source is frozen (cgroup freezer, ~0.2 ms) while mkfs.erofs reads its
upper, so no half-written file is captured; a sandbox already paused by its job stays
frozen. What is never captured: every mount point of the container (the agent at
/.dsec, /proc, /dev, /sys, /etc/resolv.conf from the egress rules, the protected-path
decoys: their mount stubs live in the upper) and the protected paths themselves.

The new layer goes into the first free slot above the source's layers (workspace, then
toolkit), so a sandbox with the same base and that slot filled sees the source's files.
Who may pack is the apiserver's business (the ``builder`` role, dsec.control.roles).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from dsec.api.events import AuditKind
from dsec.api.layers import LayerInfo, LayerRef
from dsec.api.rl import ForkRequest, ForkResult, PackedEnv
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.api.spec import LayeredRunArgs
from dsec.backends.base import Capability
from dsec.errors import BackendError, DSecError, SandboxNotRunning, Unsupported
from dsec.images.service import LayerBuilder

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.edge.edge import Edge


def _packable(rec: SandboxRecord) -> LayeredRunArgs:
    """The spec of a sandbox that can be packed: a packed environment is an image plus
    layers (``PackedEnv.run_args``), which containers and microVMs share; other
    backends are refused."""
    if not isinstance(rec.spec, LayeredRunArgs):
        raise Unsupported(
            f"pack_diff of a {rec.spec.backend} sandbox is not supported: a packed "
            "environment is an image plus layers"
        )
    return rec.spec


def _slot(rec: SandboxRecord, spec: LayeredRunArgs) -> tuple[str, dict[str, Any]]:
    """Which slot the packed layer takes, and the other slots pinned by digest."""
    layers = list(rec.image.layers)
    if spec.toolkit is not None:
        raise Unsupported(
            "pack_diff of a sandbox that has a toolkit layer is not supported: the diff "
            "must stack above every layer and the toolkit slot is the top one"
        )
    if spec.workspace is None:
        return "workspace", {}
    # image.layers = base..., workspace: pin the workspace the source really used.
    return "toolkit", {"workspace": LayerRef(digest=layers[-1])}


async def pack_sandbox(edge: Edge, sandbox_id: str, name: str, version: str) -> PackedEnv:
    """Freeze, mkfs.erofs the changes (exclusions applied), thaw, register ``name:version``."""
    t0 = time.perf_counter()
    rec = edge.record(sandbox_id)
    backend = edge.backend_of(rec, Capability.PACK)  # refused before any work
    images = edge.images
    if not isinstance(images, LayerBuilder):
        raise Unsupported("this edge's image service cannot register layers")
    spec = _packable(rec)
    slot, pinned = _slot(rec, spec)
    out = images.temp_layer_path()
    async with edge.exclusive(sandbox_id):
        if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise SandboxNotRunning(f"sandbox {sandbox_id} is {rec.state.value}", state=rec.state)
        f0 = time.perf_counter()
        try:
            with edge.helper_vm(backend, rec, "packer"):
                packed = await backend.pack_writable(
                    rec,
                    out,
                    compression=images.layer_compression,
                    paused=rec.state is SandboxState.PAUSED,
                )
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                out.unlink()
            raise
        frozen = time.perf_counter() - f0
    files, excluded = packed.files, packed.excluded
    async with images.adding_layer(out) as (digest, size):  # the GC leaves it alone
        info = LayerInfo(
            name=name,
            version=version,
            digest=digest,
            size_bytes=size,
            kind=slot,
            source=f"pack:{sandbox_id}",
            created_at=datetime.now(UTC),
        )
        before = await images.record_layer(info)
    if before is not None and before.digest != digest:
        await images.gc()
    env = PackedEnv(
        layer=info,
        container_image=spec.image_ref,
        workspace=(f"{name}:{version}" if slot == "workspace" else str(pinned["workspace"].digest)),
        toolkit=f"{name}:{version}" if slot == "toolkit" else None,
        source_sandbox=sandbox_id,
        files=files,
        excluded=excluded,
        frozen_seconds=frozen,
        duration=time.perf_counter() - t0,
    )
    edge.audit.record(
        sandbox_id,
        AuditKind.LIFECYCLE,
        "pack_diff",
        layer=f"{name}:{version}",
        digest=digest,
        size=info.size_bytes,
        files=files,
        excluded=excluded,
        frozen=round(frozen, 6),
    )
    return env


async def fork_sandbox(edge: Edge, sandbox_id: str, req: ForkRequest) -> ForkResult:
    """pack_diff, then ``n`` sandboxes with the source's spec plus the new layer (pinned
    by digest). All or nothing: if one child fails, the others are stopped."""
    t0 = time.perf_counter()
    rec = edge.record(sandbox_id)
    edge.backend_of(rec, Capability.FORK)  # refused before any work
    if any(m.files for m in rec.spec.protected):
        raise Unsupported(
            "fork of a sandbox with inline protected files is not supported (their "
            "contents are never stored); give them as a protected layer instead"
        )
    name = req.name or f"fork-{sandbox_id.rsplit('-', 1)[-1]}"
    version = req.version or datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    env = await pack_sandbox(edge, sandbox_id, name, version)
    layer = LayerRef(digest=env.layer.digest)
    update: dict[str, Any] = {"labels": {**rec.spec.labels, "dsec.fork-of": sandbox_id}}
    if env.toolkit is not None:
        update["toolkit"] = layer
        update["workspace"] = LayerRef(str(env.workspace))
    else:
        update["workspace"] = layer
    spec = rec.spec.model_copy(update=update)
    results = await asyncio.gather(
        *(edge.create(spec, timeout=req.timeout) for _ in range(req.n)), return_exceptions=True
    )
    children = [r for r in results if isinstance(r, SandboxInfo)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(edge.stop(c.id, reason="fork failed") for c in children))
        first = errors[0]
        if isinstance(first, DSecError):
            raise first
        raise BackendError(f"fork of {sandbox_id} failed: {first}") from first
    return ForkResult(env=env, children=children, duration=time.perf_counter() - t0)
