"""IAM: principals, nested projects, roles with bounded delegation, and quotas.

Rules (docs/CLUSTER.md "IAM and quotas"):

- Roles ``admin`` > ``builder`` > ``runtime`` are bound to (principal, project) and hold
  on the project's whole subtree; a binding on ROOT (``*``) holds on every project.
  The bootstrap principal ``admin`` is admin on ROOT.
- Creating or deleting a project needs admin on its parent (ROOT for a top-level one).
- Granting or revoking on P needs admin on P or an ancestor, and nobody grants a role
  above their own there.
- Setting P's quota needs admin on P's *parent*: a project's own admin cannot raise
  it. A limit may not exceed the nearest ancestor's limit, nor be below a descendant's
  explicit limit. A limit below current usage is accepted and reported as a warning:
  nothing running is stopped, new sandboxes are refused until usage falls under it.

Every request path check (``role_on``) is an in-memory lookup: a principal's bindings
are cached ``cache_ttl`` seconds (changes through this instance apply at once; through
another apiserver within the TTL, as for API keys).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from dsec.api.fields import PROJECT_RE
from dsec.api.iam import (
    PRINCIPAL_RE,
    ROOT,
    KeyCreated,
    KeyInfo,
    PrincipalCreate,
    PrincipalInfo,
    ProjectInfo,
    QuotaInfo,
    QuotaLimits,
    QuotaUsage,
    Role,
    RoleBinding,
)
from dsec.control.db import Base
from dsec.control.iam_tables import (
    IAM_TABLES,
    ChargeRow,
    PrincipalRow,
    ProjectRow,
    QuotaRow,
    RoleBindingRow,
    UsageRow,
)
from dsec.control.keys import ApiKeyRow, KeyStore, hash_key
from dsec.control.quotas import Request, ancestors, make_charger, millicores
from dsec.errors import AlreadyExists, Conflict, InvalidArgument, NotFound, PermissionDenied

ADMIN = "admin"
DEFAULT_PROJECT = "default"
PENDING_PREFIX = "pending-"
KEY_ID_LEN = 16

__all__ = ["IAM", "ROOT", "Request", "Role", "ancestors"]


def _now() -> datetime:
    return datetime.now(UTC)


def check_project(path: str) -> str:
    if not PROJECT_RE.match(path):
        raise InvalidArgument(
            f"invalid project path {path!r}: up to 8 segments of [a-z0-9._-] (each "
            "starting with a letter or digit) joined by '/'",
            project=path,
        )
    return path


def parent_of(path: str) -> str:
    """The parent project, ROOT for a top-level one."""
    return path.rsplit("/", 1)[0] if "/" in path else ROOT


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidArgument(
            f"unknown role {role!r}; known roles: {', '.join(r.value for r in Role)}"
        ) from None


class IAM:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        default_project: str = DEFAULT_PROJECT,
        cache_ttl: float = 60.0,
    ) -> None:
        self.engine = engine
        self.default = check_project(default_project)
        self.charger = make_charger(engine)
        self._sessions = async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
        self._ttl = cache_ttl
        self._bindings: dict[str, tuple[dict[str, Role], str | None, float]] = {}

    # -- setup ------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop the charger's own connection (SQLite); the engine stays the caller's."""
        await self.charger.close()

    async def create_tables(self) -> None:
        """Create the IAM tables if missing (a migrated database already has them)."""
        tables = [Base.metadata.tables[t] for t in IAM_TABLES]
        async with self.engine.begin() as conn:
            await conn.run_sync(lambda sync: Base.metadata.create_all(sync, tables=tables))

    async def ensure_bootstrap(self) -> None:
        """Project ``default``, principal ``admin`` admin on ROOT, and the builder grants
        of the role store that came before IAM (``principal_roles``) as ROOT bindings.
        Idempotent and safe when two apiservers start at once."""
        async with self._sessions() as s:
            if await s.get(PrincipalRow, ADMIN) is None:
                s.add(PrincipalRow(name=ADMIN, kind="human", created_at=_now()))
                await _commit_or_rollback(s)
        if not await self._exists(self.default):
            with contextlib.suppress(AlreadyExists):  # another apiserver made it first
                await self._insert_project(self.default)
        await self._bind(ADMIN, ROOT, Role.ADMIN, None, replace=False)
        legacy = Base.metadata.tables.get("principal_roles")
        if legacy is not None:
            async with self.engine.connect() as conn:
                has = await conn.run_sync(
                    lambda sync: sync.dialect.has_table(sync, "principal_roles")
                )
                rows = (
                    (await conn.execute(select(legacy.c.principal, legacy.c.role))).all()
                    if has
                    else []
                )
            for principal, role in rows:
                if role in Role.__members__.values():
                    await self._ensure_principal(principal, None)
                    await self._bind(principal, ROOT, Role(role), None, replace=False)

    # -- authorisation (in memory on the request path) ----------------------------------
    async def _cached(self, principal: str) -> tuple[dict[str, Role], str | None]:
        hit = self._bindings.get(principal)
        now = time.monotonic()
        if hit is not None and hit[2] > now:
            return hit[0], hit[1]
        async with self._sessions() as s:
            rows = (
                await s.execute(
                    select(RoleBindingRow.project, RoleBindingRow.role).where(
                        RoleBindingRow.principal == principal
                    )
                )
            ).all()
            row = await s.get(PrincipalRow, principal)
        found = {p: Role(r) for p, r in rows}
        default = row.default_project if row is not None else None
        self._bindings[principal] = (found, default, now + self._ttl)
        return found, default

    def _forget(self, principal: str) -> None:
        self._bindings.pop(principal, None)

    async def role_on(self, principal: str, project: str) -> Role | None:
        """The highest role ``principal`` holds on ``project`` (own or inherited)."""
        bindings, _ = await self._cached(principal)
        best: Role | None = bindings.get(ROOT)
        if project != ROOT:
            for p in ancestors(project):
                r = bindings.get(p)
                if r is not None and (best is None or r.rank > best.rank):
                    best = r
        return best

    async def require(self, principal: str, role: Role, project: str, action: str) -> None:
        """Raise PermissionDenied (403) unless ``principal`` holds ``role`` on
        ``project`` (ROOT: on every project)."""
        held = await self.role_on(principal, project)
        if held is None or held.rank < role.rank:
            where = "every project" if project == ROOT else f"project {project!r}"
            raise PermissionDenied(
                f"{action} needs the {role.value!r} role on {where} (or an ancestor); "
                f"principal {principal!r} has {held.value if held else 'no role'} there",
                principal=principal,
                role=role.value,
                project=project,
            )

    async def holds_anywhere(self, principal: str, role: Role) -> bool:
        bindings, _ = await self._cached(principal)
        return any(r.rank >= role.rank for r in bindings.values())

    async def default_project(self, principal: str) -> str:
        """Where a create that names no project is charged."""
        _, default = await self._cached(principal)
        return default or self.default

    # -- projects -----------------------------------------------------------------------
    async def _exists(self, path: str) -> bool:
        async with self._sessions() as s:
            return await s.get(ProjectRow, path) is not None

    async def _insert_project(self, path: str) -> ProjectRow:
        parent = parent_of(path)
        row = ProjectRow(path=path, parent=None if parent == ROOT else parent, created_at=_now())
        async with self._sessions() as s:
            if row.parent is not None and await s.get(ProjectRow, row.parent) is None:
                raise NotFound(f"parent project {row.parent!r} does not exist", project=path)
            s.add(row)
            try:
                await s.flush()
                s.add(QuotaRow(project=path))
                s.add(UsageRow(project=path, sandboxes=0, cpu_millicores=0, memory_mb=0))
                await s.commit()
            except IntegrityError:
                raise AlreadyExists(f"project {path!r} already exists", project=path) from None
        return row

    async def create_project(self, caller: str, path: str) -> ProjectInfo:
        check_project(path)
        await self.require(caller, Role.ADMIN, parent_of(path), f"creating project {path!r}")
        if await self._exists(path):
            raise AlreadyExists(f"project {path!r} already exists", project=path)
        return _project_info(await self._insert_project(path))

    async def get_project(self, caller: str, path: str) -> ProjectInfo:
        check_project(path)
        await self.require(caller, Role.RUNTIME, path, "reading a project")
        async with self._sessions() as s:
            row = await s.get(ProjectRow, path)
        if row is None:
            raise NotFound(f"project {path!r} does not exist", project=path)
        return _project_info(row)

    async def projects(self, caller: str) -> list[ProjectInfo]:
        """Every project the caller holds some role on, in tree order."""
        async with self._sessions() as s:
            rows = (await s.scalars(select(ProjectRow).order_by(ProjectRow.path))).all()
        return [_project_info(r) for r in rows if await self.role_on(caller, r.path) is not None]

    async def delete_project(self, caller: str, path: str) -> None:
        """Only an empty project goes: no sub-projects, nothing charged."""
        check_project(path)
        await self.require(caller, Role.ADMIN, parent_of(path), f"deleting project {path!r}")
        if path == self.default:
            raise Conflict(f"the default project {path!r} cannot be deleted", project=path)
        async with self._sessions() as s, s.begin():
            if await s.get(ProjectRow, path) is None:
                raise NotFound(f"project {path!r} does not exist", project=path)
            children = await s.scalar(
                select(func.count()).select_from(ProjectRow).where(ProjectRow.parent == path)
            )
            charges = await s.scalar(
                select(func.count()).select_from(ChargeRow).where(ChargeRow.project == path)
            )
            if children or charges:
                raise Conflict(
                    f"project {path!r} is not empty ({children} sub-projects, {charges} "
                    "sandboxes charged)",
                    project=path,
                    children=children,
                    sandboxes=charges,
                )
            await s.execute(delete(RoleBindingRow).where(RoleBindingRow.project == path))
            await s.execute(delete(QuotaRow).where(QuotaRow.project == path))
            await s.execute(delete(UsageRow).where(UsageRow.project == path))
            await s.execute(delete(ProjectRow).where(ProjectRow.path == path))
        self._bindings.clear()

    # -- principals ---------------------------------------------------------------------
    async def _ensure_principal(self, name: str, created_by: str | None) -> None:
        async with self._sessions() as s:
            if await s.get(PrincipalRow, name) is None:
                s.add(
                    PrincipalRow(name=name, kind="agent", created_by=created_by, created_at=_now())
                )
                await _commit_or_rollback(s)

    async def create_principal(self, caller: str, spec: PrincipalCreate) -> PrincipalInfo:
        """Needs admin on some project: a project admin makes the agents it runs."""
        if not await self.holds_anywhere(caller, Role.ADMIN):
            raise PermissionDenied("creating a principal needs the admin role on some project")
        if spec.default_project is not None:
            await self.require(
                caller, Role.ADMIN, spec.default_project, "setting a principal's default project"
            )
        row = PrincipalRow(
            name=spec.name,
            kind=spec.kind,
            created_by=caller,
            default_project=spec.default_project,
            created_at=_now(),
        )
        async with self._sessions() as s:
            s.add(row)
            try:
                await s.commit()
            except IntegrityError:
                raise AlreadyExists(
                    f"principal {spec.name!r} already exists", principal=spec.name
                ) from None
        self._forget(spec.name)
        return _principal_info(row)

    async def principals(self, caller: str) -> list[PrincipalInfo]:
        """ROOT admins see every principal; others those they created and themselves."""
        everyone = await self.role_on(caller, ROOT) is Role.ADMIN
        async with self._sessions() as s:
            stmt = select(PrincipalRow).order_by(PrincipalRow.name)
            if not everyone:
                stmt = stmt.where(
                    (PrincipalRow.created_by == caller) | (PrincipalRow.name == caller)
                )
            return [_principal_info(r) for r in (await s.scalars(stmt)).all()]

    async def _may_manage(self, caller: str, principal: str) -> None:
        """Keys of P: P itself, whoever created P, or a ROOT admin."""
        if caller == principal or await self.role_on(caller, ROOT) is Role.ADMIN:
            return
        async with self._sessions() as s:
            row = await s.get(PrincipalRow, principal)
        if row is not None and row.created_by == caller:
            return
        raise PermissionDenied(
            f"only {principal!r} itself, its creator or a root admin manage its keys",
            principal=principal,
        )

    # -- keys ---------------------------------------------------------------------------
    async def create_key(self, caller: str, keys: KeyStore, principal: str) -> KeyCreated:
        async with self._sessions() as s:
            if await s.get(PrincipalRow, principal) is None:
                raise NotFound(
                    f"principal {principal!r} does not exist (create it first)",
                    principal=principal,
                )
        await self._may_manage(caller, principal)
        key = await keys.create(principal)
        return KeyCreated(
            id=hash_key(key)[:KEY_ID_LEN], principal=principal, created_at=_now(), key=key
        )

    async def list_keys(self, caller: str, principal: str | None = None) -> list[KeyInfo]:
        everyone = await self.role_on(caller, ROOT) is Role.ADMIN
        async with self._sessions() as s:
            stmt = select(ApiKeyRow).order_by(ApiKeyRow.created_at)
            if principal is not None:
                stmt = stmt.where(ApiKeyRow.principal == principal)
            rows = (await s.scalars(stmt)).all()
            created = set(
                (
                    await s.scalars(
                        select(PrincipalRow.name).where(PrincipalRow.created_by == caller)
                    )
                ).all()
            )
        return [
            KeyInfo(id=r.key_hash[:KEY_ID_LEN], principal=r.principal, created_at=r.created_at)
            for r in rows
            if everyone or r.principal == caller or r.principal in created
        ]

    async def revoke_key(self, caller: str, keys: KeyStore, key_id: str) -> KeyInfo:
        """Revoke by id (a prefix of the key's hash, at least 8 hex digits)."""
        if not (8 <= len(key_id) <= 64) or any(c not in "0123456789abcdef" for c in key_id):
            raise InvalidArgument("a key id is 8..64 lowercase hex digits (see `dsec key list`)")
        async with self._sessions() as s:
            rows = (
                await s.scalars(select(ApiKeyRow).where(ApiKeyRow.key_hash.startswith(key_id)))
            ).all()
        if not rows:
            raise NotFound(f"no key with id {key_id}", key_id=key_id)
        if len(rows) > 1:
            raise InvalidArgument(f"key id {key_id} is ambiguous; give more digits")
        row = rows[0]
        await self._may_manage(caller, row.principal)
        await keys.revoke_digest(row.key_hash)
        return KeyInfo(
            id=row.key_hash[:KEY_ID_LEN], principal=row.principal, created_at=row.created_at
        )

    # -- roles --------------------------------------------------------------------------
    async def _bind(
        self, principal: str, project: str, role: Role, by: str | None, *, replace: bool
    ) -> None:
        async with self._sessions() as s:
            row = await s.get(RoleBindingRow, (principal, project))
            if row is None:
                s.add(
                    RoleBindingRow(
                        principal=principal,
                        project=project,
                        role=role.value,
                        created_by=by,
                        created_at=_now(),
                    )
                )
            elif replace and row.role != role.value:
                row.role = role.value
                row.created_by = by
            else:
                return
            await _commit_or_rollback(s)
        self._forget(principal)

    async def grant(
        self, caller: str, principal: str, project: str, role: Role | str, *, create: bool = False
    ) -> RoleBinding:
        """Bind ``role`` (replacing the principal's binding on exactly this project).
        ``create``: register an unknown principal (keys made before IAM)."""
        role = _role(role)
        if project != ROOT:
            check_project(project)
        await self.require(caller, Role.ADMIN, project, "granting a role")
        own = await self.role_on(caller, project)
        if own is None or role.rank > own.rank:  # bounded delegation
            raise PermissionDenied(f"cannot grant {role.value!r}: above your own role there")
        if project != ROOT and not await self._exists(project):
            raise NotFound(f"project {project!r} does not exist", project=project)
        async with self._sessions() as s:
            known = await s.get(PrincipalRow, principal) is not None
        if not known:
            if not create:
                raise NotFound(f"principal {principal!r} does not exist", principal=principal)
            await self._ensure_principal(principal, caller)
        await self._bind(principal, project, role, caller, replace=True)
        return RoleBinding(principal=principal, project=project, role=role)

    async def revoke(self, caller: str, principal: str, project: str) -> bool:
        """Remove the principal's binding on exactly ``project``; False if it had none."""
        if project != ROOT:
            check_project(project)
        await self.require(caller, Role.ADMIN, project, "revoking a role")
        if principal == ADMIN and project == ROOT:
            raise Conflict("the bootstrap admin's root binding cannot be revoked")
        async with self._sessions() as s, s.begin():
            row = await s.get(RoleBindingRow, (principal, project))
            if row is None:
                return False
            own = await self.role_on(caller, project)
            if own is None or Role(row.role).rank > own.rank:
                raise PermissionDenied("cannot revoke a role above your own there")
            await s.delete(row)
        self._forget(principal)
        return True

    async def bindings(self, caller: str, project: str) -> list[RoleBinding]:
        """Who holds what on ``project``: its own bindings and those inherited."""
        if project != ROOT:
            check_project(project)
        await self.require(caller, Role.RUNTIME, project, "listing roles")
        chain = [ROOT] if project == ROOT else [ROOT, *ancestors(project)]
        async with self._sessions() as s:
            rows = (
                await s.scalars(
                    select(RoleBindingRow)
                    .where(RoleBindingRow.project.in_(chain))
                    .order_by(RoleBindingRow.project, RoleBindingRow.principal)
                )
            ).all()
        return [
            RoleBinding(
                principal=r.principal,
                project=r.project,
                role=Role(r.role),
                inherited_from=None if r.project == project else r.project,
            )
            for r in rows
        ]

    # -- quotas -------------------------------------------------------------------------
    async def quota(self, caller: str, project: str) -> QuotaInfo:
        check_project(project)
        await self.require(caller, Role.RUNTIME, project, "reading a quota")
        return await self._quota_info(project)

    async def _quota_info(self, project: str, warnings: Sequence[str] = ()) -> QuotaInfo:
        async with self._sessions() as s:
            q = await s.get(QuotaRow, project)
            u = await s.get(UsageRow, project)
        if q is None or u is None:
            raise NotFound(f"project {project!r} does not exist", project=project)
        return QuotaInfo(
            project=project,
            limits=_limits(q),
            usage=QuotaUsage(
                sandboxes=u.sandboxes, cpu_cores=u.cpu_millicores / 1000, memory_mb=u.memory_mb
            ),
            warnings=list(warnings),
        )

    async def set_quota(self, caller: str, project: str, limits: QuotaLimits) -> QuotaInfo:
        """Replace ``project``'s limits (None: no limit at this level)."""
        check_project(project)
        await self.require(
            caller, Role.ADMIN, parent_of(project), f"setting the quota of {project!r}"
        )
        new = (
            limits.max_sandboxes,
            None if limits.cpu_cores is None else millicores(limits.cpu_cores),
            limits.memory_mb,
        )
        names = ("max_sandboxes", "cpu_cores", "memory_mb")
        scale = (1.0, 1000.0, 1.0)
        chain = ancestors(project)
        warnings: list[str] = []
        async with self._sessions() as s, s.begin():
            locked = select(QuotaRow).where(
                QuotaRow.project.in_(chain) | QuotaRow.project.startswith(project + "/")
            )
            if self.engine.dialect.name == "postgresql":
                locked = locked.order_by(QuotaRow.project).with_for_update()
            rows = {r.project: r for r in (await s.scalars(locked)).all()}
            if project not in rows:
                raise NotFound(f"project {project!r} does not exist", project=project)
            for i, value in enumerate(new):
                if value is None:
                    continue
                for anc in reversed(chain[:-1]):  # nearest ancestor with a limit
                    bound = _col(rows[anc], i)
                    if bound is not None:
                        if value > bound:
                            raise InvalidArgument(
                                f"{names[i]} {value / scale[i]:g} exceeds the limit of the "
                                f"ancestor {anc!r} ({bound / scale[i]:g})",
                                project=project,
                                resource=names[i],
                                ancestor=anc,
                                limit=bound / scale[i],
                            )
                        break
                for path, row in rows.items():
                    below = _col(row, i)
                    if path.startswith(project + "/") and below is not None and below > value:
                        raise InvalidArgument(
                            f"{names[i]} {value / scale[i]:g} is below the limit of the "
                            f"sub-project {path!r} ({below / scale[i]:g}); lower that first",
                            project=project,
                            resource=names[i],
                            descendant=path,
                            limit=below / scale[i],
                        )
            row = rows[project]
            row.max_sandboxes, row.cpu_millicores, row.memory_mb = new
            usage = await s.get(UsageRow, project)
            if usage is not None:
                current = (usage.sandboxes, usage.cpu_millicores, usage.memory_mb)
                for i, value in enumerate(new):
                    if value is not None and current[i] > value:
                        warnings.append(
                            f"{names[i]} limit {value / scale[i]:g} is below current usage "
                            f"{current[i] / scale[i]:g}: nothing is stopped, new sandboxes "
                            "are refused until usage falls below it"
                        )
        return await self._quota_info(project, warnings)

    # -- charging (dsec.control.quotas) -------------------------------------------------
    async def charge(self, project: str, sandbox_id: str, cpu_cores: float, memory_mb: int) -> None:
        await self.charger.charge(project, sandbox_id, cpu_cores, memory_mb)

    async def charge_many(self, project: str, requests: Sequence[Request]) -> int:
        return await self.charger.charge_many(project, requests)

    async def release(self, sandbox_id: str) -> bool:
        return await self.charger.release(sandbox_id)

    async def release_many(self, sandbox_ids: Sequence[str]) -> int:
        return await self.charger.release_many(sandbox_ids)

    async def rebind(self, provisional: str, sandbox_id: str) -> bool:
        return await self.charger.rebind(provisional, sandbox_id)

    @staticmethod
    def provisional_id() -> str:
        """The charge key while the sandbox's real id is not known yet (the edge picks it)."""
        return PENDING_PREFIX + secrets.token_hex(12)

    async def reconcile(
        self, live: set[str], *, prefix: str, pending_older_than: float | None = None
    ) -> list[str]:
        """Release charges of sandboxes that no longer exist: ids starting with
        ``prefix`` (one edge's) that are not in ``live``, and provisional charges older
        than ``pending_older_than`` seconds (creates that never finished)."""
        gone = [sid for sid, _ in await self.charger.charged(prefix) if sid not in live]
        if pending_older_than is not None:
            cutoff = _now().timestamp() - pending_older_than
            for sid, at in await self.charger.charged(PENDING_PREFIX):
                if (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp() <= cutoff:
                    gone.append(sid)
        if gone:
            await self.charger.release_many(gone)
        return gone


async def _commit_or_rollback(s: AsyncSession) -> None:
    """Commit; a concurrent insert of the same row (another apiserver) is fine."""
    try:
        await s.commit()
    except IntegrityError:
        await s.rollback()


def _col(row: QuotaRow, i: int) -> int | None:
    return (row.max_sandboxes, row.cpu_millicores, row.memory_mb)[i]


def _limits(q: QuotaRow) -> QuotaLimits:
    return QuotaLimits(
        max_sandboxes=q.max_sandboxes,
        cpu_cores=None if q.cpu_millicores is None else q.cpu_millicores / 1000,
        memory_mb=q.memory_mb,
    )


def _project_info(row: ProjectRow) -> ProjectInfo:
    return ProjectInfo(path=row.path, parent=row.parent, created_at=row.created_at)


def _principal_info(row: PrincipalRow) -> PrincipalInfo:
    return PrincipalInfo(
        name=row.name,
        kind=row.kind,
        created_by=row.created_by,
        default_project=row.default_project,
        created_at=row.created_at,
    )


def check_principal_name(name: str) -> str:
    if not PRINCIPAL_RE.match(name):
        raise InvalidArgument(f"invalid principal name {name!r}: [A-Za-z0-9._@-], <= 128")
    return name
