"""Registry credentials and the challenges that ask for them.

Credentials come from a Docker ``config.json`` (``{"auths": {"host": {"auth":
base64(user:password)}}}`` or ``username``/``password`` fields; ``credHelpers`` and
``credsStore`` are not run: the platform never executes a helper a config names) or
from the caller of one pull. A registry answers 401 with ``WWW-Authenticate``:
``Basic`` means send them with every request; ``Bearer realm=..,service=..,scope=..``
means trade them (or nothing, for anonymous pulls) at the realm for a token, per the
Docker token spec. Tokens are cached per registry and scope for their lifetime.

This is the one registry authentication of the platform: the puller
(dsec.images.oci.client) and the registry layer store (dsec.images.remote.ocistore)
both send their requests through ``Authorizer.send``, which answers a 401 (and
refreshes an expired token) the same way for both.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from dsec.errors import InvalidArgument, RegistryError
from dsec.images.tls import describe_failure

# key="value" or key=token pairs of a challenge (RFC 7235 auth-params).
_PARAM_RE = re.compile(r'([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')
DOCKER_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io")
PULL_HINT = (
    "add them to the registry credentials file (Docker config.json format) or pass them to the pull"
)

# A request body: bytes, or a factory of a stream (called again when a 401 is answered).
Body = bytes | Callable[[], AsyncIterator[bytes]] | None


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    @classmethod
    def parse(cls, text: str) -> Credentials:
        """``user:password`` (the password may hold colons)."""
        user, _, password = text.partition(":")
        return cls(user, password)


def _host_key(key: str) -> str:
    """``https://host:port/v1/`` -> ``host:port``; Docker Hub's aliases -> docker.io."""
    if key in DOCKER_HUB_KEYS or key.rstrip("/") in DOCKER_HUB_KEYS:
        return "docker.io"
    host = key.split("://", 1)[-1].split("/", 1)[0]
    return "docker.io" if host in DOCKER_HUB_KEYS else host


def load_docker_config(path: Path) -> dict[str, Credentials]:
    """Registry host -> credentials from a Docker ``config.json``; a missing file is
    no credentials, a malformed one a clear error."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read registry credentials {path}: {exc}") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    out: dict[str, Credentials] = {}
    if not isinstance(auths, dict):
        return out
    for key, entry in auths.items():
        if not isinstance(entry, dict):
            continue
        user, password = entry.get("username"), entry.get("password")
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                raise InvalidArgument(
                    f"{path}: the auth entry of {key!r} is not base64(user:password)"
                ) from None
        if isinstance(user, str) and isinstance(password, str) and user:
            out[_host_key(str(key))] = Credentials(user, password)
    return out


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="..",service=".."`` -> ("bearer", {...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {
        m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
        for m in _PARAM_RE.finditer(rest)
    }
    return scheme.lower(), params


class Authorizer:
    """The ``Authorization`` header for each registry, earned from its challenges.

    ``hint`` finishes the error a basic challenge without credentials gets (where the
    caller's user gives them)."""

    def __init__(self, credentials: dict[str, Credentials], hint: str = PULL_HINT) -> None:
        self.credentials = credentials
        self.hint = hint
        # (registry, scope) -> (header, reuse it until, the token's own end or None)
        self._headers: dict[tuple[str, str], tuple[str, float, float | None]] = {}

    def header(self, registry: str, scope: str) -> str | None:
        """A cached header for this registry and scope, if still valid."""
        hit = self._headers.get((registry, scope))
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def expires(self, registry: str, scope: str) -> float | None:
        """When (time.monotonic()) the cached bearer token stops working; None for a
        basic header (it does not expire) or none cached: what a holder of the header
        outside this process (the lazy loader) must renew it by."""
        hit = self._headers.get((registry, scope))
        return hit[2] if hit is not None else None

    def forget(self, registry: str, scope: str) -> None:
        """Drop the cached header, so that the next request earns a fresh one."""
        self._headers.pop((registry, scope), None)

    async def send(
        self,
        http: httpx.AsyncClient,
        method: str,
        url: str,
        *,
        registry: str,
        scope: str,
        headers: dict[str, str] | None = None,
        content: Body = None,
        stream: bool = False,
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        """One request with the registry's authentication: the cached header if any,
        and a 401 answered once from its challenge (a fresh header: an expired token is
        refreshed, also in the middle of a push) before sending the request again. A
        streamed ``content`` is a factory, so it can be sent again. Transport errors
        (httpx.HTTPError) are the caller's; a failed answer is a RegistryError."""
        sent = dict(headers or {})
        auth = self.header(registry, scope)
        for attempt in range(2):
            if auth is not None:
                sent["Authorization"] = auth
            req = http.build_request(
                method,
                url,
                headers=sent,
                content=content() if callable(content) else content,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
            resp = await http.send(req, stream=stream)
            if resp.status_code != 401 or attempt:
                return resp
            challenge = resp.headers.get("www-authenticate", "")
            await resp.aclose()
            if not challenge:
                raise RegistryError(
                    f"registry {registry} answered 401 without a challenge", registry=registry
                )
            auth = await self.answer(http, registry, scope, challenge)
        raise AssertionError("unreachable")  # pragma: no cover

    async def answer(
        self, http: httpx.AsyncClient, registry: str, scope: str, challenge: str
    ) -> str:
        """Turn a 401's challenge into a header (and remember it)."""
        scheme, params = parse_challenge(challenge)
        creds = self.credentials.get(registry)
        if scheme == "basic":
            if creds is None:
                raise RegistryError(
                    f"registry {registry} needs a user name and password: {self.hint}",
                    registry=registry,
                )
            value, ttl, ends = creds.basic(), 3600.0, False
        elif scheme == "bearer":
            value, ttl = await self._token(http, registry, scope, params, creds)
            ends = True
        else:
            raise RegistryError(
                f"registry {registry} asks for unsupported authentication {scheme!r}",
                registry=registry,
            )
        now = time.monotonic()
        self._headers[(registry, scope)] = (
            value,
            now + max(ttl - 10.0, 1.0),
            now + ttl if ends else None,
        )
        return value

    async def _token(
        self,
        http: httpx.AsyncClient,
        registry: str,
        scope: str,
        params: dict[str, str],
        creds: Credentials | None,
    ) -> tuple[str, float]:
        """A token for the challenge's scope and ours (the challenge names what the
        failed request needed, often pull only: asking for ``scope`` too means a push
        needs no second token; a token service grants what the account may have)."""
        realm = params.get("realm")
        if not realm or not realm.startswith(("https://", "http://")):
            raise RegistryError(
                f"registry {registry} sent a bearer challenge without a usable realm",
                registry=registry,
            )
        scopes = list(dict.fromkeys(x for x in (params.get("scope"), scope) if x))
        query = httpx.QueryParams({"scope": scopes})
        if params.get("service"):
            query = query.set("service", params["service"])
        headers = {"Authorization": creds.basic()} if creds is not None else {}
        try:
            resp = await http.get(realm, params=query, headers=headers)
        except httpx.HTTPError as exc:
            raise RegistryError(
                f"token service {realm} of {registry} unreachable: {describe_failure(exc)}",
                registry=registry,
            ) from None
        if resp.status_code in (401, 403):
            raise RegistryError(
                f"registry {registry} refused the credentials for {' '.join(scopes)} "
                f"(its token service answered {resp.status_code})",
                registry=registry,
            )
        if resp.status_code != 200:
            raise RegistryError(
                f"token service {realm} of {registry} answered {resp.status_code}",
                registry=registry,
            )
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        token = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"token service {realm} sent no token", registry=registry)
        expires = doc.get("expires_in") if isinstance(doc, dict) else None
        ttl = float(expires) if isinstance(expires, int | float) and expires > 0 else 60.0
        return f"Bearer {token}", ttl
