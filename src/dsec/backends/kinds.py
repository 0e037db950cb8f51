"""Which backends' specs the platform can start: the one check of a create's kind.

The wire already carries every backend's run spec (dsec.api.spec.RunArgs), but only
the container backend exists so far. A create of another kind must fail at once, typed
(501 ``Unsupported`` naming the backend) and before any work (no quota charge, no
placement, no layers fetched), instead of failing somewhere deep in the container path.
The apiserver's create path and the edge's both ask here; a backend registry replaces
this function with a look-up ("no backend registered for kind X").
"""

from __future__ import annotations

from dsec.api.spec import BackendKind, DSecContainerRunArgs, RunArgs
from dsec.errors import Unsupported


def require_backend(spec: RunArgs) -> DSecContainerRunArgs:
    """``spec`` narrowed to a kind that has a backend, or Unsupported (501)."""
    if isinstance(spec, DSecContainerRunArgs):
        return spec
    raise Unsupported(
        f"no backend registered for kind {spec.backend!r}: this platform runs "
        f"{BackendKind.CONTAINER.value} sandboxes only so far (use DSecContainerRunArgs)",
        backend=spec.backend,
    )
