"""Checks of path and query parameters that pydantic models do not cover.

Sandbox ids are checked before they reach the edge: an id that cannot exist is reported
as ``sandbox_not_found`` (404), like an id that does not exist, so callers see one
behaviour for "no such sandbox" whatever the id looks like.
"""

from __future__ import annotations

from dsec.api.fields import LABEL_KEY_RE, SANDBOX_ID_RE, parse_image_ref
from dsec.errors import InvalidArgument, SandboxNotFound

# The largest value a SQLite INTEGER (and so every cursor and step number) can hold.
INT64_MAX = (1 << 63) - 1
# Entries a directory listing may ask for at once (the agent's own cap is 10,000 a page
# by default; a larger number was only a way to ask for an unbounded answer).
MAX_LIST_LIMIT = 1_000_000


def check_sandbox_id(sandbox_id: str) -> str:
    if not SANDBOX_ID_RE.match(sandbox_id):
        raise SandboxNotFound(
            f"no sandbox {sandbox_id[:80]!r}: sandbox ids look like 'e0-0123456789abcdef'"
        )
    return sandbox_id


def check_sandbox_path(path: str) -> str:
    if not path.startswith("/") or "\x00" in path or len(path) > 4096:
        raise InvalidArgument(
            f"path must be an absolute path without NUL bytes (<= 4096 chars), got {path[:200]!r}"
        )
    return path


def check_image_ref(ref: str) -> str:
    """A valid ``name[:tag]`` with no '.' or '..' path segments in the name."""
    try:
        name, _ = parse_image_ref(ref)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidArgument(
            f"invalid image reference {ref!r}: empty, '.' and '..' name segments are not allowed"
        )
    return ref


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """``["k=v", ...]`` -> dict; a selector must name a key and may have an empty value."""
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not LABEL_KEY_RE.match(key):
            raise InvalidArgument(
                f"query.label: expected key=value with a key of [A-Za-z0-9._/-], got {pair[:100]!r}"
            )
        labels[key] = value
    return labels


def parse_mode(mode: str) -> int:
    """An octal permission string such as ``644`` or ``0755``."""
    if not (1 <= len(mode) <= 4) or any(c not in "01234567" for c in mode):
        raise InvalidArgument(
            f"query.mode: expected an octal file mode like 644, got {mode[:20]!r}"
        )
    return int(mode, 8)
