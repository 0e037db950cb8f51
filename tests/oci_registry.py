"""A real OCI registry for tests: Debian's ``docker-registry`` (the CNCF distribution
registry) on a loopback port, filled with ``skopeo copy`` from OCI layouts built here or
with layers published as another host's ``dsec layer push`` would. The one registry
fixture of the image-pull, registry-store, lazy-TLS and Dockerfile tests and benches.

``registry(...)`` starts one (plain HTTP, or HTTPS with a server certificate from a
throwaway CA made by ``openssl``; open, htpasswd basic auth through the registry's own
setup, or bearer tokens from our TokenServer, whose lifetime can be a few seconds so
expiry and renewal happen inside a test) and removes it and its storage afterwards;
``Layout`` writes an OCI image layout directory from layer trees described as
{path: bytes | None (whiteout) | "opaque" | "dir"} dicts.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import os
import shutil
import ssl
import struct
import subprocess
import tarfile
import tempfile
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import zstandard

from dsec.api.layers import LayerInfo
from dsec.images.builders import HOST_BUSYBOX, busybox_tree
from dsec.images.remote.dirstore import DirStore
from dsec.images.remote.ocistore import OCIStore
from dsec.images.remote.publish import publish_tree
from tests.ports import free_port

# bcrypt for the htpasswd file: the stdlib's crypt (3.11, 3.12; gone in 3.13, where the
# htpasswd registries skip) rather than a new dependency for one line of a test fixture.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import crypt
    except ImportError:  # pragma: no cover - Python >= 3.13
        crypt = None  # type: ignore[assignment]

REGISTRY = "/usr/bin/docker-registry"
# distribution accepts a token up to this long after its ``exp`` (clock skew): a
# token meant to live N seconds is issued with exp = now + N - REGISTRY_LEEWAY.
REGISTRY_LEEWAY = 60

OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
FIXED_MTIME = 1_700_000_000


def registry_available(*, push: bool = True, htpasswd: bool = True) -> bool:
    """docker-registry and openssl (certificates, token signing), plus skopeo when
    images are ``push``ed and a bcrypt for ``htpasswd`` (install.sh brings the tools)."""
    tools = [REGISTRY, "openssl"] + (["skopeo"] if push else [])
    return all(shutil.which(x) for x in tools) and (crypt is not None or not htpasswd)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(root: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = root / f"{name}.pem", root / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "1", "-subj", f"/CN={name}", "-keyout", str(key),
             "-out", str(cert))  # fmt: skip
    return cert, key


def make_server_cert(root: Path, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A server certificate for 127.0.0.1 and localhost signed by ``ca``: (cert, key)."""
    cert, key, csr, ext = (root / n for n in ("server.pem", "server.key", "server.csr", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return cert, key


@dataclass(frozen=True)
class TLSFiles:
    """What an HTTPS registry was set up with, for the tests to verify it (or not)."""

    ca: Path  # the CA that signed the registry's certificate
    other_ca: Path  # a CA that did not
    cert: Path  # the server certificate (127.0.0.1, localhost) and its key, for
    key: Path  # other test servers to reuse

    @classmethod
    def make(cls, root: Path) -> TLSFiles:
        ca = make_ca(root, "ca")
        other = make_ca(root, "other-ca")
        cert, key = make_server_cert(root, ca)
        return cls(ca[0], other[0], cert, key)

    def context(self) -> ssl.SSLContext:
        """A client context trusting only ``ca``."""
        return ssl.create_default_context(cafile=str(self.ca))


@dataclass
class Registry:
    host: str  # 127.0.0.1:port
    root: Path
    tokens: TokenServer | None = None
    user: str = ""  # the first htpasswd or token user, if any
    password: str = ""
    tls: TLSFiles | None = None  # served over HTTPS with these

    @property
    def port(self) -> int:
        return int(self.host.rpartition(":")[2])

    @property
    def credentials(self) -> str:
        """``user:password``: skopeo's --dest-creds, the layer store's token."""
        return f"{self.user}:{self.password}"

    @property
    def ca_file(self) -> Path | None:
        """The CA a client must trust for this registry (None: plain HTTP)."""
        return self.tls.ca if self.tls is not None else None

    def store_url(self, repo: str) -> str:
        """This registry as a layer store (dsec.images.remote.ocistore): ``oci://``
        over HTTPS, ``oci+http://`` over plain HTTP."""
        scheme = "oci" if self.tls is not None else "oci+http"
        return f"{scheme}://{self.host}/{repo}"

    def push(self, layout: Path, tag: str, repo: str, *, creds: str | None = None) -> None:
        """skopeo copy --all oci:layout:tag -> docker://host/repo."""
        argv = [
            "skopeo",
            "copy",
            "--all",
            "--quiet",
            "--dest-tls-verify=false",
            f"oci:{layout}:{tag}",
            f"docker://{self.host}/{repo}",
        ]
        if creds is not None:
            argv.insert(2, f"--dest-creds={creds}")
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert res.returncode == 0, res.stderr


async def publish(
    reg: Registry, repo: str, tree: Path, name: str, version: str = "1", **kw: object
) -> LayerInfo:
    """What another host's ``dsec layer push`` leaves in ``reg``'s layer store ``repo``:
    ``tree`` published into a staging DirStore beside it, then blob, index and ref
    pushed (``kw`` goes to publish_tree: kind, config, ...)."""
    staging = DirStore(tree.parent / f"{tree.name}-store")
    info = publish_tree(staging, tree, name, version, **kw)  # type: ignore[arg-type]
    store = OCIStore(reg.store_url(repo), reg.credentials, ca_file=reg.ca_file)
    try:
        await store.push_blob(info.digest, staging.blob_path(info.digest))
        index = staging.get_index(info.digest)
        assert index is not None
        await store.push_index(info.digest, index)
        await store.put_ref(info)
    finally:
        await store.close()
    return info


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """A Docker token server (the spec's ``GET realm?service=..&scope=..``) for a
    registry's ``auth: token`` setup: checks basic credentials and answers an RS256 JWT
    signed with ``openssl dgst`` by a key whose self-signed certificate the registry
    trusts (``rootcertbundle``; the certificate travels in the ``x5c`` header).

    A token works for ``lifetime`` seconds and says so in ``expires_in``: its ``exp``
    is backdated by ``leeway``, the registry's allowance for clock skew, so that a
    short lifetime really runs out inside a test."""

    SERVICE = "dsec-test-registry"
    ISSUER = "dsec-test-issuer"

    def __init__(
        self,
        root: Path,
        users: dict[str, str],
        *,
        lifetime: int = 300,
        leeway: int = REGISTRY_LEEWAY,
    ) -> None:
        self.key = root / "token.key"
        self.cert = root / "token.pem"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                 "-out", str(self.cert), "-days", "1", "-subj", "/CN=dsec-test")  # fmt: skip
        der = subprocess.run(
            ["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
            capture_output=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        self.x5c = base64.b64encode(der).decode()
        self.users = users
        self.lifetime = lifetime
        self.leeway = leeway
        self.issued = 0
        # None: grant the actions asked; a list: grant only those (a token a client has
        # cached then falls short of a later request, as a narrowed or revoked one would).
        self.grant: list[str] | None = None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def answer(self, req: http.server.BaseHTTPRequestHandler) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(req.path).query)
        auth = req.headers.get("Authorization", "")
        user = None
        if auth.startswith("Basic "):
            name, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
            if self.users.get(name) == pw:
                user = name
        if user is None:
            req.send_response(401)
            req.end_headers()
            return
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            granted = actions.split(",") if self.grant is None else self.grant
            access.append({"type": kind, "name": name, "actions": granted})
        now = int(time.time())
        claims = {
            "iss": self.ISSUER,
            "sub": user,
            "aud": self.SERVICE,
            "exp": now + self.lifetime - self.leeway,
            "nbf": now - self.leeway - 10,
            "iat": now - self.leeway - 10,
            "jti": os.urandom(8).hex(),
            "access": access,
        }
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        signing = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing.encode(), capture_output=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        body = json.dumps(
            {"token": f"{signing}.{_b64url(sig)}", "expires_in": self.lifetime}
        ).encode()
        self.issued += 1
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)


@contextlib.contextmanager
def _serve(
    root: Path, port: int, *, verify: ssl.SSLContext | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """docker-registry on ``root/config.yml``, until it answers /v2/ (200 or 401): over
    HTTPS checked with ``verify`` when given, else plain HTTP."""
    log = open(root / "registry.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [REGISTRY, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    url = f"{'https' if verify is not None else 'http'}://127.0.0.1:{port}/v2/"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(url, timeout=1, verify=verify if verify is not None else True)
                if r.status_code in (200, 401):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"docker-registry did not start: {(root / 'registry.log').read_text()[-2000:]}"
                )
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def registry(
    *,
    htpasswd: dict[str, str] | None = None,
    token_users: dict[str, str] | None = None,
    token_lifetime: int = 300,
    tls: bool = False,
) -> Iterator[Registry]:
    """A registry (deletes enabled, as the layer store's delete_ref needs): open, with
    htpasswd basic auth for ``htpasswd``, or with bearer tokens living
    ``token_lifetime`` seconds from a TokenServer for ``token_users``; over HTTPS with
    a CA and server certificate made here for ``tls``. Its storage and processes are
    gone afterwards, also on failure."""
    root = Path(tempfile.mkdtemp(prefix="dsec-oci-reg-"))
    port = free_port()
    auth = ""
    tokens: TokenServer | None = None
    files: TLSFiles | None = None
    users = htpasswd or token_users or {}
    try:
        if token_users is not None:
            tokens = TokenServer(root, token_users, lifetime=token_lifetime)
            auth = (
                f"auth:\n  token:\n    realm: {tokens.realm}\n    service: {tokens.SERVICE}\n"
                f"    issuer: {tokens.ISSUER}\n    rootcertbundle: {tokens.cert}\n"
            )
        if htpasswd is not None:
            # bcrypt cost 4: the registry checks the password on every request (basic
            # auth has no session); at the default cost 12 that is ~0.4 s each here.
            salt = crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)
            lines = [f"{user}:{crypt.crypt(pw, salt)}" for user, pw in htpasswd.items()]
            (root / "htpasswd").write_text("\n".join(lines) + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: dsec-test\n    path: {root / 'htpasswd'}\n"
        listen = f"http:\n  addr: 127.0.0.1:{port}\n"
        if tls:
            files = TLSFiles.make(root)
            listen += f"  tls:\n    certificate: {files.cert}\n    key: {files.key}\n"
        (root / "config.yml").write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
            "  delete:\n    enabled: true\n" + listen + auth
        )
        user, password = next(iter(users.items()), ("", ""))
        with _serve(root, port, verify=files.context() if files is not None else None):
            yield Registry(f"127.0.0.1:{port}", root, tokens, user, password, files)
    finally:
        if tokens is not None:
            tokens.close()
        shutil.rmtree(root, ignore_errors=True)


# -- building OCI layouts --

Entry = bytes | str | None  # file content, "opaque" marker, "dir", or None (whiteout)


def layer_tar(entries: dict[str, Entry], base: Path | None = None) -> bytes:
    """A layer tar: optionally a whole tree ``base``, then ``entries``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        if base is not None:
            for path in sorted(base.rglob("*")):
                info = tf.gettarinfo(str(path), str(path.relative_to(base)))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if info.isreg():
                    with open(path, "rb") as fh:
                        tf.addfile(info, fh)
                else:
                    tf.addfile(info)
        for name, content in entries.items():
            parent, _, leaf = name.rpartition("/")
            if content is None:
                info = tarfile.TarInfo(f"{parent}/.wh.{leaf}" if parent else f".wh.{leaf}")
                tf.addfile(info, io.BytesIO(b""))
            elif content == "opaque":
                info = tarfile.TarInfo(f"{name}/.wh..wh..opq")
                tf.addfile(info, io.BytesIO(b""))
            elif content == "dir":
                info = tarfile.TarInfo(name)
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                info.mtime = FIXED_MTIME
                tf.addfile(info)
            else:
                assert isinstance(content, bytes)
                info = tarfile.TarInfo(name)
                info.size = len(content)
                info.mode = 0o644
                info.mtime = FIXED_MTIME
                tf.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def busybox_base(entries: dict[str, Entry]) -> bytes:
    """The tar of a busybox tree plus ``entries`` (the base the test images share)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "t"
        tree.mkdir()
        busybox_tree(tree, HOST_BUSYBOX)
        return layer_tar(entries, base=tree)


class Layout:
    """An OCI image layout directory being written (blobs + index.json)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        self.index: list[dict[str, object]] = []

    def blob(self, data: bytes, media: str) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (self.path / "blobs" / "sha256" / digest).write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    def image(
        self, layers: list[tuple[bytes, str]], config: dict[str, object], arch: str = "amd64"
    ) -> dict[str, object]:
        """Layers as (tar, "gzip" | "zstd"); returns the manifest descriptor."""
        descs, diff_ids = [], []
        for tar, comp in layers:
            diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
            if comp == "gzip":
                descs.append(self.blob(gzip.compress(tar, mtime=0), OCI_LAYER_GZIP))
            else:
                descs.append(self.blob(zstandard.ZstdCompressor().compress(tar), OCI_LAYER_ZSTD))
        cfg = {
            "architecture": arch,
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        cdesc = self.blob(json.dumps(cfg).encode(), "application/vnd.oci.image.config.v1+json")
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": cdesc,
            "layers": descs,
        }
        mdesc = self.blob(json.dumps(manifest).encode(), OCI_MANIFEST)
        mdesc["platform"] = {"architecture": arch, "os": "linux"}
        return mdesc

    def tag(self, tag: str, manifests: list[dict[str, object]]) -> None:
        """index.json gets ``tag``: one manifest, or a nested multi-arch index."""
        if len(manifests) == 1:
            entry = dict(manifests[0])
        else:
            index = {
                "schemaVersion": 2,
                "mediaType": OCI_INDEX,
                "manifests": manifests,
            }
            entry = self.blob(json.dumps(index).encode(), OCI_INDEX)
        entry.pop("platform", None)
        entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
        self.index.append(entry)
        (self.path / "index.json").write_text(
            json.dumps({"schemaVersion": 2, "manifests": self.index})
        )


CAP_NET_RAW_V2 = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)  # cap_net_raw+ep
CAP_NET_RAW_V3 = struct.pack("<IIIIII", 0x03000001, 1 << 13, 0, 0, 0, 1000)  # with a rootid


def fidelity_tar(lower_file: str) -> bytes:
    """A layer on a base holding ``lower_file``: file capabilities (v2 and v3) and other
    xattrs, device nodes, and two hard links to the base's ``lower_file``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, caps in (("bin/pingish", CAP_NET_RAW_V2), ("bin/pingv3", CAP_NET_RAW_V3)):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = 4, 0o755, FIXED_MTIME
            info.pax_headers = {
                "SCHILY.xattr.security.capability": caps.decode("utf-8", "surrogateescape"),
                "SCHILY.xattr.user.note": "kept",
                "SCHILY.xattr.trusted.overlay.redirect": "/etc",  # never applied
            }
            tf.addfile(info, io.BytesIO(b"ping"))
        for name, kind, major, minor in (
            ("dev/mem2", tarfile.CHRTYPE, 1, 1),
            ("dev/sda9", tarfile.BLKTYPE, 8, 0),
        ):
            info = tarfile.TarInfo(name)
            info.type, info.devmajor, info.devminor, info.mode = kind, major, minor, 0o666
            tf.addfile(info)
        for name in ("bin/linked", "bin/linked2"):
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = tarfile.LNKTYPE, lower_file, 0o644
            tf.addfile(info)
    return buf.getvalue()
