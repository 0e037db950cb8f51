"""A registry blob checked as it arrives: its SHA-256 and size against its descriptor.

Every blob the platform takes from a registry (an image layer or config the puller
downloads, a layer or record the registry layer store fetches) is untrusted until it
hashes to the digest it was asked by; both read it through this one check, and each
says in its own words what a mismatch means for it.
"""

from __future__ import annotations

import hashlib

from dsec.errors import CorruptBlob


class BlobCheck:
    """Feed the bytes to ``update``; ``matches`` says whether they were the blob.
    ``size``: the announced size, if known (more bytes than that fail at once); ``what``
    names the blob in that error."""

    def __init__(self, digest: str, size: int | None = None, what: str = "") -> None:
        self.digest = digest
        self.what = what or f"blob {digest}"
        self.expected = size
        self.size = 0
        self._hash = hashlib.sha256()

    def update(self, data: bytes) -> None:
        self.size += len(data)
        if self.expected is not None and self.size > self.expected:
            raise CorruptBlob(
                f"{self.what} is larger than announced ({self.expected} bytes)",
                digest=self.digest,
            )
        self._hash.update(data)

    @property
    def actual(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def matches(self) -> bool:
        """The bytes hash to the digest (and are as many as announced)."""
        return self.actual == self.digest and self.expected in (None, self.size)
