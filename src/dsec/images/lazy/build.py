"""Build ``dsec-lazyfs``. Dynamically linked on purpose: it runs on the host, never in a
sandbox; it links libssl (https:// layer stores: OpenSSL's verified TLS, libssl-dev at
build time) and loads libcrypto's SHA-NI SHA-256 with dlopen when it can (a portable
one is built in)."""

from __future__ import annotations

from pathlib import Path

from dsec import native

SOURCE = Path(__file__).with_name("dsec-lazyfs.c")
CFLAGS = ["-std=gnu11", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror"]
LIBS = ("-lssl", "-lcrypto")


def lazyfs_binary() -> Path:
    """Path of the compiled daemon for the current source, compiling it if needed."""
    return native.binary(
        SOURCE,
        name="dsec-lazyfs",
        subdir="lazyfs",
        cflags=CFLAGS,
        libs=LIBS,
        what="the lazy layer daemon",
    )
