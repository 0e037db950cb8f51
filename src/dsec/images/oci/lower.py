"""Files of the layers below the one being converted, as overlayfs would find them.

OCI lets a layer hard-link a file that a layer *below* it holds. Our layers are
converted one by one into separate EROFS images, so the converter asks this lookup for
the target and copies it up (dsec.images.difftar). The lower layers are our EROFS
layers, mounted read-only through the host's refcounted ``LayerMounts`` only when such
a link appears (most images have none) and released when the layer is done.

The lookup walks the path top layer first, component by component without following
anything: a whiteout (char 0/0) or a non-directory parent ends the search (the file is
deleted or shadowed), an opaque directory stops it from reaching further down.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
from collections.abc import Iterable, Sequence

from dsec.errors import BackendError
from dsec.images.difftar import OPAQUE_XATTR
from dsec.images.mounts import LayerMounts


class LowerLayers:
    """``lookup`` for write_diff_tree's ``lower``; call ``close`` when done (any thread).

    The converter calls ``lookup`` from its own thread, and an abandoned conversion's
    thread may still be running when the caller closes (a thread cannot be cancelled):
    a lookup after ``close`` raises instead of mounting a layer nobody would release,
    and close never races a lookup that is adding one (the mounts' refcounts stay
    exact, so every layer mount goes when its last user does)."""

    def __init__(
        self, mounts: LayerMounts, digests: Sequence[str], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.mounts = mounts
        self.digests = list(digests)  # bottom first
        self.loop = loop
        self.acquired: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _root(self, digest: str) -> str:
        with self._lock:
            self._check_open()
            root = self.acquired.get(digest)
        if root is not None:
            return root
        # Outside the lock: it waits for the event loop, which may be closing us.
        prepare = self.mounts.prepare([digest], "lazy")
        asyncio.run_coroutine_threadsafe(prepare, self.loop).result()
        with self._lock:
            self._check_open()
            if digest not in self.acquired:
                self.acquired[digest] = os.fspath(self.mounts.acquire(digest))
            return self.acquired[digest]

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the layer conversion was abandoned (its lower layers closed)")

    def lookup(self, parts: list[str]) -> str | None:
        """The host path of the regular file ``parts`` in the layers below, or None."""
        return lookup_in((self._root(d) for d in reversed(self.digests)), parts)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            acquired, self.acquired = self.acquired, {}
        for digest in acquired:
            self.mounts.release(digest)


def lookup_in(roots: Iterable[str], parts: list[str]) -> str | None:
    """The regular file ``parts`` in overlay lower trees ``roots`` (top first; an
    iterable, so a caller can mount each only when the walk reaches it)."""
    for root in roots:
        path = root
        opaque = False
        for i, part in enumerate(parts):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                break
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return None  # deleted here
            if i == len(parts) - 1:
                return path if stat.S_ISREG(st.st_mode) else None
            if not stat.S_ISDIR(st.st_mode):
                return None  # a file or link shadows the directory below
            with contextlib.suppress(OSError):  # no such xattr: not opaque
                opaque = opaque or os.getxattr(path, OPAQUE_XATTR) == b"y"
        if opaque:
            return None
    return None
