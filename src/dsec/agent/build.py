"""Build ``dsec-init``: a static executable, so it runs in any image (no libc needed
inside the sandbox)."""

from __future__ import annotations

from pathlib import Path

from dsec import native
from dsec.native import cache_dir

SOURCE = Path(__file__).with_name("dsec-init.c")
CFLAGS = ["-std=c11", "-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror"]

__all__ = [
    "CFLAGS",
    "SOURCE",
    "agent_binary",
    "cache_dir",
    "source_digest",
    "untrusted_binary",
    "vminit_binary",
    "vminit_source_digest",
]


def source_digest() -> str:
    return native.source_digest(SOURCE)


def agent_binary() -> Path:
    """Path of the compiled agent for the current source, compiling it if needed."""
    return native.binary(
        SOURCE, name="dsec-init", subdir="agent", cflags=CFLAGS, what="the sandbox agent"
    )


UNTRUSTED_SOURCE = Path(__file__).with_name("dsec-untrusted.c")


def untrusted_binary() -> Path:
    """The runner a grader uses for the agent's code inside a verifier
    (dsec-untrusted.c: unprivileged, protected paths hidden by Landlock)."""
    return native.binary(
        UNTRUSTED_SOURCE,
        name="dsec-untrusted",
        subdir="agent",
        cflags=CFLAGS,
        what="the verifier's untrusted-code runner",
    )


VMINIT_SOURCE = Path(__file__).with_name("dsec-vminit.c")


def vminit_source_digest() -> str:
    return native.source_digest(VMINIT_SOURCE)


def vminit_binary() -> Path:
    """The microVM guest's pid 1 (dsec-vminit.c): mounts the sandbox's root from its
    drives, runs the agent channel's guest end and execs the agent."""
    return native.binary(
        VMINIT_SOURCE, name="dsec-vminit", subdir="agent", cflags=CFLAGS, what="the microVM init"
    )
