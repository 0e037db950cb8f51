"""dsec.linux.proc_stat: the one reader of /proc/PID/stat, which the death watch, the
spawner's reaping, QEMU identity checks and the verify recovery all decide by. A
process names itself (comm), so a sandbox's process can put any text there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dsec import linux

# A name built to look like more fields: "pid (x) Z 1 (y) ..." parsed naively says zombie.
HOSTILE_NAME = "x) Z 1 (y"


def _named_child(name: str) -> subprocess.Popen[bytes]:
    """A child that sets its own comm (prctl PR_SET_NAME, as any process may) and waits."""
    code = (
        "import ctypes, sys, time\n"
        "ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n"
        "print('named', flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"named\n"
    return proc


def test_fields_follow_the_last_paren_whatever_the_process_calls_itself() -> None:
    proc = _named_child(HOSTILE_NAME)
    try:
        st = linux.proc_stat(proc.pid)
        assert st is not None
        assert st.comm == HOSTILE_NAME[:15]  # the kernel keeps 15 bytes
        assert st.state in ("R", "S") and st.ppid == os.getpid() and not st.dead
        assert linux.pid_alive(proc.pid)
        assert st.start_time >= linux.proc_stat(os.getpid()).start_time  # type: ignore[union-attr]
        assert dict(linux.proc_stats())[proc.pid].comm == st.comm
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(100):
            if (now := linux.proc_stat(proc.pid)) is not None and now.stopped:
                break
            time.sleep(0.01)
        assert now is not None and now.stopped
    finally:
        proc.kill()
    for _ in range(100):  # killed, not reaped: a zombie, dead and not alive
        if (st := linux.proc_stat(proc.pid)) is not None and st.dead:
            break
        time.sleep(0.01)
    assert st is not None and st.state == "Z" and not linux.pid_alive(proc.pid)
    proc.wait()
    assert linux.proc_stat(proc.pid) is None  # reaped: gone
