"""How a failed VM create ends, the same for the microVM and full-VM backends
(dsec.backends.qemuvm.undo_failed_create): torn down to the end, the failure raised
as it was, and what the guest printed last said in a BackendError, quoted."""

from __future__ import annotations

import asyncio

import pytest

from dsec.backends.qemuvm import last_line, undo_failed_create
from dsec.errors import BackendError, LimitExceeded

# Guest-written: a carriage return that would overwrite the start of the reason on a
# terminal, then escape sequences; the last line is what is said, quoted.
HOSTILE_CONSOLE = "booting\n\n  all good\r\x1b[2K\x1b[31mKernel panic\x1b[0m  \n  \n"


async def _ending(exc: BaseException, console: str, steps: list[str]) -> None:
    async def tail() -> str:
        steps.append("tail")
        return console

    async def teardown() -> None:
        for part in ("qemu", "cgroup", "directory"):
            await asyncio.sleep(0.02)  # each an await a cancellation could cut
            steps.append(part)
        raise OSError("cgroup busy")  # the teardown's own failure is not the news

    await undo_failed_create(exc, tail, teardown)


async def test_a_backend_failure_says_the_consoles_last_line_quoted() -> None:
    steps: list[str] = []
    with pytest.raises(BackendError) as info:
        await _ending(BackendError("the agent did not answer"), HOSTILE_CONSOLE, steps)
    assert steps == ["tail", "qemu", "cgroup", "directory"]
    said = last_line(HOSTILE_CONSOLE)
    assert said == "\x1b[2K\x1b[31mKernel panic\x1b[0m"
    assert (
        info.value.message == f"the agent did not answer; the guest console's last line: {said!r}"
    )
    assert "\x1b" not in info.value.message and "\r" not in info.value.message
    assert isinstance(info.value.__cause__, BackendError)


async def test_other_failures_and_a_silent_console_are_raised_as_they_were() -> None:
    refused = LimitExceeded("too big")
    with pytest.raises(LimitExceeded) as limit:
        await _ending(refused, HOSTILE_CONSOLE, [])
    assert limit.value is refused
    quiet = BackendError("qemu-img failed")
    with pytest.raises(BackendError) as same:
        await _ending(quiet, " \n\n", [])
    assert same.value is quiet


async def test_a_cancel_during_the_undo_waits_for_the_teardown() -> None:
    steps: list[str] = []
    task = asyncio.ensure_future(_ending(asyncio.CancelledError(), "x", steps))
    await asyncio.sleep(0.01)
    task.cancel()  # the client goes away while the create is being undone
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["tail", "qemu", "cgroup", "directory"]
