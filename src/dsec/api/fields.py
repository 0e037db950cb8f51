"""Shapes of the fields many wire models share: names, ids, users, paths, network rules.

Pure checks (no I/O): the SDK runs them before a request leaves the caller, the
servers run them again on what arrives.
"""

from __future__ import annotations

import re

# `name:tag` or `name` (tag defaults to latest); names like registry paths are allowed.
# ``[registry[:port]/]path[:tag][@sha256:<hex>]``: a local name (``busybox:latest``) or
# an OCI registry reference (``127.0.0.1:5000/team/task:v1``, ``ghcr.io/x/y@sha256:..``).
IMAGE_REF_RE = re.compile(
    r"^(?P<name>(?:[a-z0-9][a-z0-9.-]{0,252}(?::[0-9]{1,5})?/)?[a-z0-9][a-z0-9._/-]{0,254})"
    r"(?::(?P<tag>[A-Za-z0-9._-]{1,128}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
# The local tag an image pulled by digest only is stored under.
DIGEST_TAG_PREFIX = "sha256-"


LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


USER_RE = re.compile(r"^([a-z_][a-z0-9_-]{0,31}|\d{1,10}(:\d{1,10})?)$")


# Job, trajectory and rollout ids: safe in URLs, file names and log lines.
TRAJECTORY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


SANDBOX_ID_RE = re.compile(r"^[a-z0-9]{1,16}-[0-9a-f]{16}$")


# A project is a path in the project tree ("rl", "rl/math", "rl/math/job-42").
PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}(/[a-z0-9][a-z0-9._-]{0,62}){0,7}$")


def is_registry_host(component: str) -> bool:
    """Whether the first path component of a reference is a registry host (Docker's
    rule: it has a dot or a port, or is ``localhost``)."""
    return "." in component or ":" in component or component == "localhost"


def names_registry(ref: str) -> bool:
    """True when ``ref`` is a registry reference on its face (a registry host, or a
    digest): such a name may be pulled when it is not here. Plain local names
    (``busybox:latest``, ``debian-python:bookworm``) never are, implicitly. Here, in
    the model, so that the server and the SDK (a Dockerfile's ``FROM``) decide alike."""
    m = IMAGE_REF_RE.match(ref)
    if m is None:
        return False
    first, sep, _ = m["name"].partition("/")
    return bool(sep and is_registry_host(first)) or m["digest"] is not None


def parse_image_ref(ref: str) -> tuple[str, str]:
    """Split ``[registry[:port]/]name[:tag][@sha256:..]`` into the (name, tag) the image is
    stored under here; the tag defaults to ``latest``, and a digest wins over a tag (the
    image is kept under ``sha256-<hex>``: a tag can move, a digest cannot)."""
    m = IMAGE_REF_RE.match(ref)
    if m is None or len(m["name"]) > 128:
        raise ValueError(
            f"invalid image reference {ref!r}: expected [registry[:port]/]name[:tag]"
            "[@sha256:<hex>] with lowercase name characters [a-z0-9._/-], for example "
            "'busybox:latest' or 'registry.example.com:5000/team/task:v1'"
        )
    if m["digest"] is not None:
        return m["name"], DIGEST_TAG_PREFIX + m["digest"].removeprefix("sha256:")
    return m["name"], m["tag"] or "latest"


MAX_ENV_VARS = 1024


def check_env(v: dict[str, str]) -> dict[str, str]:
    """Environment variables anywhere in the API (a run spec, a command, an image
    config, a rollout): POSIX-style names, no NUL (it would end the string in the
    process's environment block), at most MAX_ENV_VARS."""
    for key, val in v.items():
        if not ENV_KEY_RE.match(key):
            raise ValueError(f"invalid environment variable name {key!r}: [A-Za-z_][A-Za-z0-9_]*")
        if "\x00" in val:
            raise ValueError(f"environment variable {key} contains a NUL byte")
    if len(v) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} environment variables")
    return v


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
