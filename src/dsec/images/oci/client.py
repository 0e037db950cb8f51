"""The OCI distribution protocol, the part a puller needs: manifests and blobs.

httpx directly, not a client library: the one maintained Python OCI client (``oras``)
is synchronous on ``requests``, built for artifacts, and would add a second HTTP stack
next to httpx for four GET requests. What this module does:

* endpoints: ``https://host`` (``registry-1.docker.io`` for Docker Hub), plain HTTP only
  for hosts named insecure; configured mirrors of a registry are tried first, falling
  through to the next on a connection error, 404 or 5xx;
* auth: anonymous first, then whatever the 401 challenge asks (dsec.images.oci.auth, the
  same requests-with-authentication the registry layer store uses);
* manifests: OCI and Docker v2 manifests, OCI indexes and Docker manifest lists (the
  entry for this host's os/architecture is picked); every manifest fetched by digest is
  checked against it;
* blobs: streamed, size- and SHA-256-checked (dsec.images.oci.blobcheck, as the registry
  layer store does); a mismatch is CorruptBlob.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dsec.errors import CorruptBlob, ImageNotFound, InvalidArgument, RegistryError, Unsupported
from dsec.images.oci.auth import Authorizer, Credentials, load_docker_config
from dsec.images.oci.blobcheck import BlobCheck
from dsec.images.oci.reference import DOCKER_HUB, DOCKER_HUB_API, Reference
from dsec.images.tls import describe_failure, tls_context

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEXES = {OCI_INDEX, DOCKER_LIST}
MANIFESTS = {OCI_MANIFEST, DOCKER_MANIFEST}
ACCEPT = ", ".join([OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST])
MAX_MANIFEST = 4 << 20
MAX_CONFIG = 16 << 20


def host_platform() -> tuple[str, str]:
    """(os, architecture) in OCI's words."""
    machine = platform.machine()
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)
    return "linux", arch


@dataclass
class RegistrySettings:
    """How this host reaches registries (PlatformConfig: registry_* settings)."""

    auth_file: Path | None = None  # Docker config.json
    insecure: frozenset[str] = frozenset()  # host:port served over plain HTTP
    mirrors: dict[str, list[str]] = field(default_factory=dict)  # registry -> base URLs
    timeout: float = 60.0
    ca_file: Path | None = None  # trust only these CAs over HTTPS (dsec.images.tls)

    def credentials(self) -> dict[str, Credentials]:
        return load_docker_config(self.auth_file) if self.auth_file is not None else {}


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int

    @classmethod
    def of(cls, raw: object, what: str) -> Descriptor:
        if not isinstance(raw, dict):
            raise RegistryError(f"{what}: not a descriptor")
        digest, size = raw.get("digest"), raw.get("size")
        if not isinstance(digest, str) or not _valid_digest(digest):
            raise RegistryError(f"{what}: unsupported or invalid digest {digest!r}")
        if not isinstance(size, int) or size < 0:
            raise RegistryError(f"{what}: invalid size {size!r}")
        return cls(str(raw.get("mediaType", "")), digest, size)


@dataclass(frozen=True)
class ImageManifest:
    """One platform's image: its manifest digest, config and layers (bottom first)."""

    digest: str
    config: Descriptor
    layers: list[Descriptor]


def _valid_digest(digest: str) -> bool:
    algo, _, hexpart = digest.partition(":")
    return algo == "sha256" and len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)


def _json_object(raw: bytes | bytearray, what: str) -> dict[str, Any]:
    """A registry document (manifest, index, config): a JSON object or RegistryError."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise RegistryError(f"{what} is not JSON") from None
    if not isinstance(doc, dict):
        raise RegistryError(f"{what} is not a JSON object")
    return doc


class RegistryClient:
    """One pull's connection to registries (close it, or use ``async with``)."""

    def __init__(
        self, settings: RegistrySettings, credentials: dict[str, Credentials] | None = None
    ) -> None:
        self.settings = settings
        creds = settings.credentials()
        creds.update(credentials or {})
        self.auth = Authorizer(creds)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.timeout, connect=10.0),
            follow_redirects=True,
            verify=tls_context(settings.ca_file),
        )
        self.bytes_fetched = 0

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    # -- endpoints and requests --

    def endpoints(self, registry: str) -> list[str]:
        upstream = DOCKER_HUB_API if registry == DOCKER_HUB else registry
        scheme = "http" if registry in self.settings.insecure else "https"
        mirrors = [m.rstrip("/") for m in self.settings.mirrors.get(registry, [])]
        return [*mirrors, f"{scheme}://{upstream}"]

    async def _send(self, ref: Reference, path: str, accept: str | None = None) -> httpx.Response:
        """GET ``/v2/<repo>/<path>`` (streamed), mirrors first, answering a 401 once."""
        scope = f"repository:{ref.repository}:pull"
        url_path = f"/v2/{ref.repository}/{path}"
        last: str = "no endpoint"
        endpoints = self.endpoints(ref.registry)
        for n, base in enumerate(endpoints):
            final = n == len(endpoints) - 1
            try:
                resp = await self._get(ref.registry, scope, base + url_path, accept)
            except httpx.HTTPError as exc:
                last = f"{base}: {exc.__class__.__name__}: {describe_failure(exc)}"
                if final:
                    raise RegistryError(
                        f"registry {ref.registry} unreachable ({last})", registry=ref.registry
                    ) from None
                continue
            if final or (resp.status_code != 404 and resp.status_code < 500):
                return resp
            last = f"{base}: HTTP {resp.status_code}"
            await resp.aclose()
        raise RegistryError(f"no endpoint of {ref.registry} answered ({last})")  # pragma: no cover

    async def _get(self, registry: str, scope: str, url: str, accept: str | None) -> httpx.Response:
        headers = {"Accept": accept} if accept else {}
        return await self.auth.send(
            self.http, "GET", url, registry=registry, scope=scope, headers=headers, stream=True
        )

    async def _check(self, resp: httpx.Response, ref: Reference, what: str) -> None:
        if resp.status_code == 200:
            return
        body = (await resp.aread())[:300].decode("utf-8", "replace")
        await resp.aclose()
        if resp.status_code == 404:
            raise ImageNotFound(
                f"{what} not found in registry {ref.registry} ({ref}): {body}", ref=str(ref)
            )
        if resp.status_code in (401, 403):
            raise RegistryError(
                f"registry {ref.registry} denied access to {ref.repository} "
                f"(HTTP {resp.status_code}): check the credentials. {body}",
                registry=ref.registry,
            )
        raise RegistryError(
            f"registry {ref.registry} answered HTTP {resp.status_code} for {what}: {body}",
            registry=ref.registry,
        )

    async def _read_limited(self, resp: httpx.Response, limit: int, what: str) -> bytes:
        data = bytearray()
        try:
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise RegistryError(f"{what} is larger than {limit} bytes")
        except httpx.HTTPError as exc:
            raise RegistryError(f"reading {what} failed: {exc}") from None
        finally:
            await resp.aclose()
        self.bytes_fetched += len(data)
        return bytes(data)

    # -- manifests --

    async def _manifest(self, ref: Reference, reference: str) -> tuple[str, bytes, str]:
        """(media type, raw bytes, digest) of one manifest or index."""
        resp = await self._send(ref, f"manifests/{reference}", ACCEPT)
        await self._check(resp, ref, f"manifest {reference}")
        raw = await self._read_limited(resp, MAX_MANIFEST, f"manifest {reference}")
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise CorruptBlob(
                f"manifest {reference} of {ref} does not match its digest (got {digest})",
                digest=reference,
                actual=digest,
            )
        media = resp.headers.get("content-type", "").split(";", 1)[0].strip()
        return media, raw, digest

    async def image(self, ref: Reference) -> ImageManifest:
        """The image manifest for this host, following an index to its platform."""
        reference = ref.reference
        for _ in range(4):
            media, raw, digest = await self._manifest(ref, reference)
            doc = _json_object(raw, f"manifest {reference} of {ref}")
            media = str(doc.get("mediaType") or media)
            if doc.get("schemaVersion") == 1:
                raise Unsupported(
                    f"{ref} is a Docker schema 1 manifest (deprecated); re-push it as OCI or v2"
                )
            if media in INDEXES or ("manifests" in doc and "layers" not in doc):
                reference = self._pick(doc, ref).digest
                continue
            if "layers" not in doc:
                raise RegistryError(f"{ref}: unsupported manifest type {media!r}")
            layers = doc.get("layers")
            if not isinstance(layers, list):
                raise RegistryError(f"{ref}: the manifest's layers are not a list")
            return ImageManifest(
                digest=digest,
                config=Descriptor.of(doc.get("config"), f"{ref} config"),
                layers=[Descriptor.of(d, f"{ref} layer {i + 1}") for i, d in enumerate(layers)],
            )
        raise RegistryError(f"{ref}: image indexes nest too deeply")

    @staticmethod
    def _pick(index: dict[str, Any], ref: Reference) -> Descriptor:
        entries = index.get("manifests")
        if not isinstance(entries, list) or not entries:
            raise RegistryError(f"{ref}: the image index lists no manifests")
        want_os, want_arch = host_platform()
        seen: list[str] = []
        for entry in entries:
            plat = entry.get("platform") if isinstance(entry, dict) else None
            if not isinstance(plat, dict):
                continue
            os_, arch = plat.get("os"), plat.get("architecture")
            seen.append(f"{os_}/{arch}")
            if os_ == want_os and arch == want_arch:
                return Descriptor.of(entry, f"{ref} index entry")
        raise ImageNotFound(
            f"{ref} has no image for {want_os}/{want_arch}; it offers "
            f"{', '.join(seen) or 'no platform'}",
            ref=str(ref),
            platforms=seen,
        )

    # -- blobs --

    async def config(self, ref: Reference, desc: Descriptor) -> dict[str, Any]:
        """The image config (verified against its digest)."""
        if desc.size > MAX_CONFIG:
            raise RegistryError(f"{ref}: the image config is larger than {MAX_CONFIG} bytes")
        data = bytearray()
        async for chunk in self.blob(ref, desc):
            data += chunk
        return _json_object(data, f"{ref}: the image config")

    async def blob(self, ref: Reference, desc: Descriptor) -> AsyncIterator[bytes]:
        """The blob's bytes as they arrive; raises CorruptBlob at the end if they do not
        hash to the descriptor (so nothing built from them may be kept before then)."""
        if not _valid_digest(desc.digest):
            raise InvalidArgument(f"invalid blob digest {desc.digest!r}")
        resp = await self._send(ref, f"blobs/{desc.digest}")
        await self._check(resp, ref, f"blob {desc.digest}")
        check = BlobCheck(desc.digest, desc.size, f"blob {desc.digest} of {ref}")
        try:
            async for chunk in resp.aiter_bytes(1 << 20):
                self.bytes_fetched += len(chunk)
                check.update(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            raise RegistryError(f"downloading blob {desc.digest} of {ref} failed: {exc}") from None
        finally:
            await resp.aclose()
        if not check.matches():
            raise CorruptBlob(
                f"blob {desc.digest} of {ref} does not match its digest (got {check.actual}, "
                f"{check.size} of {desc.size} bytes)",
                digest=desc.digest,
                actual=check.actual,
            )
