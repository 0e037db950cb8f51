"""Who may touch which sandbox through the E2B API: our keys, IAM and tokens.

The control plane authenticates E2B's ``X-API-KEY`` with our key store (the same keys
our SDK sends as a bearer token) and checks the ``runtime`` role on the sandbox's
project, as our own stop does; a sandbox of a project the caller may not use answers
as not found, so ids of other projects are not revealed. envd calls carry the
per-sandbox data-path token we hand out as ``envdAccessToken`` (``X-Access-Token``),
bound to the ``E2b-Sandbox-Id`` they name.

Where the sandbox lives decides who mints that token: the in-process data plane
(`dsec up`, and every cluster edge), or, on a cluster apiserver, the sandbox's own
edge, asked through its E2B route with the cluster token (``relay``); so an envd
request relayed to that edge is checked there with the edge's own key.
"""

from __future__ import annotations

from dsec.api.iam import Role
from dsec.api.sandbox import SandboxInfo
from dsec.apiserver.auth import Authenticator, KeyVerifier
from dsec.apiserver.relay import EdgeRelay
from dsec.apiserver.rl import RLEdge
from dsec.apiserver.sandboxaccess import SandboxAccess
from dsec.control.iam import IAM
from dsec.edge.api import EdgeAPI
from dsec.edge.dataplane import DataPlane
from dsec.edge.tokens import looks_like_token
from dsec.errors import (
    BackendError,
    SandboxNotFound,
    Unauthenticated,
    Unsupported,
)

TOKEN_TTL = 7 * 86400.0  # an E2B client keeps the token of its sandbox for its life


class Access:
    def __init__(
        self,
        keys: KeyVerifier,
        edge: EdgeAPI,
        plane: DataPlane | None,
        iam: IAM | None,
        rl: RLEdge | None = None,
        relay: EdgeRelay | None = None,
        sandboxes: SandboxAccess | None = None,
    ) -> None:
        if plane is None and relay is None:
            raise ValueError("E2B needs a data plane or a relay to the sandboxes' edges")
        self.rl = rl
        self.keys = keys
        self.edge = edge
        self.plane = plane
        self.relay = relay
        self.iam = iam
        # The platform's one check of who may use which sandbox (shared with our API).
        self.sandboxes = sandboxes or SandboxAccess(edge, iam, Authenticator(keys))

    async def principal(self, api_key: str | None) -> str:
        if not api_key:
            raise Unauthenticated("missing API key: send it as X-API-KEY (E2B_API_KEY)")
        return await self.keys.verify(api_key)

    async def may_use(self, principal: str, info: SandboxInfo) -> bool:
        return await self.sandboxes.may_use(principal, info)

    async def sandbox(self, principal: str, sandbox_id: str) -> SandboxInfo:
        """A live sandbox the principal may use, else SandboxNotFound."""
        info = await self.edge.get(sandbox_id)
        if info.state.terminal or not await self.may_use(principal, info):
            raise SandboxNotFound(f"sandbox {sandbox_id} not found")
        return info

    async def _jobs(self, principal: str, info: SandboxInfo) -> tuple[RLEdge, str]:
        """Pause and resume are our job pause, which needs ``builder`` as in our API."""
        if self.rl is None or not info.spec.job_id:
            raise Unsupported("pause needs the RL job service (dsec up serves it)")
        if self.iam is not None:
            project = info.spec.project or self.iam.default
            await self.iam.require(principal, Role.BUILDER, project, "pausing a sandbox")
        return self.rl, info.spec.job_id

    async def pause(self, principal: str, info: SandboxInfo) -> None:
        rl, job = await self._jobs(principal, info)
        report = await rl.pause_job(job)
        if report.failed:
            raise BackendError(f"pausing sandbox {info.id} failed")

    async def resume(self, principal: str, info: SandboxInfo) -> None:
        rl, job = await self._jobs(principal, info)
        await rl.resume_job(job)

    async def token(self, sandbox_id: str) -> str:
        """The sandbox's envd access token, minted where envd is served for it."""
        if self.plane is not None:
            return self.plane.signer.mint(sandbox_id, ttl=TOKEN_TTL).value
        assert self.relay is not None
        resp = await self.relay.forward_to(sandbox_id, "GET", f"/sandboxes/{sandbox_id}")
        token = resp.json().get("envdAccessToken")
        if not isinstance(token, str) or not looks_like_token(token):
            raise BackendError(f"the edge of sandbox {sandbox_id} gave no envd token")
        return token

    async def touch(self, sandbox_id: str, timeout: int) -> None:
        """The sandbox's idle clock starts over (E2B's set_timeout), on its edge."""
        if self.plane is not None:
            self.plane.edge.mark_active(sandbox_id)
            return
        assert self.relay is not None
        path = f"/sandboxes/{sandbox_id}/timeout"
        await self.relay.forward_to(sandbox_id, "POST", path, json={"timeout": timeout})

    async def envd(self, sandbox_id: str | None, token: str | None, api_key: str | None) -> str:
        """The sandbox an envd request may act on."""
        if not sandbox_id:
            raise SandboxNotFound("missing E2b-Sandbox-Id header")
        if token and looks_like_token(token):
            if self.plane is None:
                raise Unsupported("envd tokens are checked by the sandbox's edge")
            self.plane.authorize(sandbox_id, token)
            return sandbox_id
        await self.sandbox(await self.principal(api_key), sandbox_id)
        return sandbox_id
