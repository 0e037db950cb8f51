"""Bearer-key authentication: one dict lookup per request once a key is cached."""

from __future__ import annotations

from typing import Annotated, Protocol

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

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

    def __init__(self, keys: KeyVerifier) -> None:
        self._keys = keys

    async def __call__(
        self, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
    ) -> str:
        if credentials is None:
            raise Unauthenticated(MISSING_KEY)
        return await self._keys.verify(credentials.credentials)
