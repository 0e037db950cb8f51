"""Which backends' specs the platform can start: the one check of a create's kind.

The wire carries every backend's run spec (dsec.api.spec.RunArgs), but not every kind
has a backend. A create of a kind without one must fail at once, typed (501
``Unsupported`` naming the backend) and before any work (no quota charge, no
placement, no layers fetched), instead of failing somewhere deep in a backend. The
apiserver's create path (which, in cluster mode, has no backends of its own) and the
edge's both ask here; the answer is a lookup in the registry's table
(dsec.backends.registry.BACKENDS), and the edge then asks for the backend itself
(``Edge.backend_for``: is that kind enabled on this host).
"""

from __future__ import annotations

from dsec.api.spec import BackendKind, RunArgs
from dsec.backends.registry import BACKENDS
from dsec.errors import Unsupported


def require_backend(spec: RunArgs) -> RunArgs:
    """``spec`` itself if its kind has a registered backend, or Unsupported (501)."""
    if BackendKind(spec.backend) in BACKENDS:
        return spec
    known = ", ".join(k.value for k in BACKENDS)
    raise Unsupported(
        f"no backend registered for kind {spec.backend!r}: this platform runs "
        f"{known} sandboxes only so far",
        backend=spec.backend,
    )
