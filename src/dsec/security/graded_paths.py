"""Which agent paths a verify step grades: the request's, or a default from the spec.

Policy of the edge, not wire shape: the request (dsec.api.verify) only says which paths
a caller asked for; this decides what "none given" means for a sandbox and refuses a
graded path that overlaps a protected one.
"""

from __future__ import annotations

from dsec.api.spec import DSecRunArgs
from dsec.api.verify import DEFAULT_GRADED, VerifyRequest, check_graded_path


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def collapse_graded(paths: list[str]) -> list[str]:
    """Sorted, without duplicates and without paths inside another graded path."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not any(_under(p, kept) for kept in out):
            out.append(p)
    return out


def overlaps(a: str, b: str) -> bool:
    """One path is the other or inside it."""
    return _under(a, b) or _under(b, a)


def resolve_graded(spec: DSecRunArgs, req: VerifyRequest) -> list[str]:
    """The paths a step grades: the request's, else the spec's workdir, else the usual
    work directories (those that overlap a protected path left out). Raises ValueError
    for a graded path that overlaps a protected one: the grader would see the agent's
    files as answers, or the answers under the agent's name."""
    if req.graded is not None:
        paths = list(req.graded)
    elif spec.workdir != "/":
        try:
            paths = [check_graded_path(spec.workdir)]
        except ValueError as exc:
            raise ValueError(
                f"the sandbox's workdir cannot be graded by default ({exc}); pass graded=[...]"
            ) from None
    else:
        paths = list(DEFAULT_GRADED)
    out = []
    for p in collapse_graded(paths):
        clash = next((m.path for m in spec.protected if overlaps(p, m.path)), None)
        if clash is None:
            out.append(p)
        elif req.graded is not None:
            raise ValueError(
                f"graded path {p} overlaps the protected path {clash}: "
                "grade the agent's work, not the answers"
            )
    return out
