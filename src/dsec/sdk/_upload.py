"""Streaming request bodies: a file, a binary file object, or a directory tarred on the fly.

Image archives can be many GiB, so they are never read into memory. A directory is
turned into a tar stream by a thread writing into a pipe, so the upload starts at once
and needs no temporary file. The same reader feeds the sync client directly and the async
client through a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import tarfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from dsec.errors import InvalidArgument

CHUNK = 1024 * 1024

# Called with (bytes sent so far, total bytes or None when unknown).
UploadProgress = Callable[[int, int | None], None]
UploadSource = str | os.PathLike[str] | BinaryIO


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class Upload:
    """A body read in chunks, reporting progress; close() releases what it opened."""

    def __init__(
        self,
        reader: Readable,
        size: int | None,
        *,
        progress: UploadProgress | None = None,
        on_close: Callable[[], None] | None = None,
        chunk_size: int = CHUNK,
    ) -> None:
        self.size = size
        self._reader = reader
        self._progress = progress
        self._on_close = on_close
        self._chunk_size = chunk_size
        self.sent = 0

    def _advance(self, chunk: bytes) -> bytes:
        self.sent += len(chunk)
        if self._progress is not None:
            self._progress(self.sent, self.size)
        return chunk

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self._reader.read(self._chunk_size):
            yield self._advance(chunk)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await asyncio.to_thread(self._reader.read, self._chunk_size):
            yield self._advance(chunk)

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def _size_of(fileobj: BinaryIO) -> int | None:
    """Bytes left to read, if that can be known without reading."""
    try:
        st = os.fstat(fileobj.fileno())
        if stat.S_ISREG(st.st_mode):
            return max(st.st_size - fileobj.tell(), 0)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        if fileobj.seekable():
            here = fileobj.tell()
            end = fileobj.seek(0, os.SEEK_END)
            fileobj.seek(here)
            return max(end - here, 0)
    except (OSError, ValueError, AttributeError):
        pass
    return None


class _TarPipe:
    """A thread writing a directory as a tar stream into a pipe; read() returns the stream.

    Errors of the writer (an unreadable file) are raised by read() at the end of the
    stream, so a truncated archive is never mistaken for a complete one.
    """

    def __init__(self, root: Path) -> None:
        read_fd, write_fd = os.pipe()
        self.reader: BinaryIO = os.fdopen(read_fd, "rb")
        self._writer: BinaryIO = os.fdopen(write_fd, "wb")
        self._root = root
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name="dsec-tar", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            with tarfile.open(fileobj=self._writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in sorted(os.listdir(self._root)):
                    tar.add(self._root / entry, arcname=entry, recursive=True)
        except BrokenPipeError:
            pass  # the reader went away (upload aborted): nothing left to do
        except BaseException as exc:  # reported to the reader, never lost
            self._error = exc
        finally:
            with contextlib.suppress(OSError):
                self._writer.close()

    def read(self, n: int = -1) -> bytes:
        data = self.reader.read(n)
        if not data:
            self._thread.join()
            if self._error is not None:
                raise InvalidArgument(f"cannot archive {self._root}: {self._error}")
        return data

    def close(self) -> None:
        self.reader.close()
        self._thread.join(timeout=10)


def open_upload(
    source: UploadSource, *, progress: UploadProgress | None = None
) -> tuple[Upload, bool]:
    """An Upload of ``source`` and whether it is a directory (sent as a plain tar)."""
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if path.is_dir():
            pipe = _TarPipe(path)
            return Upload(pipe, None, progress=progress, on_close=pipe.close), True
        try:
            fh = path.open("rb")
        except OSError as exc:
            raise InvalidArgument(f"cannot read {path}: {exc.strerror or exc}") from None
        return Upload(fh, _size_of(fh), progress=progress, on_close=fh.close), False
    if not hasattr(source, "read"):
        raise InvalidArgument(
            f"expected a path or a binary file object, got {type(source).__name__}"
        )
    return Upload(source, _size_of(source), progress=progress), False
