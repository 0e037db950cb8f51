"""One edge seen from an apiserver: the edge's own HTTP API, with the cluster token.

An edge in cluster mode serves the same API as `dsec up` (its sandboxes only), so the
apiserver forwards a request as it came, and the edge's typed errors come back as
the same typed errors. A transport failure is an ``EdgeUnavailable`` (503) naming the
edge, except on create where a request that surely never arrived (connect failure)
is told apart so that the router can safely try another edge.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import httpx
from pydantic import TypeAdapter

from dsec.api.exec import ExecRequest, ExecResult, TrajectoryRef
from dsec.api.health import HealthInfo
from dsec.api.sandbox import (
    IDEMPOTENCY_HEADER,
    DataPathInfo,
    NetworkRules,
    SandboxInfo,
    SandboxState,
)
from dsec.api.spec import RunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.control.placement import LOAD_HEADER, EdgeLoad
from dsec.edge.tokens import Scope
from dsec.errors import DSecError, EdgeUnavailable, Timeout
from dsec.sdk._http import raise_for_error

_sandbox_list = TypeAdapter(list[SandboxInfo])
#: How long a relayed answer may send nothing (dsec.compat.e2b's streams keep alive
#: every <= 30 s), so that a hung edge does not hold a relay forever.
RELAY_IDLE_S = 120.0
#: Relayed requests in flight per edge: each running E2B command holds one stream.
RELAY_POOL = 4096


class EdgeNotReached(EdgeUnavailable):
    """The request never reached the edge (connection refused or timed out): nothing
    was done there, so another edge may be asked."""


class RemoteEdge:
    def __init__(self, edge_id: str, url: str, token: str, *, pool: int = 64) -> None:
        self.edge_id = edge_id
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "dsec-apiserver"},
            timeout=httpx.Timeout(30.0, connect=2.0),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
        )
        self._pool = pool
        self._relay: httpx.AsyncClient | None = None

    def _relay_http(self) -> httpx.AsyncClient:
        """Relayed callers' requests (long streams among them) have their own pool, so
        that they never queue the control calls, and carry no cluster token: the edge
        sees only the caller's own credentials. Made on first use."""
        if self._relay is None:
            self._relay = httpx.AsyncClient(
                base_url=self.url,
                headers={"User-Agent": "dsec-apiserver-relay"},
                limits=httpx.Limits(
                    max_connections=RELAY_POOL, max_keepalive_connections=self._pool
                ),
            )
        return self._relay

    async def close(self) -> None:
        await self._http.aclose()
        if self._relay is not None:
            await self._relay.aclose()

    async def _call(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=2.0)
        return await self._send(self._http.build_request(method, path, **kwargs), stream=False)

    async def _send(self, req: httpx.Request, *, stream: bool) -> httpx.Response:
        """Send, with transport failures and error answers as typed errors. ``stream``:
        the body is left unread for the caller (unless it is an error, read here)."""
        what = f"{req.method} {req.url.path}"
        try:
            resp = await self._http.send(req, stream=stream)
            if stream and resp.status_code >= 400:
                await resp.aread()
                await resp.aclose()
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, what) from exc
        raise_for_error(resp)
        return resp

    def _transport_error(self, exc: httpx.HTTPError, what: str) -> DSecError:
        """The typed error for a request to this edge that got no answer."""
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return EdgeNotReached(
                f"edge {self.edge_id} at {self.url} does not accept connections: {exc}",
                edge=self.edge_id,
            )
        if isinstance(exc, httpx.TimeoutException):
            return Timeout(f"edge {self.edge_id} did not answer {what} in time", edge=self.edge_id)
        return EdgeUnavailable(
            f"lost the connection to edge {self.edge_id} at {self.url}: {exc}", edge=self.edge_id
        )

    # -- EdgeAPI --------------------------------------------------------------------------
    async def create(self, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        return (await self.create_load(spec, timeout=timeout))[0]

    async def create_load(
        self, spec: RunArgs, *, timeout: float
    ) -> tuple[SandboxInfo, EdgeLoad | None]:
        """Create, and the edge's usage right after as its answer states it (None from
        an edge that does not): placement reads it at once (dsec.control.placement)."""
        info, load, _ = await self.create_keyed_load(spec, timeout=timeout, key=None)
        return info, load

    async def create_keyed_load(
        self, spec: RunArgs, *, timeout: float, key: str | None
    ) -> tuple[SandboxInfo, EdgeLoad | None, bool]:
        """``create_load`` with the edge's own Idempotency-Key (dsec.cluster.keys):
        also whether this call made the sandbox (201) or the key's earlier one did (200)."""
        # Only what was set (an older edge knows no newer field), but always the backend:
        # a spec without one is read as a container spec.
        fields = {**spec.model_dump(mode="json", exclude_unset=True), "backend": spec.backend}
        body = {"spec": fields, "timeout": timeout}
        headers = {} if key is None else {IDEMPOTENCY_HEADER: key}
        resp = await self._call(
            "POST", "/v1/sandboxes", json=body, headers=headers, timeout=timeout + 10
        )
        info = SandboxInfo.model_validate_json(resp.content)
        return info, EdgeLoad.parse(resp.headers.get(LOAD_HEADER)), resp.status_code == 201

    async def get(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("GET", f"/v1/sandboxes/{sandbox_id}")
        return SandboxInfo.model_validate_json(resp.content)

    async def list(
        self,
        *,
        labels: dict[str, str] | None = None,
        states: set[SandboxState] | None = None,
    ) -> list[SandboxInfo]:
        params: list[tuple[str, str]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        params += [("state", s.value) for s in states or ()]
        resp = await self._call("GET", "/v1/sandboxes", params=params)
        return _sandbox_list.validate_json(resp.content)

    async def stop(self, sandbox_id: str, *, reason: str = "stopped by request") -> SandboxInfo:
        return (await self.stop_load(sandbox_id, reason=reason))[0]

    async def stop_load(
        self, sandbox_id: str, *, reason: str = "stopped by request"
    ) -> tuple[SandboxInfo, EdgeLoad | None]:
        """Stop, and the edge's usage right after (see ``create_load``)."""
        resp = await self._call("DELETE", f"/v1/sandboxes/{sandbox_id}", timeout=60)
        info = SandboxInfo.model_validate_json(resp.content)
        return info, EdgeLoad.parse(resp.headers.get(LOAD_HEADER))

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        body = req.model_dump(mode="json", exclude_unset=True)
        wait = (req.timeout or 3600) + 10
        resp = await self._call("POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body, timeout=wait)
        return ExecResult.model_validate_json(resp.content)

    async def verify(self, sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        body = req.model_dump(mode="json", exclude_unset=True)
        wait = (req.timeout or 600) + 30
        path = f"/v1/sandboxes/{sandbox_id}/verify"
        resp = await self._call("POST", path, json=body, timeout=wait)
        return VerifyResult.model_validate_json(resp.content)

    async def read_file(self, sandbox_id: str, path: str, *, max_bytes: int) -> bytes:
        resp = await self._call("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path})
        if len(resp.content) > max_bytes:
            raise DSecError(f"file larger than {max_bytes} bytes")
        return resp.content

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        trajectory: TrajectoryRef | None = None,
    ) -> None:
        params: dict[str, str | int] = {"path": path, "mode": f"{mode:o}"}
        if trajectory is not None:
            params.update(trajectory.model_dump(exclude_none=True))
        await self._call("PUT", f"/v1/sandboxes/{sandbox_id}/files", params=params, content=data)

    async def read_stream(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes as the edge streams them; a typed error (missing file, no
        such sandbox) is raised before this returns, like the data plane's."""
        req = self._http.build_request(
            "GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path}
        )
        resp = await self._send(req, stream=True)
        return _chunks(resp)

    async def write_stream(
        self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes], *, mode: int
    ) -> int:
        """Forward a body chunk by chunk (memory: one chunk); the bytes sent."""
        sent = 0

        async def counted() -> AsyncIterator[bytes]:
            nonlocal sent
            async for chunk in chunks:
                sent += len(chunk)
                yield chunk

        req = self._http.build_request(
            "PUT",
            f"/v1/sandboxes/{sandbox_id}/files",
            params={"path": path, "mode": f"{mode:o}"},
            content=counted(),
            headers={"Content-Type": "application/octet-stream"},
        )
        await self._send(req, stream=False)
        return sent

    async def health(self) -> HealthInfo:
        resp = await self._call("GET", "/v1/health", timeout=2.0)
        return HealthInfo.model_validate_json(resp.content)

    async def update_network(self, sandbox_id: str, rules: dict[str, bool]) -> NetworkRules:
        path = f"/v1/sandboxes/{sandbox_id}/network"
        resp = await self._call("PUT", path, json={"network_rules": rules})
        return NetworkRules.model_validate_json(resp.content)

    async def data_path(self, sandbox_id: str, *, scope: Scope = "full") -> DataPathInfo:
        kind = "token" if scope == "full" else "view-token"
        resp = await self._call("POST", f"/v1/sandboxes/{sandbox_id}/{kind}")
        return DataPathInfo.model_validate_json(resp.content)

    async def forward(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Any other edge route (jobs, pack, events) as it is."""
        return await self._call(method, path, **kwargs)

    async def relay(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        params: builtins.list[tuple[str, str]],
        content: AsyncIterable[bytes] | None,
    ) -> httpx.Response:
        """A caller's request passed through: the body streamed up as it comes, the
        answer returned unread (streamed, whatever its status: the caller's protocol
        has its own error shapes). Only a transport failure is a typed error. Reads
        may idle up to RELAY_IDLE_S (streams there send keepalives well within it).

        The caller must close the answer (``aclose``)."""
        query: builtins.list[tuple[str, str | int | float | bool | None]] = [*params]
        req = self._relay_http().build_request(
            method,
            path,
            headers=headers,
            params=query,
            content=content,
            timeout=httpx.Timeout(RELAY_IDLE_S, connect=2.0),
        )
        try:
            return await self._relay_http().send(req, stream=True)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, f"{method} {path}") from exc


async def _chunks(resp: httpx.Response) -> AsyncIterator[bytes]:
    """A streamed answer's body, closed however the reader ends."""
    try:
        async for chunk in resp.aiter_bytes():
            yield chunk
    finally:
        await resp.aclose()
