"""What the async and the sync sender share: client settings, responses, failures.

A non-2xx answer becomes the typed error the server reported; an httpx failure becomes a
typed error that names the URL and what to do (``PlatformUnavailable``, ``Timeout``).
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeVar

import httpx

from dsec.config import load_client_config
from dsec.errors import DSecError, PlatformUnavailable, Timeout, error_from_payload
from dsec.sdk._protocol import CONNECT_TIMEOUT, Call

T = TypeVar("T")

SDK_VERSION = "0.1.0"

HINT = "is `dsec up` running? (set DSEC_URL or pass url= to point elsewhere)"


def default_timeout(seconds: float | None) -> httpx.Timeout:
    return httpx.Timeout(seconds, connect=min(CONNECT_TIMEOUT, seconds or CONNECT_TIMEOUT))


class ClientSettings:
    """Where the platform is and how to talk to it; resolved once per client."""

    def __init__(
        self,
        url: str | None,
        api_key: str | None,
        *,
        timeout: float | None,
        max_connections: int,
    ) -> None:
        config = load_client_config(url, api_key)
        self.url = config.url
        self.api_key = config.api_key
        self.timeout = timeout
        self.max_connections = max_connections

    def http_kwargs(self, max_connections: int | None = None) -> dict[str, Any]:
        """Arguments for httpx.Client / httpx.AsyncClient: keep-alive pool, auth, timeouts."""
        conns = max_connections or self.max_connections
        headers = {"User-Agent": f"libdsec/{SDK_VERSION}"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return {
            "base_url": self.url,
            "headers": headers,
            "timeout": default_timeout(self.timeout),
            "limits": httpx.Limits(
                max_connections=conns,
                # Idle connections beyond this are closed: after a burst, a pool full
                # of idle connections made every later request slower (measured).
                max_keepalive_connections=min(conns, 8),
                keepalive_expiry=60.0,
            ),
        }


def request_kwargs(call: Call[Any]) -> dict[str, Any]:
    """Arguments for ``client.request`` except a streamed body, which each client adds."""
    kwargs: dict[str, Any] = {"method": call.method, "url": call.path}
    if call.params:
        kwargs["params"] = call.params
    if call.headers:
        kwargs["headers"] = call.headers
    if call.content is not None:
        kwargs["content"] = call.content
    if call.timeout is not None:
        kwargs["timeout"] = call.timeout
    return kwargs


def raise_for_error(resp: httpx.Response) -> None:
    """Re-raise a non-2xx answer as the typed error the server reported."""
    if resp.status_code < 400:
        return
    try:
        payload: Any = resp.json()
    except ValueError:
        payload = resp.text
    raise error_from_payload(resp.status_code, payload)


def finish(call: Call[T], resp: httpx.Response) -> T:
    raise_for_error(resp)
    return call.parse(resp)


def transport_error(exc: httpx.HTTPError, base_url: str) -> DSecError:
    """Translate an httpx failure into a typed error that says where and what to do."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return PlatformUnavailable(
            f"cannot reach the DSec platform at {base_url}: {exc or type(exc).__name__}; {HINT}",
            url=base_url,
        )
    if isinstance(exc, httpx.TimeoutException):
        where = ""
        with contextlib.suppress(RuntimeError):
            where = f" ({exc.request.method} {exc.request.url.path})"
        return Timeout(f"no answer from {base_url} in time{where}", url=base_url)
    if isinstance(exc, httpx.TransportError):
        return PlatformUnavailable(
            f"lost the connection to {base_url}: {exc or type(exc).__name__}", url=base_url
        )
    return DSecError(f"HTTP failure talking to {base_url}: {exc}")
