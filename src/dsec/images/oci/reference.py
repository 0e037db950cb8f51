"""Image references as registries read them: ``[registry[:port]/]path[:tag][@sha256:..]``.

A reference whose first component looks like a host (has a ``.`` or a ``:port``, or is
``localhost``) names its registry; any other is a Docker Hub name (``busybox`` is
``docker.io/library/busybox``), the convention every OCI client follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsec.api.fields import IMAGE_REF_RE, is_registry_host, names_registry
from dsec.errors import InvalidArgument

__all__ = ["Reference", "names_registry"]

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"


@dataclass(frozen=True)
class Reference:
    """One parsed reference; ``tag`` is None when only a digest was given."""

    registry: str  # host[:port] as written (docker.io for Hub names)
    repository: str  # path inside the registry (library/busybox)
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, ref: str) -> Reference:
        m = IMAGE_REF_RE.match(ref)
        if m is None:
            raise InvalidArgument(
                f"invalid image reference {ref!r}: expected [registry[:port]/]path[:tag]"
                "[@sha256:<hex>]"
            )
        name = m["name"]
        first, sep, rest = name.partition("/")
        if sep and is_registry_host(first):
            registry, repository = first, rest
        else:
            registry, repository = DOCKER_HUB, name
        if registry == DOCKER_HUB and "/" not in repository:
            repository = f"library/{repository}"
        if any(part in ("", ".", "..") for part in repository.split("/")):
            raise InvalidArgument(f"invalid image reference {ref!r}: bad path segment")
        tag = m["tag"]
        digest = m["digest"]
        if tag is None and digest is None:
            tag = "latest"
        return cls(registry=registry, repository=repository, tag=tag, digest=digest)

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest if there is one, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out
