"""Adversarial suite, operator surfaces: text a sandbox controls must reach the
operator inert.

A hostile agent names files, writes commands and prints output designed for whoever
reads them later: rich markup that crashed ``dsec audit`` (``[/bold]``), markup that
forges a link, ANSI and OSC 8 escape sequences, carriage returns and backspaces that
overwrite what was printed, a bidi override that reorders it, NUL and bytes that are
not UTF-8, and text big enough to drown the screen. Each string is driven through a
real platform into the audit log, the events, a trajectory and the sandbox list, then
shown by the real CLI (a subprocess, as an operator runs it). Every command must
exit 0 without a traceback, show the string as visible escapes, and never let a raw
escape byte through.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.errors import DSecError
from dsec.sdk.client import Sandbox
from tests.conftest import PlatformProcess

pytestmark = pytest.mark.root

# (name, the hostile text, what must never appear raw in the output)
HOSTILE = [
    ("markup", "[/bold] [link=https://evil.example]click[/link] [red]x[/", []),
    (
        "ansi",
        "\x1b[2J\x1b[1;31mFORGED\x1b[0m \x1b]8;;https://evil.example\x07ok\x1b]8;;\x07",
        ["\x1b", "\x07"],
    ),
    ("overwrite", "innocent\rFORGED\x08\x08\x7f", ["\r", "\x08", "\x7f"]),
    ("bidi", "report\u202egnp.exe\u2066x\u2069\u200f", ["\u202e", "\u2066", "\u2069", "\u200f"]),
    ("newline", "one\nerror: forged: line\x85next\u2028sep", ["\x85", "\u2028"]),
]
RAW_NEVER = ["\x1b", "\x07", "\x08", "\x7f", "\r", "\x00", "\u202e", "\u2066", "\u2069", "\x85"]


@dataclass
class Stage:
    platform: PlatformProcess
    client: DSecClient
    sandbox: Sandbox
    job: str
    rollout: str

    def cli(self, *argv: str) -> str:
        """Run the real CLI as an operator would; it must succeed without a traceback
        and print no raw control byte. Returns stdout + stderr."""
        env = {
            "DSEC_URL": self.platform.url,
            "DSEC_API_KEY": self.platform.api_key,
            "PATH": "/usr/bin:/bin",
            "COLUMNS": "400",
        }
        res = subprocess.run(
            [sys.executable, "-m", "dsec.cli.main", *argv],
            env=env,
            capture_output=True,
            timeout=120,
        )
        text = (res.stdout + res.stderr).decode("utf-8", "replace")
        assert res.returncode == 0, (argv, text[-2000:])
        assert "Traceback" not in text, text[-2000:]
        for raw in RAW_NEVER:
            assert raw not in text, (argv, raw, text[-2000:])
        return text


@pytest.fixture
async def stage(
    client: DSecClient, busybox_image: str, platform: PlatformProcess
) -> AsyncIterator[Stage]:
    job = "adv-text-" + secrets.token_hex(4)
    spec = DSecContainerRunArgs(
        container_image=busybox_image,
        memory_limit_mb=64,
        job_id=job,
        labels={"note": "[/bold]\x1b[31mred\u202e"},
    )
    sandbox = await client.run_container(spec)
    try:
        yield Stage(platform, client, sandbox, job, "r-" + secrets.token_hex(4))
    finally:
        with contextlib.suppress(DSecError):
            await sandbox.stop()


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


@pytest.mark.parametrize(("name", "text", "raw"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_text_reaches_the_operator_inert(
    stage: Stage, name: str, text: str, raw: list[str]
) -> None:
    sb = stage.sandbox
    # In the audit log as a command, a file path and a process's output; in the events
    # as a tampered file's name; in the trajectory log as a step's output.
    await sb.run_shell(f"echo {_shell_quote(text)}; true")
    await sb.write_file("/tmp/" + text.replace("/", "_").replace("\x00", ""), b"x")
    file_name = text.replace("/", "_").replace("\x00", "")[:200]
    await sb.run_shell(f"touch /bin/{_shell_quote(file_name)}")
    traj = stage.client.trajectory(stage.job, stage.rollout)
    await traj.run_shell(sb, f"printf '%s' {_shell_quote(text)}")

    audit = stage.cli("audit", "--job", stage.job)
    assert "[/bold]" in audit or name != "markup"  # markup is shown, not parsed
    if "\x1b" in text:  # shown as a visible escape (the detail is JSON: \u001b)
        assert "\\u001b" in audit
    if "\u202e" in text:
        assert "\\u202e" in audit
    stage.cli("audit", "--job", stage.job, "--cursor", "")
    events = ""
    for _ in range(100):  # the tamper event of the touch above
        events = stage.cli("events", "--job", stage.job)
        if "binary_tampering" in events:
            break
    assert "binary_tampering" in events
    show = stage.cli("trajectory", "show", stage.job, stage.rollout)
    assert "exit 0" in show
    stage.cli("trajectory", "show", stage.job)
    listing = stage.cli("sandbox", "ls")
    assert "\\x1b[31mred\\u202e" in listing  # the hostile label, inert


async def test_nul_invalid_utf8_and_huge_text_are_bounded_and_inert(stage: Stage) -> None:
    """NUL (an argv cannot carry it: the command fails, its record must still show),
    bytes that are not UTF-8 in a file name and in output, and 100 kB of text."""
    sb = stage.sandbox
    with contextlib.suppress(DSecError):
        await sb.exec(["echo", "nul\x00byte"])
    await sb.run_shell("touch \"/bin/$(printf 'bad\\377\\376name')\"; printf 'out\\377\\n'")
    huge = "A" * 100_000
    await sb.run_shell(f"echo {huge} > /dev/null")
    traj = stage.client.trajectory(stage.job, stage.rollout)
    await traj.run_shell(sb, "head -c 300000 /dev/zero | tr '\\0' 'B'; printf '\\033[2J\\377'")
    audit = stage.cli("audit", "--job", stage.job, "--limit", "10000")
    assert len(audit) < 400_000  # the 100 kB command is clipped, not printed whole
    events = ""
    for _ in range(100):
        events = stage.cli("events", "--job", stage.job)
        if "bad" in events:
            break
    assert "\\\\xff\\\\xfename" in events or "\\xff\\xfename" in events
    show = stage.cli("trajectory", "show", stage.job, stage.rollout)
    assert len(show) < 10_000  # a step's output is cut to a cell
