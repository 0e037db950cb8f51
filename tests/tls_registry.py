"""An HTTPS OCI registry for tests: Debian's ``docker-registry`` (CNCF distribution)
serving TLS with a server certificate from a throwaway CA made by ``openssl`` here, and
bearer-token auth from a token service whose tokens live only a few seconds, so that
expiry and renewal happen inside a test.

(Separate from tests/registry_env.py and tests/oci_registry.py, the plain-HTTP ones.)
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import secrets
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import free_port

REGISTRY = "/usr/bin/docker-registry"
# distribution accepts a token up to this long after its ``exp`` (clock skew): a
# token meant to live N seconds is issued with exp = now + N - LEEWAY.
REGISTRY_LEEWAY = 60


def registry_available() -> bool:
    return shutil.which(REGISTRY) is not None and shutil.which("openssl") is not None


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
    """A server certificate for 127.0.0.1 and localhost signed by ``ca``."""
    cert, key, csr, ext = (root / n for n in ("server.pem", "server.key", "server.csr", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return cert, key


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class ShortTokens:
    """A Docker token service whose tokens work for ``lifetime`` seconds (and say so in
    ``expires_in``): basic credentials in, an RS256 JWT signed by ``openssl`` out."""

    def __init__(self, root: Path, lifetime: int) -> None:
        self.user, self.password = "dsec", secrets.token_hex(8)
        self.lifetime = lifetime
        self.key, self.cert = root / "token.key", root / "token.pem"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-subj", "/CN=dsec-test-token", "-keyout", str(self.key),
                 "-out", str(self.cert))  # fmt: skip
        der = subprocess.run(
            ["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
            check=True, capture_output=True, timeout=30,
        ).stdout  # fmt: skip
        self.x5c = base64.b64encode(der).decode()
        self.issued = 0
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                raw = f"{service.user}:{service.password}".encode()
                if self.headers.get("Authorization") != "Basic " + base64.b64encode(raw).decode():
                    self.send_response(401)
                    self.end_headers()
                    return
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                body = json.dumps(
                    {"token": service.sign(query), "expires_in": service.lifetime}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    @property
    def credentials(self) -> str:
        return f"{self.user}:{self.password}"

    def sign(self, query: dict[str, list[str]]) -> str:
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {
            "iss": "dsec-test-issuer",
            "sub": self.user,
            "aud": query.get("service", [""])[0],
            "exp": now + self.lifetime - REGISTRY_LEEWAY,
            "nbf": now - REGISTRY_LEEWAY - 10,
            "iat": now - REGISTRY_LEEWAY - 10,
            "jti": secrets.token_hex(8),
            "access": access,
        }
        signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        sig = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing.encode(), check=True, capture_output=True, timeout=30,
        ).stdout  # fmt: skip
        self.issued += 1
        return f"{signing}.{_b64(sig)}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@dataclass
class TLSRegistry:
    root: Path
    port: int
    ca: Path  # the CA that signed the registry's certificate
    other_ca: Path  # a CA that did not
    tokens: ShortTokens
    cert: Path  # the server certificate (127.0.0.1, localhost) and its key, for
    key: Path  # other test servers to reuse

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def store_url(self, repo: str) -> str:
        return f"oci://{self.host}/{repo}"


@contextlib.contextmanager
def tls_registry(token_lifetime: int = 5) -> Iterator[TLSRegistry]:
    """docker-registry over HTTPS with token auth; everything removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="dsec-tlsreg-", dir="/tmp"))
    tokens: ShortTokens | None = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        ca = make_ca(root, "ca")
        other = make_ca(root, "other-ca")
        cert, key = make_server_cert(root, ca)
        tokens = ShortTokens(root, token_lifetime)
        port = free_port()
        (root / "config.yml").write_text(
            f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root / "data"}
http:
  addr: 127.0.0.1:{port}
  tls:
    certificate: {cert}
    key: {key}
auth:
  token:
    realm: {tokens.realm}
    service: dsec-test
    issuer: dsec-test-issuer
    rootcertbundle: {tokens.cert}
"""
        )
        log = open(root / "registry.log", "wb")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            [REGISTRY, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        verify = ssl.create_default_context(cafile=str(ca[0]))
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"https://127.0.0.1:{port}/v2/", timeout=1, verify=verify)
                if r.status_code == 401:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"docker-registry did not start: {(root / 'registry.log').read_text()[-2000:]}"
                )
            time.sleep(0.05)
        yield TLSRegistry(root, port, ca[0], other[0], tokens, cert, key)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if tokens is not None:
            tokens.close()
        shutil.rmtree(root, ignore_errors=True)
