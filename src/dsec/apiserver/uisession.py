"""Browser sessions of the dashboard (/ui): opaque server-side tokens, never the key.

A browser proves the API key once (``/ui?api_key=`` or the login form); it then holds
only a random token in an HttpOnly, SameSite=Strict cookie. The token maps, in this
process's memory, to the key (re-verified on every request, so revoking the key ends
the session) and to a per-session CSRF secret that the page must echo in a header on
the few state-changing calls a cookie may make. Sessions die with the process.

The store is this one process's: a cluster's apiservers do not share it. A cookie made
by one apiserver is unknown to the others (a 401 there, then the login form), so a
browser behind a load balancer over several apiservers needs sticky sessions, or the
operator opens one apiserver's URL. Sharing them (the control database) would put the
key's stand-in in a table every apiserver reads: not done.
"""

from __future__ import annotations

import hmac
import re
import secrets
import time
from dataclasses import dataclass

COOKIE = "dsec_ui"
CSRF_HEADER = "x-dsec-csrf"
SESSION_TTL = 12 * 3600.0
MAX_SESSIONS = 10_000

# What a cookie may reach: the reads the pages make, job pause/resume, and a sandbox's
# view-only token (the live view page opens the edge's VNC WebSocket with it; the
# token opens nothing else, dsec.edge.tokens), never a full data-path token.
COOKIE_READS = re.compile(
    r"^/(metrics|v1/health|v1/stats|v1/sandboxes|v1/sandboxes/[A-Za-z0-9_.:-]{1,64}"
    r"|v1/audit|v1/events|v1/events/stream)$"
)
COOKIE_WRITES = re.compile(
    r"^(/v1/jobs/[A-Za-z0-9._:@-]{1,128}/(pause|resume)|/v1/sandboxes/[A-Za-z0-9_.:-]{1,64}/view-token)$"
)


@dataclass(frozen=True)
class UISession:
    token: str
    csrf: str
    key: str
    expires: float


class UISessions:
    """The live sessions of one apiserver process."""

    def __init__(self, ttl: float = SESSION_TTL) -> None:
        self._ttl = ttl
        self._by_token: dict[str, UISession] = {}

    def open(self, key: str) -> UISession:
        now = time.monotonic()
        if len(self._by_token) >= MAX_SESSIONS:  # bounded: drop the expired, then oldest
            self._by_token = {t: s for t, s in self._by_token.items() if s.expires > now}
            while len(self._by_token) >= MAX_SESSIONS:
                self._by_token.pop(next(iter(self._by_token)))
        s = UISession(secrets.token_urlsafe(32), secrets.token_urlsafe(24), key, now + self._ttl)
        self._by_token[s.token] = s
        return s

    def lookup(self, token: str | None) -> UISession | None:
        if not token:
            return None
        s = self._by_token.get(token)
        if s is None:
            return None
        if s.expires <= time.monotonic():
            self._by_token.pop(token, None)
            return None
        return s

    def close(self, token: str | None) -> None:
        if token:
            self._by_token.pop(token, None)


def cookie_may(session: UISession, method: str, path: str, headers: dict[str, str]) -> bool:
    """Whether a request authenticated only by the cookie may proceed.

    Reads: GET/HEAD of the listed routes (SameSite=Strict already keeps the cookie off
    cross-site requests). Writes: POST of job pause/resume and of a sandbox's view token,
    only with the session's CSRF secret in ``X-DSec-CSRF`` (a cross-site page can
    neither read it nor set a custom header without a CORS preflight this server never
    grants), and, if the browser sends Origin, only from this same host."""
    if method in ("GET", "HEAD"):
        return COOKIE_READS.match(path) is not None
    if method != "POST" or COOKIE_WRITES.match(path) is None:
        return False
    origin = headers.get("origin")
    if origin is not None and not same_origin(origin, headers.get("host", "")):
        return False
    return hmac.compare_digest(headers.get(CSRF_HEADER, ""), session.csrf)


def same_origin(origin: str, host: str) -> bool:
    """``Origin: http://host:port`` names this server's ``Host``."""
    for scheme in ("http://", "https://"):
        if origin.startswith(scheme):
            return bool(host) and origin[len(scheme) :] == host
    return False
