"""What a sandbox with egress rules adds to its OCI config."""

from __future__ import annotations

from typing import Any


def net_mounts(net: dict[str, Any] | None) -> list[dict[str, Any]]:
    """/etc/resolv.conf naming the sandbox's gateway (the edge's DNS responder answers
    there; any other server address is redirected to it too)."""
    if not net or not net.get("resolv_conf"):
        return []
    return [
        {
            "destination": "/etc/resolv.conf",
            "type": "bind",
            "source": net["resolv_conf"],
            "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
        }
    ]
