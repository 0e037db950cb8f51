"""A real OCI distribution registry for tests: Debian's ``docker-registry`` package (the
CNCF distribution registry) on a loopback port, with a temp config, storage directory
and an htpasswd (bcrypt) user, so requests go through its own basic-auth setup.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import secrets
import shutil
import socketserver
import subprocess
import tempfile
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

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


def registry_available() -> bool:
    return shutil.which(REGISTRY) is not None and crypt is not None


@dataclass
class Registry:
    root: Path
    port: int
    user: str
    password: str
    proc: subprocess.Popen[bytes]

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def credentials(self) -> str:
        return f"{self.user}:{self.password}"

    def store_url(self, repo: str) -> str:
        return f"oci+http://{self.host}/{repo}"


@contextlib.contextmanager
def _serve(root: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """docker-registry on ``root/config.yml``, until it answers /v2/ (with a 401)."""
    log = open(root / "registry.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [REGISTRY, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT
    )
    log.close()
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 401:
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
def registry() -> Iterator[Registry]:
    root = Path(tempfile.mkdtemp(prefix="dsec-registry-", dir="/tmp"))
    port = free_port()
    user, password = "dsec", secrets.token_hex(8)
    # bcrypt cost 4: the registry checks the password on every request (basic auth has
    # no session), and at the default cost 12 that is ~0.4 s each on these machines.
    (root / "htpasswd").write_text(
        f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n"
    )
    (root / "config.yml").write_text(
        f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root / "data"}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
auth:
  htpasswd:
    realm: dsec-test
    path: {root / "htpasswd"}
"""
    )
    try:
        with _serve(root, port) as proc:
            yield Registry(root, port, user, password, proc)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- a registry with token auth: our own token service signs RS256 JWTs with openssl --


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    """The registry's token service: checks basic credentials, answers a JWT for the
    scope asked (pull and push on any repository), signed with ``key`` whose
    self-signed certificate the registry trusts and which the token carries (x5c)."""

    def __init__(self, root: Path, user: str, password: str) -> None:
        self.root = root
        self.user, self.password = user, password
        self.key = root / "token.key"
        self.cert = root / "token.crt"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=dsec-test-token", "-keyout", str(self.key), "-out", str(self.cert)],
            check=True, capture_output=True,
        )  # fmt: skip
        der = subprocess.run(
            ["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        self.x5c = base64.b64encode(der).decode()
        self.port = free_port()
        self.issued = 0
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                want = (
                    "Basic "
                    + base64.b64encode(f"{service.user}:{service.password}".encode()).decode()
                )
                if self.headers.get("Authorization") != want:
                    self.send_response(401)
                    self.end_headers()
                    return
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                body = json.dumps({"token": service.sign(query)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

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
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": secrets.token_hex(8),
            "access": access,
        }
        signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        sig = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing.encode(), check=True, capture_output=True,
        ).stdout  # fmt: skip
        self.issued += 1
        return f"{signing}.{_b64(sig)}"


@contextlib.contextmanager
def token_registry() -> Iterator[tuple[Registry, TokenService]]:
    """A distribution registry whose auth is ``token``: clients are sent to our token
    service (basic credentials there), as Docker Hub and most private registries do."""
    root = Path(tempfile.mkdtemp(prefix="dsec-tokreg-", dir="/tmp"))
    port = free_port()
    tokens = TokenService(root, "dsec", secrets.token_hex(8))
    tokens.thread.start()
    (root / "config.yml").write_text(
        f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root / "data"}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
auth:
  token:
    realm: {tokens.realm}
    service: dsec-test
    issuer: dsec-test-issuer
    rootcertbundle: {tokens.cert}
"""
    )
    try:
        with _serve(root, port) as proc:
            yield Registry(root, port, tokens.user, tokens.password, proc), tokens
    finally:
        tokens.server.shutdown()
        tokens.server.server_close()
        shutil.rmtree(root, ignore_errors=True)
