"""crun's hand-over of a sandbox's notify fd to the seccomp listener (issue 19).

A 10,000-sandbox run at load 16 lost creates to the listener's blocking 2 s read of
each connection: a crun stalled between connect and send timed out, and while the
thread waited no sandbox's notification was answered. Each connection is now read as
it becomes readable; these drive the real listener over its real socket."""

from __future__ import annotations

import array
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.security import seccomp_listener
from dsec.security.audit import NullAudit
from dsec.security.seccomp_listener import SeccompListener


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[SeccompListener]:
    lst = SeccompListener(tmp_path / "s.sock", NullAudit())
    lst.start()
    try:
        yield lst
    finally:
        lst.close()


def _wait(pred: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def _connect(lst: SeccompListener) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(lst.socket_path))
    return s


# A pipe's read end stands in for a notify fd; its write end is kept open for the
# test's length (a closed one reads as the sandbox's end: EPOLLHUP).
KEPT: list[int] = []


@pytest.fixture(autouse=True)
def _close_kept() -> Iterator[None]:
    yield
    while KEPT:
        os.close(KEPT.pop())


def _stand_in() -> int:
    r, w = os.pipe()
    KEPT.append(w)
    return r


def _send(s: socket.socket, sandbox_id: str, *, with_fd: bool = True) -> None:
    msg = json.dumps({"metadata": sandbox_id}).encode()
    r = _stand_in()
    try:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))] if with_fd else []
        s.sendmsg([msg], anc)
    finally:
        os.close(r)


def _fds() -> list[str]:
    """This process's fds by what they are, but /dev/null: the listener's reserved slot,
    which moves to another number each time it is spent and taken back."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            what = os.readlink(f"/proc/self/fd/{name}")
            if what != "/dev/null":
                out.append(f"{name}->{what}")
        except OSError:
            pass
    return sorted(out)


def test_a_stalled_crun_holds_up_nobody(listener: SeccompListener) -> None:
    """A connection that sends nothing (past the old 2 s timeout) does not delay the
    next sandbox's hand-over, and is itself taken when it finally sends."""
    slow = _connect(listener)
    try:
        time.sleep(0.1)
        fast = _connect(listener)
        _send(fast, "sb-fast")
        fast.close()
        t = time.monotonic()
        assert _wait(lambda: listener.attached("sb-fast"), 2.0)
        assert time.monotonic() - t < 1.0
        time.sleep(2.2)  # longer than the blocking read used to wait
        _send(slow, "sb-slow")
    finally:
        slow.close()
    assert _wait(lambda: listener.attached("sb-slow"))
    assert listener.alive()


def test_a_message_in_pieces_is_put_together(listener: SeccompListener) -> None:
    s = _connect(listener)
    try:
        body = json.dumps({"metadata": "sb-pieces", "ociVersion": "1.0.2"}).encode()
        r = _stand_in()
        try:
            s.sendmsg([body[:7]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
        finally:
            os.close(r)
        time.sleep(0.2)
        assert not listener.attached("sb-pieces")
        s.sendall(body[7:])
    finally:
        s.close()
    assert _wait(lambda: listener.attached("sb-pieces"))


def test_connections_that_bring_no_fd_or_go_quiet_leak_nothing(
    listener: SeccompListener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No fd, garbage, a hang-up half way, a connection that never sends (dropped at
    its deadline): none is adopted, none leaves an fd behind, the listener lives."""
    monkeypatch.setattr(seccomp_listener, "HANDOFF_TIMEOUT", 0.5)
    warm = _connect(listener)  # the thread has its epoll set once this one is taken
    _send(warm, "sb-warm")
    warm.close()
    assert _wait(lambda: listener.attached("sb-warm"))
    before, kept = set(_fds()), len(KEPT)
    no_fd = _connect(listener)
    _send(no_fd, "sb-nofd", with_fd=False)
    no_fd.close()
    garbage = _connect(listener)
    garbage.sendall(b"\xff\x00 not json {")
    garbage.close()
    half = _connect(listener)
    half.sendall(b'{"metadata": "sb-ha')
    half.close()
    quiet = [_connect(listener) for _ in range(5)]
    try:
        # the quiet ones are dropped at their deadline: the listener closes its end
        for q in quiet:
            q.settimeout(5.0)
            assert q.recv(1) == b""
    finally:
        for q in quiet:
            q.close()
    ok = _connect(listener)
    _send(ok, "sb-after")
    ok.close()
    assert _wait(lambda: listener.attached("sb-after"))
    assert not listener.attached("sb-nofd") and not listener.attached("sb-ha")
    # what stays open: the one adopted notify fd, and the write ends the test keeps
    assert _wait(lambda: len(set(_fds()) - before) == 1 + len(KEPT) - kept), set(_fds()) - before
    assert listener.alive()


def test_many_concurrent_handoffs(listener: SeccompListener) -> None:
    """A burst of connections open at once, each sending late and in any order."""
    conns = [(_connect(listener), f"sb-burst-{i}") for i in range(64)]
    for s, sid in reversed(conns):
        _send(s, sid)
        s.close()
    assert _wait(lambda: all(listener.attached(sid) for _, sid in conns))
    assert listener.open_fds() == 64
