"""Who may touch a job: its rollouts, model endpoint, trajectories, pause and resume.

A job id is chosen by the client, so it is a name tenants could collide on or guess.
Jobs are owned the way sandboxes are: by a project. The first use of a job id (a
rollout, a sandbox created with ``job_id``, a trajectory step, setting its model
endpoint) records the caller's project (``iam_jobs``); from then on every route that
reads or changes the job needs the ``runtime`` role on that project (or an ancestor),
as stopping a sandbox needs it on the sandbox's project. Another tenant reusing the id
gets a 403 (the id is taken: that much it learns, never the job's content).

A job nobody owns yet has nothing of a tenant's in it, except what was made before job
ownership existed: that is treated as the default project's (as sandboxes from before
IAM are), so reading it needs ``runtime`` there.

Without IAM (``dsec up`` with quotas off: one user) every check passes.

A rollout (its id is random and unguessable) is checked on its own project as well; one
the caller may not see is a 404 as if it did not exist (dsec.apiserver.rollouts).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from dsec.control.iam import IAM, Role
from dsec.control.iam_tables import JobRow
from dsec.errors import PermissionDenied

#: Owners cached in memory (rows never change); cleared whole past this many.
CACHE_MAX = 100_000


class JobAccess:
    def __init__(self, iam: IAM | None) -> None:
        self.iam = iam
        self._owners: dict[str, str] = {}
        self._sessions = (
            None
            if iam is None
            else async_sessionmaker(iam.engine, expire_on_commit=False, class_=AsyncSession)
        )

    @property
    def enforced(self) -> bool:
        """False in single-user mode (no IAM): every check passes."""
        return self.iam is not None

    async def owner(self, job_id: str) -> str | None:
        """The project the job belongs to; None if nobody used it yet (or no IAM)."""
        if self._sessions is None:
            return None
        hit = self._owners.get(job_id)
        if hit is not None:
            return hit
        async with self._sessions() as s:
            row = await s.get(JobRow, job_id)
        if row is None:
            return None
        self._remember(job_id, row.project)
        return row.project

    def _remember(self, job_id: str, project: str) -> None:
        if len(self._owners) >= CACHE_MAX:
            self._owners.clear()
        self._owners[job_id] = project

    async def claim(
        self, principal: str, job_id: str, project: str | None, action: str
    ) -> str | None:
        """Use ``job_id`` for work in ``project`` (None: the job's project if it has
        one, else the principal's default).

        The caller needs ``runtime`` on that project; the first use records it as the
        job's owner; a job owned by another project needs ``runtime`` there too (403
        otherwise: the id belongs to someone else). Returns the resolved project (None
        without IAM)."""
        iam = self.iam
        if iam is None or self._sessions is None:
            return project
        owned = await self.owner(job_id)
        if owned is not None and project is None:  # e.g. the endpoint of a known job
            await self._require_on(principal, job_id, owned, action)
            return owned
        where = project or await iam.default_project(principal)
        await iam.require(principal, Role.RUNTIME, where, action)
        if owned is None:
            async with self._sessions() as s:
                s.add(JobRow(job_id=job_id, project=where, principal=principal, created_at=_now()))
                try:
                    await s.commit()
                    owned = where
                except IntegrityError:  # another request (or apiserver) was first
                    await s.rollback()
                    owned = await self.owner(job_id)
            if owned is None:  # pragma: no cover - the row that won is there
                owned = where
            self._remember(job_id, owned)
        if owned != where:
            await self._require_on(principal, job_id, owned, action)
        return where

    async def require(self, principal: str, job_id: str, action: str) -> None:
        """Reading or changing an existing job: ``runtime`` on its project (a job
        nobody owns: on the default project, where work from before ownership is)."""
        iam = self.iam
        if iam is None:
            return
        owned = await self.owner(job_id) or iam.default
        await self._require_on(principal, job_id, owned, action)

    async def _require_on(self, principal: str, job_id: str, project: str, action: str) -> None:
        assert self.iam is not None
        held = await self.iam.role_on(principal, project)
        if held is None or held.rank < Role.RUNTIME.rank:
            raise PermissionDenied(
                f"{action}: job {job_id!r} belongs to a project where principal "
                f"{principal!r} has no role (job ids are per tenant: pick another)",
                principal=principal,
                job_id=job_id,
            )

    async def may_see(self, principal: str, project: str | None) -> bool:
        """Whether ``principal`` may see a rollout (or sandbox) of ``project`` (None:
        made before IAM, the default project's)."""
        iam = self.iam
        if iam is None:
            return True
        held = await iam.role_on(principal, project or iam.default)
        return held is not None and held.rank >= Role.RUNTIME.rank


def _now() -> datetime:
    return datetime.now(UTC)
