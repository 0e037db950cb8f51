"""Bearer-key authentication: one dict lookup per request once a key is cached.

The dashboard's browser session cookie (dsec.apiserver.uisession) is accepted too,
only where that module's ``cookie_may`` allows (safe reads, CSRF-checked job
pause/resume) and only on an app that serves the dashboard."""

from __future__ import annotations

from typing import Annotated, Protocol

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from dsec.apiserver.uisession import COOKIE, UISessions, cookie_may
from dsec.errors import Unauthenticated

_bearer = HTTPBearer(
    auto_error=False,
    description="The API key printed by `dsec up` (also saved to ~/.config/dsec/config.json).",
)

MISSING_KEY = (
    "missing API key: send 'Authorization: Bearer <key>' "
    "(`dsec up` prints the key and saves it for the SDK and the CLI)"
)


class KeyVerifier(Protocol):
    async def verify(self, key: str) -> str: ...


class Authenticator:
    """FastAPI dependency returning the caller's principal, or raising Unauthenticated."""

    def __init__(self, keys: KeyVerifier, sessions: UISessions | None = None) -> None:
        self._keys = keys
        self._sessions = sessions

    async def bearer(self, credentials: HTTPAuthorizationCredentials | None) -> str:
        """The key alone (WebSockets and other callers outside FastAPI's dependencies)."""
        if credentials is None:
            raise Unauthenticated(MISSING_KEY)
        return await self._keys.verify(credentials.credentials)

    async def __call__(
        self,
        conn: HTTPConnection,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ) -> str:
        if credentials is not None or self._sessions is None:
            return await self.bearer(credentials)
        if conn.scope["type"] == "http":
            session = self._sessions.lookup(conn.cookies.get(COOKIE))
            headers = dict(conn.headers.items())
            if session is not None and cookie_may(
                session, conn.scope["method"], conn.url.path, headers
            ):
                return await self._keys.verify(session.key)
        raise Unauthenticated(MISSING_KEY)
