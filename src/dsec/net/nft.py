"""In-process nftables through libnftables (the library behind the `nft` command).

Forking `nft` costs a process start per change (HOST_LIMITS: the CLI path is ~18 ms per
sandbox); one libnftables call parses and commits a whole batch atomically in-process in
well under a millisecond, which keeps rules off the create latency. Debian's
python3-nftables binding is this same ctypes wrapper, but only for the system Python.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from dsec.errors import BackendError


class NftError(BackendError):
    """libnftables refused a batch (the message is nft's own)."""


class Nft:
    """One libnftables context; calls are serialised (a context is not thread-safe)."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise BackendError(
                f"libnftables not found ({exc}); install the Debian package nftables"
            ) from exc
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self._lib = lib
        self._ctx: int | None = lib.nft_ctx_new(0)
        lib.nft_ctx_buffer_output(self._ctx)
        lib.nft_ctx_buffer_error(self._ctx)
        self._lock = threading.Lock()

    def run(self, commands: str) -> str:
        """Run one batch (all or nothing); returns nft's output, raises NftError."""
        with self._lock:
            if self._ctx is None:
                raise NftError("nftables context is closed")
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode())
            out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode()
            err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode()
        if rc != 0:
            raise NftError(f"nftables: {err.strip() or 'failed'}")
        return out

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = None
