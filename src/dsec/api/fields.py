"""Shapes of the fields many wire models share: names, ids, users, paths, network rules.

Pure checks (no I/O): the SDK runs them before a request leaves the caller, the
servers run them again on what arrives.
"""

from __future__ import annotations

import re

# `name:tag` or `name` (tag defaults to latest); names like registry paths are allowed.
IMAGE_REF_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")


LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


USER_RE = re.compile(r"^([a-z_][a-z0-9_-]{0,31}|\d{1,10}(:\d{1,10})?)$")


# Job, trajectory and rollout ids: safe in URLs, file names and log lines.
TRAJECTORY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


SANDBOX_ID_RE = re.compile(r"^[a-z0-9]{1,16}-[0-9a-f]{16}$")


# A project is a path in the project tree ("rl", "rl/math", "rl/math/job-42").
PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}(/[a-z0-9][a-z0-9._-]{0,62}){0,7}$")


def parse_image_ref(ref: str) -> tuple[str, str]:
    """Split ``name[:tag]``; the tag defaults to ``latest``."""
    if not IMAGE_REF_RE.match(ref):
        raise ValueError(
            f"invalid image reference {ref!r}: expected name[:tag] with lowercase name "
            "characters [a-z0-9._/-], for example 'busybox:latest'"
        )
    name, _, tag = ref.partition(":")
    return name, tag or "latest"


def check_abs_path(value: str, what: str) -> str:
    if not value.startswith("/") or "\x00" in value or len(value) > 4096:
        raise ValueError(f"{what} must be an absolute path without NUL bytes, got {value!r}")
    return value


# A raw IPv4 rule: address or CIDR, optionally ":" and ports ("10.0.0.0/8:80,443,8000-8100").
NETWORK_IP_RULE_RE = re.compile(r"^[0-9.]{7,15}(/\d{1,2})?(:[0-9,-]{1,100})?$")


def check_network_rules(v: dict[str, bool]) -> dict[str, bool]:
    """Shape only (service names and IPv4 rules); the edge checks them against its
    catalog (dsec.net.catalog)."""
    for key in v:
        if not (LABEL_KEY_RE.match(key) or NETWORK_IP_RULE_RE.match(key)):
            raise ValueError(
                f"invalid network rule {key!r}: use a service name such as 'pypi' or an "
                "IPv4 rule such as '10.1.2.3', '10.0.0.0/8' or '10.1.2.3:443,8000-8100'"
            )
    if len(v) > 256:
        raise ValueError("at most 256 network rules")
    return v
