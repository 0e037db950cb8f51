"""One edge seen from an apiserver: the edge's own HTTP API, with the cluster token.

An edge in cluster mode serves the same API as `dsec up` (its sandboxes only), so the
apiserver forwards a request as it came, and the edge's typed errors come back as
the same typed errors. A transport failure is an ``EdgeUnavailable`` (503) naming the
edge, except on create where a request that surely never arrived (connect failure)
is told apart so that the router can safely try another edge.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import TypeAdapter

from dsec.api.exec import ExecRequest, ExecResult, TrajectoryRef
from dsec.api.health import HealthInfo
from dsec.api.sandbox import DataPathInfo, NetworkRules, SandboxInfo, SandboxState
from dsec.api.spec import RunArgs
from dsec.api.verify import VerifyRequest, VerifyResult
from dsec.control.placement import LOAD_HEADER, EdgeLoad
from dsec.errors import DSecError, EdgeUnavailable, Timeout
from dsec.sdk._http import raise_for_error

_sandbox_list = TypeAdapter(list[SandboxInfo])


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

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=2.0)
        try:
            resp = await self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise EdgeNotReached(
                f"edge {self.edge_id} at {self.url} does not accept connections: {exc}",
                edge=self.edge_id,
            ) from exc
        except httpx.TimeoutException as exc:
            raise Timeout(
                f"edge {self.edge_id} did not answer {method} {path} in time", edge=self.edge_id
            ) from exc
        except httpx.HTTPError as exc:
            raise EdgeUnavailable(
                f"lost the connection to edge {self.edge_id} at {self.url}: {exc}",
                edge=self.edge_id,
            ) from exc
        raise_for_error(resp)
        return resp

    # -- EdgeAPI --------------------------------------------------------------------------
    async def create(self, spec: RunArgs, *, timeout: float) -> SandboxInfo:
        return (await self.create_load(spec, timeout=timeout))[0]

    async def create_load(
        self, spec: RunArgs, *, timeout: float
    ) -> tuple[SandboxInfo, EdgeLoad | None]:
        """Create, and the edge's usage right after as its answer states it (None from
        an edge that does not): placement reads it at once (dsec.control.placement)."""
        # Only what was set (an older edge knows no newer field), but always the backend:
        # a spec without one is read as a container spec.
        fields = {**spec.model_dump(mode="json", exclude_unset=True), "backend": spec.backend}
        body = {"spec": fields, "timeout": timeout}
        resp = await self._call("POST", "/v1/sandboxes", json=body, timeout=timeout + 10)
        info = SandboxInfo.model_validate_json(resp.content)
        return info, EdgeLoad.parse(resp.headers.get(LOAD_HEADER))

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

    async def health(self) -> HealthInfo:
        resp = await self._call("GET", "/v1/health", timeout=2.0)
        return HealthInfo.model_validate_json(resp.content)

    async def update_network(self, sandbox_id: str, rules: dict[str, bool]) -> NetworkRules:
        path = f"/v1/sandboxes/{sandbox_id}/network"
        resp = await self._call("PUT", path, json={"network_rules": rules})
        return NetworkRules.model_validate_json(resp.content)

    async def data_path(self, sandbox_id: str) -> DataPathInfo:
        resp = await self._call("POST", f"/v1/sandboxes/{sandbox_id}/token")
        return DataPathInfo.model_validate_json(resp.content)

    async def forward(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Any other edge route (jobs, pack, events) as it is."""
        return await self._call(method, path, **kwargs)
