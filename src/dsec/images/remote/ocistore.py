"""A layer store in an OCI registry (``oci://host:port/repo``, or ``oci+http://`` for a
plain-HTTP registry, which must be named so): a team can keep our layers in the
registry it already runs instead of running ``dsec store serve``.

Mapping onto the OCI distribution protocol, all in one repository so that the lazy
loader reads every blob under one URL prefix:

- an EROFS layer is a blob (``/v2/<repo>/blobs/sha256:<hex>``); pushed monolithically
  (``POST /blobs/uploads/`` then ``PUT <location>?digest=``), fetched whole with a GET,
  or chunk by chunk by dsec-lazyfs with ``Range:`` requests (the registry serves them);
- its chunk index is a blob too, reachable from the tag ``idx-<layer hex>``: an OCI image
  manifest whose config is the index and whose one layer is the EROFS blob (which also
  keeps the blob referenced, so the registry's garbage collector leaves it alone);
- a reference ``name:version`` is the tag ``ref-<sha256(name:version)[:60]>`` (tags are
  at most 128 characters, a reference can be 257): a manifest whose config is the
  LayerRecord JSON and whose layer is the EROFS blob. ``refs()`` lists tags.

Authentication: none, HTTP basic, or a bearer token from the registry's token service
(the ``WWW-Authenticate`` challenge), with ``user:password`` given as the store token;
the puller's (dsec.images.oci.auth.Authorizer) answers the challenges, so both speak to
registries alike. httpx (already our HTTP client) speaks all of it; no registry SDK is
needed for these dozen requests. Everything fetched is verified like the other backends
do.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO, Any

import httpx

from dsec.errors import (
    CorruptBlob,
    DSecError,
    ImageNotFound,
    InvalidArgument,
    PlatformUnavailable,
    RegistryError,
    Unsupported,
)
from dsec.images.chunkindex import ChunkIndex
from dsec.images.oci.auth import Authorizer, Body, Credentials
from dsec.images.oci.blobcheck import BlobCheck
from dsec.images.remote.records import LayerRecord, check_name, check_version
from dsec.images.store import digest_hex, normalize_digest
from dsec.images.tls import describe_failure, tls_context

PIECE = 4 << 20
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EROFS_LAYER = "application/vnd.dsec.erofs.layer.v1"
INDEX_CONFIG = "application/vnd.dsec.chunkindex.v1"
REF_CONFIG = "application/vnd.dsec.layer.ref.v1+json"
REF_ANNOTATION = "dev.dsec.layer.ref"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
STORE_HINT = "give user:password as the layer store token"


def parse_oci_location(location: str) -> tuple[str, str]:
    """``oci://host:port/repo`` -> (``https://host:port``, ``repo``); ``oci+http://``
    -> plain HTTP. InvalidArgument for anything else."""
    for prefix, scheme in (("oci+http://", "http"), ("oci://", "https")):
        if location.startswith(prefix):
            rest = location[len(prefix) :].strip("/")
            host, sep, repo = rest.partition("/")
            if not host or not sep or not _REPO_RE.match(repo):
                raise InvalidArgument(
                    f"layer store {location!r}: use oci://host[:port]/repository (lowercase "
                    "repository path), or oci+http:// for a plain-HTTP registry"
                )
            return f"{scheme}://{host}", repo
    raise InvalidArgument(f"layer store {location!r} is not an oci:// location")


def ref_tag(name: str, version: str) -> str:
    """The tag of reference ``name:version`` (a hash: tags are too short for both)."""
    key = f"{check_name(name)}:{check_version(version)}".encode()
    return "ref-" + hashlib.sha256(key).hexdigest()[:60]


def index_tag(digest: str) -> str:
    return "idx-" + digest_hex(digest)


class OCIStore:
    """The layer store interface (dsec.images.remote.client.RemoteStore) on a registry."""

    def __init__(
        self,
        location: str,
        credentials: str | None,
        *,
        timeout: float = 30.0,
        ca_file: Path | None = None,
    ) -> None:
        self.base, self.repo = parse_oci_location(location)
        self.url = f"{self.base}/v2/{self.repo}"
        # What dsec-lazyfs is given: the repository's URL; it asks for <url>/blobs/<digest>.
        self.location = self.url
        self.token: str | None = None
        self.host = self.base.split("://", 1)[1]
        # One scope for everything: a token for pull and push on our repository.
        self.scope = f"repository:{self.repo}:pull,push"
        creds = {self.host: Credentials.parse(credentials)} if credentials else {}
        self.auth = Authorizer(creds, hint=STORE_HINT)
        self._credentials = credentials
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=5.0),
            follow_redirects=True,
            verify=tls_context(ca_file),
        )

    # -- what the lazy loader needs --

    @property
    def lazy_blob_prefix(self) -> str:
        return "/blobs/"

    async def lazy_authorization(self) -> str | None:
        """The Authorization header dsec-lazyfs sends (None: anonymous). A bearer token
        is fetched fresh on every call: it expires (lazy_authorization_expires), and
        the platform calls again in time to hand the loader a new one."""
        if self.auth.expires(self.host, self.scope) is not None:
            self.auth.forget(self.host, self.scope)  # make the probe earn a new token
        try:
            await self._request("GET", f"{self.base}/v2/")
        except PlatformUnavailable:
            if self._credentials:  # the registry is down now: basic auth is the best guess
                return Credentials.parse(self._credentials).basic()
        return self.auth.header(self.host, self.scope)

    def lazy_authorization_expires(self) -> float | None:
        """When (time.monotonic()) the bearer token last earned stops working; None
        for basic auth or none, which do not expire."""
        return self.auth.expires(self.host, self.scope)

    # -- HTTP with the registry's authentication --

    async def _request(
        self,
        method: str,
        url: str,
        *,
        body: Body = None,
        headers: dict[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """One request through the shared registry authentication (a 401 answered once,
        a streamed ``body`` sent again from its factory); the store's errors are
        PlatformUnavailable, as for the other remote stores."""
        try:
            return await self.auth.send(
                self._http,
                method,
                url,
                registry=self.host,
                scope=self.scope,
                headers=headers,
                content=body,
                stream=stream,
                timeout=timeout,
            )
        except httpx.HTTPError as exc:
            raise PlatformUnavailable(
                f"registry {self.base} unreachable: {describe_failure(exc)}"
            ) from exc
        except RegistryError as exc:
            raise PlatformUnavailable(exc.message) from None

    def _fail(self, resp: httpx.Response, what: str) -> DSecError:
        if resp.status_code in (401, 403):
            return PlatformUnavailable(
                f"registry {self.base}: {what}: the store credentials are refused "
                f"(HTTP {resp.status_code})"
            )
        try:
            body = resp.text[:300]
        except httpx.ResponseNotRead:
            body = ""
        return PlatformUnavailable(
            f"registry {self.base}: {what}: HTTP {resp.status_code} {body}".rstrip()
        )

    # -- blobs --

    async def blob_size(self, digest: str) -> int | None:
        digest = normalize_digest(digest)
        resp = await self._request("HEAD", f"{self.url}/blobs/{digest}")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._fail(resp, f"HEAD blob {digest}")
        return int(resp.headers["content-length"])

    async def _get_bytes(self, digest: str) -> bytes | None:
        resp = await self._request("GET", f"{self.url}/blobs/{digest}")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._fail(resp, f"GET blob {digest}")
        data = resp.content
        check = BlobCheck(digest)
        check.update(data)
        if not check.matches():
            raise CorruptBlob(f"registry blob {digest} does not match its digest", digest=digest)
        return data

    async def fetch_blob(self, digest: str, dest: Path) -> int:
        digest = normalize_digest(digest)
        check = BlobCheck(digest, what=f"layer {digest} from the registry")
        resp = await self._request(
            "GET",
            f"{self.url}/blobs/{digest}",
            stream=True,
            timeout=httpx.Timeout(None, connect=5.0),
        )
        try:
            if resp.status_code == 404:
                raise ImageNotFound(f"layer {digest} is not in the registry {self.url}")
            if resp.status_code != 200:
                await resp.aread()
                raise self._fail(resp, f"GET blob {digest}")
            length = resp.headers.get("content-length")
            check.expected = int(length) if length is not None else None
            out = await asyncio.to_thread(open, dest, "wb")
            try:
                async for data in resp.aiter_bytes(PIECE):
                    await asyncio.to_thread(_check_write, check, out, data)
            finally:
                await asyncio.to_thread(out.close)
        except httpx.HTTPError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)
            raise PlatformUnavailable(
                f"registry {self.base}: fetching {digest} failed: {describe_failure(exc)}"
            ) from exc
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)
            raise
        finally:
            await resp.aclose()
        if not check.matches():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)
            raise CorruptBlob(
                f"layer {digest} from the registry is corrupt or truncated ({check.size} "
                f"bytes hashing to {check.actual}); it will not be mounted",
                digest=digest,
                actual=check.actual,
                size=check.size,
            )
        return check.size

    async def push_blob(self, digest: str, src: Path) -> bool:
        digest = normalize_digest(digest)
        if await self.blob_size(digest) is not None:
            return False

        async def body() -> AsyncIterator[bytes]:
            fh = await asyncio.to_thread(open, src, "rb")
            try:
                while data := await asyncio.to_thread(fh.read, PIECE):
                    yield data
            finally:
                fh.close()

        await self._put_blob(digest, body, os.stat(src).st_size)
        return True

    async def _put_blob(
        self, digest: str, content: bytes | Callable[[], AsyncIterator[bytes]], size: int
    ) -> None:
        resp = await self._request("POST", f"{self.url}/blobs/uploads/")
        if resp.status_code != 202 or "location" not in resp.headers:
            raise self._fail(resp, "start a blob upload")
        upload = httpx.URL(self.url).join(resp.headers["location"])
        upload = upload.copy_merge_params({"digest": digest})
        resp = await self._request(
            "PUT",
            str(upload),
            body=content,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            timeout=httpx.Timeout(None, connect=5.0),
        )
        if resp.status_code == 400:
            raise InvalidArgument(f"registry refused blob {digest}: {resp.text[:300]}")
        if resp.status_code != 201:
            raise self._fail(resp, f"upload blob {digest}")

    async def _put_small(self, data: bytes) -> str:
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        if await self.blob_size(digest) is None:
            await self._put_blob(digest, data, len(data))
        return digest

    # -- manifests (indexes and references) --

    async def _put_manifest(
        self, tag: str, config: bytes, config_type: str, layer: str, annotations: dict[str, str]
    ) -> None:
        size = await self.blob_size(layer)
        if size is None:
            raise ImageNotFound(f"push blob {layer} before the reference to it")
        cfg_digest = await self._put_small(config)
        doc = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": config_type, "digest": cfg_digest, "size": len(config)},
            "layers": [{"mediaType": EROFS_LAYER, "digest": layer, "size": size}],
            "annotations": annotations,
        }
        resp = await self._request(
            "PUT",
            f"{self.url}/manifests/{tag}",
            body=json.dumps(doc, sort_keys=True).encode(),
            headers={"Content-Type": MANIFEST},
        )
        if resp.status_code != 201:
            raise self._fail(resp, f"put manifest {tag}")

    async def _get_manifest(self, tag: str) -> tuple[dict[str, Any], str] | None:
        resp = await self._request(
            "GET", f"{self.url}/manifests/{tag}", headers={"Accept": MANIFEST}
        )
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._fail(resp, f"get manifest {tag}")
        try:
            doc = resp.json()
            config = doc["config"]["digest"]
        except (ValueError, KeyError, TypeError):
            return None  # not one of ours
        return doc, str(config)

    async def get_index(self, digest: str) -> bytes | None:
        found = await self._get_manifest(index_tag(digest))
        return None if found is None else await self._get_bytes(found[1])

    async def push_index(self, digest: str, data: bytes) -> None:
        digest = normalize_digest(digest)
        try:
            ChunkIndex.from_bytes(data, blob_digest=digest)
        except CorruptBlob as exc:
            raise InvalidArgument(f"not a valid chunk index: {exc.message}") from None
        await self._put_manifest(index_tag(digest), data, INDEX_CONFIG, digest, {})

    async def get_ref(self, name: str, version: str) -> LayerRecord | None:
        found = await self._get_manifest(ref_tag(name, version))
        if found is None:
            return None
        data = await self._get_bytes(found[1])
        if data is None:
            return None
        rec = LayerRecord.model_validate_json(data)
        return rec if (rec.name, rec.version) == (name, version) else None

    async def put_ref(self, record: LayerRecord) -> None:
        await self._put_manifest(
            ref_tag(record.name, record.version),
            record.model_dump_json().encode(),
            REF_CONFIG,
            normalize_digest(record.digest),
            {REF_ANNOTATION: f"{record.name}:{record.version}"},
        )

    async def delete_ref(self, name: str, version: str) -> bool:
        tag = ref_tag(name, version)
        resp = await self._request(
            "HEAD", f"{self.url}/manifests/{tag}", headers={"Accept": MANIFEST}
        )
        if resp.status_code == 404:
            return False
        digest = resp.headers.get("docker-content-digest")
        if resp.status_code != 200 or not digest:
            raise self._fail(resp, f"find manifest {tag}")
        resp = await self._request("DELETE", f"{self.url}/manifests/{digest}")
        if resp.status_code == 405:
            raise Unsupported(
                f"registry {self.base} does not allow deletes (distribution: "
                "storage.delete.enabled)"
            )
        if resp.status_code not in (200, 202, 404):
            raise self._fail(resp, f"delete manifest {tag}")
        return resp.status_code != 404

    async def _tags(self) -> list[str]:
        tags: list[str] = []
        url: str | None = f"{self.url}/tags/list?n=1000"
        while url:
            resp = await self._request("GET", url)
            if resp.status_code == 404:
                return tags
            if resp.status_code != 200:
                raise self._fail(resp, "list tags")
            tags += resp.json().get("tags") or []
            link = resp.headers.get("link", "")
            m = re.match(r"<([^>]+)>", link)
            url = str(httpx.URL(self.base).join(m.group(1))) if m else None
        return tags

    async def refs(self) -> list[LayerRecord]:
        out: list[LayerRecord] = []
        for tag in sorted(await self._tags()):
            if not tag.startswith("ref-"):
                continue
            found = await self._get_manifest(tag)
            if found is None:
                continue
            ref = (found[0].get("annotations") or {}).get(REF_ANNOTATION, "")
            name, _, version = str(ref).partition(":")
            with contextlib.suppress(DSecError, ValueError):
                rec = await self.get_ref(name, version)
                if rec is not None:
                    out.append(rec)
        return out

    async def close(self) -> None:
        await self._http.aclose()


def _check_write(check: BlobCheck, fh: IO[bytes], data: bytes) -> None:
    check.update(data)
    fh.write(data)
