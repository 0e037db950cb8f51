"""Shell snippets shared by the Harbor test (Python 3.11) and its scripted agent (3.12)."""

from __future__ import annotations

_GET = "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 \"$ip\" 80 | head -n 1 | grep -q ' 200 '"


def fetch(host: str) -> str:
    """GET http://HOST/ with busybox's nslookup and nc (the static busybox's wget crashes
    without glibc's NSS modules in the image); exit 0 for a 200. The sandbox's DNS
    answers only names its egress rules allow."""
    if host[:1].isdigit():
        return f"ip={host} && {_GET}"
    lookup = f"nslookup {host} | awk '/^Address/ {{a=$NF}} END {{print a}}'"
    return f'ip=$({lookup}) && [ -n "$ip" ] && {_GET}'
