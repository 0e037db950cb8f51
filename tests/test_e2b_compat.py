"""The unmodified `e2b` SDK (PyPI, pinned) against our platform (dsec.compat.e2b).

One session platform (tests/conftest.py) and a few busybox sandboxes; every test talks
only through the E2B SDK with E2B_API_URL = E2B_SANDBOX_URL = the platform URL.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

e2b = pytest.importorskip("e2b")

from e2b import (  # noqa: E402  # noqa: E402
    CommandExitException,
    Sandbox,
)

from tests.conftest import PlatformProcess  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def e2b_env(
    platform: PlatformProcess, busybox_image: str, monkeypatch_module: pytest.MonkeyPatch
) -> PlatformProcess:
    monkeypatch_module.setenv("E2B_API_URL", platform.url)
    monkeypatch_module.setenv("E2B_SANDBOX_URL", platform.url)
    monkeypatch_module.setenv("E2B_API_KEY", platform.api_key)
    return platform


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def sbx(e2b_env: PlatformProcess, busybox_image: str) -> Iterator[Sandbox]:
    box = Sandbox.create(busybox_image, metadata={"suite": "e2b"}, envs={"GREETING": "hi"})
    yield box
    box.kill()


def test_commands_foreground_streams_and_exit_codes(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run(
        "echo $GREETING; echo oops >&2; whoami; pwd",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert result.exit_code == 0
    assert result.stdout.split() == ["hi", "user", "/home/user"]
    assert "".join(out).split() == ["hi", "user", "/home/user"]
    assert "oops" in result.stderr and "oops" in "".join(err)
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo bad; exit 3")
    assert info.value.exit_code == 3 and "bad" in info.value.stdout
    assert sbx.commands.run("whoami", user="root").stdout.strip() == "root"


def test_files_roundtrip(sbx: Sandbox) -> None:
    info = sbx.files.write("notes/a.txt", "hello")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("notes/a.txt") == "hello"
    assert sbx.files.read("/home/user/notes/a.txt", format="bytes") == bytearray(b"hello")
    assert sbx.commands.run("cat notes/a.txt").stdout == "hello"
