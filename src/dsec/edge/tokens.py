"""Per-sandbox data-path tokens: HMAC-signed, expiring, bound to one sandbox id.

The edge verifies a token with one HMAC and two comparisons, no database and no network
round trip, so the data path stays as fast as the agent allows. The key never leaves the
edge's data directory (a 0600 file): the apiserver asks the edge to mint tokens.

Format: ``dst1.<sandbox id>.<expiry, unix seconds>.<base64url HMAC-SHA256>``.

Scopes: a ``dst1`` token reaches every data-path route of its sandbox. A ``dsv1``
token (``scope="view"``) opens only the live view's WebSocket: it is what the
dashboard's session cookie can mint, so a logged-in browser can watch a VM's screen
(and type into it, which is what the live view is for) but never reach its commands,
files or sessions. The prefix is part of the signed body, so a view token cannot be
turned into a full one; routes ask for the scope they need (``verify(..., scope=)``)
and a full token satisfies both.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsec.errors import PermissionDenied, Unauthenticated

PREFIX = "dst1"  # the whole data path of one sandbox
VIEW_PREFIX = "dsv1"  # only its live view (dsec.edge.liveview)
Scope = Literal["full", "view"]
_PREFIXES: dict[str, Scope] = {PREFIX: "full", VIEW_PREFIX: "view"}
KEY_BYTES = 32
DEFAULT_TTL = 3600.0
MAX_TOKEN_LENGTH = 200


def load_or_create_key(path: Path) -> bytes:
    """The signing key at ``path``, created (0600, exclusively) on first use.

    A key readable by others is refused: anyone who reads it can forge tokens.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        key = secrets.token_bytes(KEY_BYTES)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
        return key
    st = path.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            "chmod 600 it or delete it to make a new key"
        )
    key = path.read_bytes()
    if len(key) < KEY_BYTES:
        raise PermissionError(f"{path} is not a valid token key (too short); delete it")
    return key


#: Verified token bodies remembered (each ~100 bytes); the cache starts over when full.
MAX_SIGNED_CACHE = 4096


@dataclass(frozen=True)
class Token:
    value: str
    expires_at: float
    """Unix time (seconds)."""


class TokenSigner:
    """Mints and verifies the tokens of one edge."""

    def __init__(self, key: bytes, *, ttl: float = DEFAULT_TTL) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError("token key must be at least 32 bytes")
        self._key = key
        self.ttl = ttl
        # Bodies whose signature this signer has checked: a client sends the same token
        # with every data-path frame, and the HMAC was ~2% of the edge's CPU per command.
        # The signature of a body never changes, so a hit skips only the HMAC; the
        # sandbox, expiry and scope checks still run on every frame.
        self._signed: dict[str, str] = {}

    def _sign(self, body: str) -> str:
        mac = hmac.new(self._key, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def mint(
        self,
        sandbox_id: str,
        *,
        ttl: float | None = None,
        now: float | None = None,
        scope: Scope = "full",
    ) -> Token:
        expires = int((time.time() if now is None else now) + (self.ttl if ttl is None else ttl))
        prefix = PREFIX if scope == "full" else VIEW_PREFIX
        body = f"{prefix}.{sandbox_id}.{expires}"
        return Token(f"{body}.{self._sign(body)}", float(expires))

    def verify(
        self, token: str, sandbox_id: str, *, now: float | None = None, scope: Scope = "full"
    ) -> None:
        """Raise ``Unauthenticated`` (forged, malformed, expired) or ``PermissionDenied``
        (a valid token of another sandbox, or a view token where ``scope="full"`` is
        needed); return quietly when the token is good for ``scope``."""
        if len(token) > MAX_TOKEN_LENGTH:
            raise Unauthenticated("invalid sandbox token: too long")
        parts = token.split(".")
        if len(parts) != 4 or parts[0] not in _PREFIXES:
            raise Unauthenticated("invalid sandbox token: not a dst1 or dsv1 token")
        body, _, sig = token.rpartition(".")
        expected = self._signed.get(body)
        known = expected is not None
        if expected is None:
            expected = self._sign(body)
        if not hmac.compare_digest(sig, expected):  # constant time, cached or not
            raise Unauthenticated("invalid sandbox token: bad signature")
        if not known:
            if len(self._signed) >= MAX_SIGNED_CACHE:
                self._signed.clear()
            self._signed[body] = expected
        if parts[1] != sandbox_id:
            raise PermissionDenied(
                f"this token is for sandbox {parts[1]}, not {sandbox_id}", sandbox_id=sandbox_id
            )
        try:
            expires = int(parts[2])
        except ValueError:
            raise Unauthenticated("invalid sandbox token: bad expiry") from None
        if expires <= (time.time() if now is None else now):
            raise Unauthenticated(
                "sandbox token expired; fetch a new one (POST /v1/sandboxes/{id}/token)",
                expired_at=expires,
            )
        if scope == "full" and _PREFIXES[parts[0]] == "view":
            raise PermissionDenied(
                f"this token only opens the live view of sandbox {sandbox_id}; commands and "
                "files need a full data-path token (POST /v1/sandboxes/{id}/token)",
                sandbox_id=sandbox_id,
            )


def looks_like_token(value: str) -> bool:
    return value.startswith((PREFIX + ".", VIEW_PREFIX + "."))
