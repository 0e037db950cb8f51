"""Which backends' specs the platform can start: the one check of a create's kind.

The wire already carries every backend's run spec (dsec.api.spec.RunArgs), but only
the container backend exists so far. A create of another kind must fail at once, typed
(501 ``Unsupported`` naming the backend) and before any work (no quota charge, no
placement, no layers fetched), instead of failing somewhere deep in the container path.
The apiserver's create path (which, in cluster mode, has no backends of its own) and
the edge's both ask here; the answer comes from the registry's table
(dsec.backends.registry.BACKENDS), and the edge then asks for the backend itself
(``Edge.backend_for``: is that kind enabled on this host).
"""

from __future__ import annotations

from dsec.api.spec import BackendKind, DSecContainerRunArgs, RunArgs
from dsec.backends.registry import BACKENDS
from dsec.errors import Unsupported


def require_backend(spec: RunArgs) -> DSecContainerRunArgs:
    """``spec`` narrowed to a kind that has a backend, or Unsupported (501)."""
    if BackendKind(spec.backend) in BACKENDS and isinstance(spec, DSecContainerRunArgs):
        return spec
    raise Unsupported(
        f"no backend registered for kind {spec.backend!r}: this platform runs "
        f"{BackendKind.CONTAINER.value} sandboxes only so far (use DSecContainerRunArgs)",
        backend=spec.backend,
    )
