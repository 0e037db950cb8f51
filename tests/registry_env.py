"""A real OCI distribution registry for tests: Debian's ``docker-registry`` package (the
CNCF distribution registry) on a loopback port, with a temp config, storage directory
and an htpasswd (bcrypt) user, so requests go through its own basic-auth setup.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import free_port

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import crypt  # bcrypt for htpasswd; Python 3.11's stdlib has it (no new dependency)

REGISTRY = "/usr/bin/docker-registry"


def registry_available() -> bool:
    return shutil.which(REGISTRY) is not None


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
        yield Registry(root, port, user, password, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(root, ignore_errors=True)
