"""Resume prefetch: read a resumed sandbox's swapped-out memory back ahead of use.

A paused sandbox's anonymous memory sits in swap (dsec.rl.jobs, dsec.resources.swap).
Thawed as is, its first command faults every page it touches back in one at a time,
each a synchronous 4 KiB read: the agent, the shell and whatever the command touches
crawl. Instead, at resume the edge asks the kernel to read every swapped page of every
process of the sandbox back at once: ``process_madvise(2)`` with ``MADV_WILLNEED`` over
each process's private writable and shared mappings (anonymous memory and mapped
tmpfs). The kernel queues the reads (swap readahead into the swap cache) and returns;
a page in flight when it is touched is waited for, not read again. Nothing in the
sandbox changes: no page table is written, no limit moved, the processes need not be
stopped. Needs Linux >= 5.10 and CAP_SYS_NICE + ptrace access (the edge is root).

Files in a tmpfs that no process maps (a file written into /dev/shm and closed) are not
prefetched: reaching them would mean following paths the sandbox controls.

What it reads from the sandbox is ``/proc/<pid>/maps``, kernel-written: only the
address and permission columns are used, never a path name (which the sandbox names).
A pid reused between the cgroup listing and the pidfd_open gets a harmless readahead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass

MADV_WILLNEED = 3
SYS_PROCESS_MADVISE = 440  # the same on x86_64 and arm64 (asm-generic)
IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@dataclass(frozen=True)
class Prefetched:
    """What a prefetch asked for: processes reached, bytes of mappings advised."""

    processes: int
    advised_bytes: int
    error: str | None = None


def _ranges(pid: int) -> list[tuple[int, int]]:
    """Private writable and shared mappings of ``pid`` (heap, stacks, anonymous and
    mapped shmem): where swapped pages can be."""
    out: list[tuple[int, int]] = []
    with open(f"/proc/{pid}/maps", "rb") as fh:
        for line in fh:
            fields = line.split(maxsplit=2)
            if len(fields) < 2:
                continue
            perms = fields[1]
            if len(perms) < 4 or not (perms[1:2] == b"w" or perms[3:4] == b"s"):
                continue
            lo, _, hi = fields[0].partition(b"-")
            try:
                start, end = int(lo, 16), int(hi, 16)
            except ValueError:
                continue
            if end > start:
                out.append((start, end - start))
    return out


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def advise(pid: int, ranges: list[tuple[int, int]], advice: int = MADV_WILLNEED) -> int:
    """process_madvise over ``ranges`` of ``pid``; bytes advised. OSError as the kernel
    says (ESRCH: gone; EINVAL: an advice this kernel does not take remotely)."""
    libc = _libc()
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    pidfd = os.pidfd_open(pid)
    done = 0
    try:
        for i in range(0, len(ranges), IOV_MAX):
            chunk = ranges[i : i + IOV_MAX]
            iov = (_Iovec * len(chunk))(*(_Iovec(base, size) for base, size in chunk))
            n = syscall(
                ctypes.c_long(SYS_PROCESS_MADVISE),
                ctypes.c_int(pidfd),
                iov,
                ctypes.c_size_t(len(chunk)),
                ctypes.c_int(advice),
                ctypes.c_uint(0),
            )
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.ENOMEM:  # a range unmapped meanwhile: the rest is done
                    continue
                raise OSError(err, f"process_madvise({pid}): {os.strerror(err)}")
            done += n
    finally:
        os.close(pidfd)
    return done


def swapped_bytes(pid: int) -> int:
    """``VmSwap`` of ``pid`` (0 if unknown or gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmSwap:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def prefetch(pids: Iterable[int], *, swapped: tuple[int, int | None] = (0, None)) -> Prefetched:
    """MADV_WILLNEED over every swappable mapping of ``pids`` (module doc), the
    processes with the least in swap first: the agent and the shells a command needs
    come back before a large heap queues its reads ahead of them (bench_pause: swap-in
    here is bound by the swap device's 4 KiB reads, ~300 MB/s). Processes with nothing
    in swap are skipped; ``swapped`` = (lo, hi): only processes with more than lo and
    at most hi bytes in swap (a resume's first pass: every agent before any heap)."""
    processes, total, error = 0, 0, None
    sized = [(swapped_bytes(pid), pid) for pid in pids]
    lo, hi = swapped
    for _, pid in sorted(s for s in sized if s[0] > lo and (hi is None or s[0] <= hi)):
        try:
            ranges = _ranges(pid)
            total += advise(pid, ranges)
            processes += 1
        except (ProcessLookupError, FileNotFoundError):
            continue  # exited meanwhile
        except OSError as exc:
            error = error or str(exc)
            if exc.errno in (errno.ENOSYS, errno.EINVAL, errno.EPERM):
                break  # this kernel (or this process) cannot: the others cannot either
    return Prefetched(processes, total, error)


def supported() -> bool:
    """Whether this kernel takes a remote MADV_WILLNEED (probed on ourselves)."""
    with contextlib.suppress(OSError):
        advise(os.getpid(), [], MADV_WILLNEED)
        return True
    return False
