"""A real OCI registry for tests: Debian's ``docker-registry`` (the CNCF distribution
registry) on a loopback port, filled with ``skopeo copy`` from OCI layouts built here.
The one registry fixture of the image-pull, registry-store and Dockerfile tests.

``registry(...)`` starts one (plain HTTP; open, htpasswd basic auth through the
registry's own setup, or bearer tokens from our TokenServer) and removes it and its
storage afterwards; ``Layout`` writes an OCI image layout directory from layer trees
described as {path: bytes | None (whiteout) | "opaque" | "dir"} dicts.
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

from dsec.images.builders import HOST_BUSYBOX, busybox_tree
from tests.conftest import free_port

# bcrypt for the htpasswd file: the stdlib's crypt (3.11, 3.12; gone in 3.13, where the
# registry tests skip) rather than a new dependency for one line of a test fixture.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import crypt
    except ImportError:  # pragma: no cover - Python >= 3.13
        crypt = None  # type: ignore[assignment]

REGISTRY = "/usr/bin/docker-registry"

OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
FIXED_MTIME = 1_700_000_000


def registry_available() -> bool:
    """docker-registry, skopeo and a bcrypt for htpasswd (install.sh brings the first two)."""
    return all(shutil.which(x) for x in (REGISTRY, "skopeo", "openssl")) and crypt is not None


@dataclass
class Registry:
    host: str  # 127.0.0.1:port
    root: Path
    tokens: TokenServer | None = None
    user: str = ""  # the first htpasswd or token user, if any
    password: str = ""

    @property
    def port(self) -> int:
        return int(self.host.rpartition(":")[2])

    @property
    def credentials(self) -> str:
        """``user:password``: skopeo's --dest-creds, the layer store's token."""
        return f"{self.user}:{self.password}"

    def store_url(self, repo: str) -> str:
        """This registry as a plain-HTTP layer store (dsec.images.remote.ocistore)."""
        return f"oci+http://{self.host}/{repo}"

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


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """A Docker token server (the spec's ``GET realm?service=..&scope=..``) for a
    registry's ``auth: token`` setup: checks basic credentials and answers an RS256 JWT
    signed with ``openssl dgst`` by a key whose self-signed certificate the registry
    trusts (``rootcertbundle``; the certificate travels in the ``x5c`` header)."""

    SERVICE = "dsec-test-registry"
    ISSUER = "dsec-test-issuer"

    def __init__(self, root: Path, users: dict[str, str]) -> None:
        self.key = root / "token.key"
        self.cert = root / "token.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
             str(self.key), "-out", str(self.cert), "-days", "1", "-subj", "/CN=dsec-test"],
            capture_output=True, check=True, timeout=60,
        )  # fmt: skip
        der = subprocess.run(
            ["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
            capture_output=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        self.x5c = base64.b64encode(der).decode()
        self.users = users
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
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": os.urandom(8).hex(),
            "access": access,
        }
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        signing = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing.encode(), capture_output=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        body = json.dumps({"token": f"{signing}.{_b64url(sig)}", "expires_in": 300}).encode()
        self.issued += 1
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)


@contextlib.contextmanager
def _serve(root: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """docker-registry on ``root/config.yml``, until it answers /v2/ (200 or 401)."""
    log = open(root / "registry.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [REGISTRY, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1)
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
    *, htpasswd: dict[str, str] | None = None, token_users: dict[str, str] | None = None
) -> Iterator[Registry]:
    """A registry (deletes enabled, as the layer store's delete_ref needs): open, with
    htpasswd basic auth for ``htpasswd``, or with bearer tokens from a TokenServer for
    ``token_users``. Its storage and processes are gone afterwards, also on failure."""
    root = Path(tempfile.mkdtemp(prefix="dsec-oci-reg-"))
    port = free_port()
    auth = ""
    tokens: TokenServer | None = None
    users = htpasswd or token_users or {}
    try:
        if token_users is not None:
            tokens = TokenServer(root, token_users)
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
        (root / "config.yml").write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{port}\n" + auth
        )
        user, password = next(iter(users.items()), ("", ""))
        with _serve(root, port):
            yield Registry(f"127.0.0.1:{port}", root, tokens, user, password)
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
