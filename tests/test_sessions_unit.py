"""Pure pieces of the data path: the session wrapper (against the host's shells), archive
name checks, the wire format, and the agent's new frames, without a platform."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.api.datapath import decode_data, encode_data
from dsec.api.exec import signal_number
from dsec.errors import InvalidArgument
from dsec.sessions import protocol as p
from dsec.sessions.archive import _check_link, safe_member_name
from dsec.sessions.shell import session_argv, state_path

SHELLS = [s for s in ("/bin/sh", "/bin/dash", "/bin/bash", "/bin/busybox") if os.path.exists(s)]


@pytest.mark.parametrize("shell", SHELLS)
def test_session_wrapper_carries_state_in_each_shell(shell: str, tmp_path: Path) -> None:
    sid = "unit" + os.urandom(4).hex()

    def run(command: str, *, save: bool = True) -> subprocess.CompletedProcess[str]:
        argv = session_argv(sid, command, save=save)
        argv = [shell, "sh", *argv[1:]] if shell.endswith("busybox") else [shell, *argv[1:]]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        return subprocess.run(argv, capture_output=True, text=True, env=env, check=False)

    try:
        assert run(f"cd {tmp_path} && export A='x y' && umask 027").returncode == 0
        r = run('pwd; echo "$A"; umask; exit 5')
        assert (r.returncode, r.stdout) == (5, f"{tmp_path}\nx y\n0027\n")
        run("cd /; export A=changed", save=False)  # background commands never write back
        assert run('echo "$A"; pwd').stdout == f"x y\n{tmp_path}\n"
        assert run("if").returncode != 0  # a syntax error is the command's, not ours
        assert run('echo "$A"').stdout == "x y\n"
    finally:
        Path(state_path(sid)).unlink(missing_ok=True)


def test_archive_names_stay_below_the_destination() -> None:
    assert safe_member_name("./a//b/./c") == "a/b/c"
    assert safe_member_name("./") == ""
    for bad in ("../x", "a/../../x", "/etc/passwd", "a/..", "x\x00y"):
        with pytest.raises(InvalidArgument):
            safe_member_name(bad)
    _check_link("a/b", "../c")  # stays inside
    for name, target in (("a", "/etc"), ("a", ".."), ("d/l", "../../x")):
        with pytest.raises(InvalidArgument):
            _check_link(name, target)


def test_wire_helpers() -> None:
    assert decode_data(encode_data(7, 2, b"\x00\xff")) == (7, 2, b"\x00\xff")
    with pytest.raises(ValueError):
        decode_data(b"\x01")
    assert signal_number("SIGINT") == 2 == signal_number("interrupt")
    assert signal_number("term") == 15 and signal_number(9) == 9
    for bad in ("nope", 0, 65):
        with pytest.raises(ValueError):
            signal_number(bad)


def test_agent_frames_round_trip() -> None:
    req = p.ExecRequest(
        argv=["sh"], env={}, cwd="/", user="root", timeout_ms=0, max_output=1,
        with_stdin=True, pty=(24, 80),
    )  # fmt: skip
    frame = p.encode_exec(req)
    assert frame.endswith(p.pack_u32(24) + p.pack_u32(80))
    assert p.encode_resize(30, 100)[0] == p.T_RESIZE
    with pytest.raises(ValueError):
        p.encode_resize(0, 10)
    head = p.encode_fs(p.FS_MOVE, "/a", user="root", path2="/b")
    assert head[0] == p.OP_FS
    records = b"".join(
        p.pack_u32(mode) + p.pack_u32(0) + p.pack_u32(0) + p.pack_u64(size)
        + p.pack_u64(5) + p.pack_str(name) + p.pack_str(target)
        for mode, size, name, target in ((0o100644, 3, "f", ""), (0o120777, 1, "l", "f"))
    )  # fmt: skip
    entries = p.decode_entries(records)
    assert [(e.name, e.size, e.target) for e in entries] == [("f", 3, ""), ("l", 1, "f")]
    with pytest.raises(p.ProtocolError):
        p.decode_entries(records[:-1])


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_agent_compiles_with_strict_flags(tmp_path: Path) -> None:
    from dsec.agent.build import SOURCE

    out = subprocess.run(
        ["gcc", "-std=c11", "-static", "-Os", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
         str(SOURCE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
