"""The `dsec` CLI against the FakeEdge-backed apiserver: exit codes, output, --json.

``run(argv)`` is the CLI's testable core (``main`` only adds ``sys.exit``).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from dsec.api.images import ImageInfo
from dsec.api.rollouts import RolloutInfo
from dsec.api.sandbox import SandboxInfo, SandboxState
from dsec.apiserver import ApiServices, create_app
from dsec.cli import common as cli_common
from dsec.cli import demo as demo_mod
from dsec.cli import demo_timings
from dsec.cli.common import emit_rows, percentile
from dsec.cli.main import run
from dsec.config import PlatformConfig
from tests.test_apiserver_unit import KEY, FakeEdge, FakeImages, make_keystore
from tests.test_sdk_unit import LiveServer, dead_url

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer(tmp_path_factory.mktemp("cli") / "keys.db").start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def isolated_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DSEC_URL", raising=False)
    monkeypatch.delenv("DSEC_API_KEY", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    # The CLI's consoles read COLUMNS when dsec.cli.common is imported, at collection,
    # before this fixture (a pytest-xdist worker starts with COLUMNS=80): set theirs too.
    for console in (cli_common.out, cli_common.err):
        monkeypatch.setattr(console, "width", 200)


Result = tuple[int, str, str]


@pytest.fixture
def dsec(live: LiveServer, capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    def call(*argv: str, url: str | None = None, key: str = KEY) -> Result:
        code = run(["--url", url or live.url, "--api-key", key, *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return call


def assert_one_line_error(stderr: str, code: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"error: {code}: "), stderr
    assert "Traceback" not in stderr


# ---- sandbox commands ------------------------------------------------------------------


def test_sandbox_lifecycle(dsec: Callable[..., Result], live: LiveServer) -> None:
    code, out, _ = dsec("sandbox", "create", "--image", "busybox")
    assert code == 0
    sid = out.strip()
    assert live.fake.boxes[sid].state is SandboxState.RUNNING

    code, out, err = dsec("sandbox", "exec", sid, "--", "echo", "hello", "world")
    assert (code, out, err) == (0, "hello world\n", "")
    code, out, err = dsec("sandbox", "exec", sid, "exit", "7")
    assert code == 7
    code, out, err = dsec("sandbox", "exec", sid, "nosuchcmd", "-x")
    assert code == 127 and err == "sh: nosuchcmd: not found\n" and out == ""
    code, out, _ = dsec("sandbox", "exec", "-s", "-e", "A=1", sid, "env")
    assert (code, out) == (0, "A=1\n")
    assert live.fake.execs[-1].command == "env"
    code, out, _ = dsec("sandbox", "exec", "--timeout", "5", "--json", sid, "echo", "j")
    assert code == 0 and json.loads(out)["stdout"] == "j\n"
    assert live.fake.execs[-1].timeout == 5

    code, out, _ = dsec("sandbox", "rm", sid)
    assert (code, out.strip()) == (0, sid)
    code, _, err = dsec("sandbox", "exec", sid, "echo")
    assert code == 1
    assert_one_line_error(err, "sandbox_not_running")


def test_exec_stdin(
    dsec: Callable[..., Result], live: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = dsec("sandbox", "create", "--image", "busybox")[1].strip()
    monkeypatch.setattr(sys, "stdin", io.StringIO("piped input"))
    code, out, _ = dsec("sandbox", "exec", "-i", sid, "cat")
    assert (code, out) == (0, "piped input")
    dsec("sandbox", "rm", sid)


def test_create_json_and_options(dsec: Callable[..., Result], live: LiveServer) -> None:
    code, out, _ = dsec(
        "sandbox",
        "create",
        "--image",
        "busybox:latest",
        "--memory",
        "256",
        "--cpus",
        "0.5",
        "--ttl",
        "0",
        "--label",
        "job=cli",
        "--label",
        "rank=1",
        "--env",
        "A=b=c",
        "--user",
        "1000",
        "--workdir",
        "/tmp",
        "--json",
    )
    assert code == 0, out
    info = SandboxInfo.model_validate(json.loads(out))
    spec = info.spec
    assert (spec.memory_limit_mb, spec.cpu_cores_limit, spec.ttl_running_stop) == (256, 0.5, None)
    assert spec.labels == {"job": "cli", "rank": "1"} and spec.env == {"A": "b=c"}
    assert (spec.init_user, spec.workdir) == ("1000", "/tmp")

    code, out, _ = dsec("sandbox", "ls", "--label", "job=cli", "--json")
    assert code == 0 and [s["id"] for s in json.loads(out)] == [info.id]
    code, out, _ = dsec("sandbox", "ls", "--label", "job=cli")
    assert code == 0 and info.id in out and "job=cli" in out

    code, out, _ = dsec("sandbox", "rm", info.id, "--json")
    assert code == 0 and json.loads(out)[0]["state"] == "stopped"
    code, out, _ = dsec("sandbox", "ls", "--label", "job=cli", "--json")
    assert json.loads(out) == []
    code, out, _ = dsec("sandbox", "ls", "--label", "job=cli", "--all", "--json")
    assert [s["id"] for s in json.loads(out)] == [info.id]


def test_rm_continues_past_failures(dsec: Callable[..., Result]) -> None:
    sid = dsec("sandbox", "create", "--image", "busybox")[1].strip()
    code, out, err = dsec("sandbox", "rm", "e0-0000000000000000", sid, "garbage")
    assert code == 1
    assert out.strip() == sid
    assert err.count("error: sandbox_not_found") == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["sandbox", "create"], "--image"),
        (["sandbox", "create", "--image", "busybox", "--memory", "1"], "memory_limit_mb"),
        (["sandbox", "create", "--image", "busybox", "--label", "novalue"], "KEY=VALUE"),
        (["sandbox", "create", "--image", "BAD IMAGE"], "container_image"),
        (["sandbox", "create", "--image", "busybox", "--memory", "lots"], "--memory"),
        (["sandbox", "exec"], "ID"),
        (["image", "build", "centos"], "centos"),
        (["image", "import", "x.tar", "a:b", "--format", "zip"], "zip"),
        (["nosuchcommand"], "nosuchcommand"),
        (["demo", "--count", "0"], "count"),
    ],
)
def test_usage_errors_exit_2(dsec: Callable[..., Result], argv: list[str], needle: str) -> None:
    code, _, err = dsec(*argv)
    assert code == 2, err
    assert needle in err and "Traceback" not in err


def test_typed_errors_exit_1_with_one_line(dsec: Callable[..., Result]) -> None:
    code, out, err = dsec("sandbox", "exec", "e0-0123456789abcdef", "echo")
    assert code == 1 and out == ""
    assert_one_line_error(err, "sandbox_not_found")

    code, _, err = dsec("sandbox", "ls", key="dsk_wrong")
    assert code == 1
    assert_one_line_error(err, "unauthenticated")

    url = dead_url()
    code, _, err = dsec("sandbox", "ls", url=url)
    assert code == 1
    assert_one_line_error(err, "unavailable")
    assert url in err and "dsec up" in err

    code, _, err = dsec("image", "rm", "nothere:1")
    assert code == 1
    assert_one_line_error(err, "image_not_found")


def test_config_from_environment(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DSEC_URL", live.url)
    monkeypatch.setenv("DSEC_API_KEY", KEY)
    assert run(["image", "ls", "--json"]) == 0
    assert "busybox" in capsys.readouterr().out


# ---- image commands --------------------------------------------------------------------


def test_image_commands(dsec: Callable[..., Result], live: LiveServer, tmp_path: Path) -> None:
    archive = tmp_path / "app.tar"
    archive.write_bytes(b"T" * 100_000)
    code, out, _ = dsec("image", "import", str(archive), "team/app:v1", "--format", "tar")
    assert code == 0 and "imported team/app:v1" in out
    assert live.fake.images.imported["team/app:v1"] == archive.read_bytes()

    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("x\n")
    code, out, _ = dsec("image", "import", str(root), "dir:1", "--json")
    assert code == 0 and ImageInfo.model_validate(json.loads(out)).ref == "dir:1"

    code, out, _ = dsec("image", "build", "debian-python")
    assert code == 0 and "built debian-python:bookworm" in out
    code, out, _ = dsec("image", "build", "busybox", "--name", "bb:mine", "--json")
    assert code == 0 and json.loads(out)["tag"] == "mine"

    code, out, _ = dsec("image", "ls", "--json")
    refs = {f"{i['name']}:{i['tag']}" for i in json.loads(out)}
    assert {"team/app:v1", "dir:1", "debian-python:bookworm", "bb:mine"} <= refs
    code, out, _ = dsec("image", "ls")
    assert code == 0 and "team/app:v1" in out

    code, out, _ = dsec("image", "rm", "team/app:v1")
    assert code == 0 and "removed team/app:v1" in out
    code, _, err = dsec("image", "import", str(tmp_path / "missing.tar"), "m:1")
    assert code == 1
    assert_one_line_error(err, "invalid_argument")


# ---- demo ------------------------------------------------------------------------------


def test_demo_against_running_platform(dsec: Callable[..., Result], live: LiveServer) -> None:
    code, out, err = dsec("demo", "--count", "6", "--image", "busybox:latest")
    assert code == 0, out + err
    assert "6/6" in out and "p50" in out and "p99" in out
    assert "uname -a" in out
    # The comparable figures, and a note instead of a raw crun number: the fake
    # platform's layer has no blob on this host.
    for label in ("create, sequential", "exec run_shell", "burst: 6 concurrent creates"):
        assert label in out, out
    assert "raw crun baseline: skipped" in out and "raw crun run," not in out, out
    assert not [b for b in live.fake.boxes.values() if b.state is SandboxState.RUNNING]


def test_demo_raw_baseline_only_on_this_host() -> None:
    assert demo_timings.is_local("http://127.0.0.1:8470")
    assert demo_timings.is_local("http://localhost:1")
    assert not demo_timings.is_local("https://dsec.example.com")
    timings = demo_timings.Timings()
    asyncio.run(
        demo_timings.measure_raw(timings, "http://10.1.2.3:8470", ["sha256:" + "a" * 64], [], 5)
    )
    assert timings.raw_ms == [] and timings.raw_note is not None
    assert "not on this host" in timings.raw_note


def test_demo_builds_missing_image(dsec: Callable[..., Result], live: LiveServer) -> None:
    live.fake.images.images.pop("debian-python:bookworm", None)
    builds = live.fake.images.builds
    code, out, err = dsec("demo", "--count", "3")
    assert code == 0, out + err
    assert live.fake.images.builds == builds + 1
    assert out.count("3.11.2 4242") == 3


def test_demo_fails_when_sandboxes_fail(dsec: Callable[..., Result], live: LiveServer) -> None:
    live.fake.capacity = live.fake._running() + 2
    try:
        code, out, _ = dsec("demo", "--count", "5", "--image", "busybox")
    finally:
        live.fake.capacity = 1000
    assert code == 1
    assert "admission_rejected" in out and "3 failed" in out


def test_demo_unknown_image(dsec: Callable[..., Result]) -> None:
    code, _, err = dsec("demo", "--count", "1", "--image", "nothere:1")
    assert code == 1
    assert_one_line_error(err, "image_not_found")


def serve_fake_platform(port: int, data_dir: Path, key: str) -> None:
    """Stands in for `dsec up` in a subprocess: the FakeEdge app, stopped by SIGTERM."""

    async def main() -> None:
        keys, engine = await make_keystore(data_dir / "keys.db")
        await keys.ensure(key)
        edge = FakeEdge(FakeImages())
        app = create_app(ApiServices(edge=edge, keys=keys, images=edge.images))
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        await uvicorn.Server(config).serve()
        await engine.dispose()

    asyncio.run(main())


def test_demo_starts_and_stops_its_own_platform(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The subprocess lifecycle, with a FakeEdge server standing in for `dsec up`."""
    code_template = (
        "import os, sys; from pathlib import Path; sys.path.insert(0, {repo!r}); "
        "from tests.test_cli_unit import serve_fake_platform; "
        "serve_fake_platform({port}, Path({data_dir!r}), os.environ['DSEC_API_KEY'])"
    )
    made: list[Path] = []

    def command(port: int, data_dir: Path) -> list[str]:
        made.append(data_dir)
        code = code_template.format(repo=str(REPO), port=port, data_dir=str(data_dir))
        return [sys.executable, "-c", code]

    monkeypatch.setattr(demo_mod, "platform_command", command)
    logs_before = set(Path(tempfile.gettempdir()).glob("dsec-demo-*.log"))
    code = run(["--url", dead_url(), "demo", "--count", "3", "--image", "busybox", "--temp-data"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "3/3" in captured.out
    assert made and not made[0].exists(), captured.err

    given = tmp_path / "given"
    code = run(
        [
            "--url",
            dead_url(),
            "demo",
            "--count",
            "1",
            "--image",
            "busybox",
            "--data-dir",
            str(given),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert given.is_dir(), "a given data dir is kept"
    # after a clean stop no platform log is left behind, whatever the data dir
    assert set(Path(tempfile.gettempdir()).glob("dsec-demo-*.log")) <= logs_before


def test_demo_reports_a_platform_that_cannot_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        demo_mod,
        "platform_command",
        lambda port, data_dir: [sys.executable, "-c", "print('no root here'); raise SystemExit(3)"],
    )
    code = run(["--url", dead_url(), "demo", "--count", "1"])
    captured = capsys.readouterr()
    log = re.search(r"log: (\S+dsec-demo-\S+\.log)", captured.err)
    if log is not None:
        Path(log.group(1)).unlink(missing_ok=True)  # kept for the user: named in the error
    assert code == 1
    assert "no root here" in captured.err
    assert_one_line_error(captured.err, "unavailable")
    assert "exited with code 3" in captured.err
    assert log is not None, "the error names the platform's log"


def test_percentile_is_nearest_rank() -> None:
    samples = [float(x) for x in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile([7.0], 99) == 7.0


def test_listing_rows_are_inert_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    """emit_rows, the CLI's one listing printer: a record field a sandbox controls (a
    rollout's error text) neither reaches the terminal as an escape sequence nor starts a
    forged row; --json prints the records unchanged."""
    hostile = "boom\n0000000000000000  finished \x1b[2J\x1b]0;owned\x07"
    info = RolloutInfo.model_validate(
        {"id": "r1", "job_id": "j", "rollout_id": "r1", "state": "failed", "error": hostile,
         "created_at": "2026-12-01T00:00:00Z", "updated_at": "2026-12-01T00:00:00Z",
         "deadline": "2026-12-01T01:00:00Z"}
    )  # fmt: skip
    emit_rows([info, info], lambda r: f"{r.id} {r.error}", False)
    text = capsys.readouterr().out
    assert text.count("\n") == 2 and "\x1b" not in text and "\x07" not in text
    assert "boom\\n0000000000000000" in text and "\\x1b[2J" in text
    emit_rows([info], lambda r: r.id, True)
    assert json.loads(capsys.readouterr().out)[0]["error"] == hostile


# ---- up --------------------------------------------------------------------------------


def test_up_prints_and_saves_the_connection(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    seen: list[PlatformConfig] = []

    async def serve(config: PlatformConfig, *, ready: Any = None) -> None:
        seen.append(config)
        ready(config.url, "dsk_from_platform")

    monkeypatch.setitem(sys.modules, "dsec.roots.platform", types.SimpleNamespace(serve=serve))
    code = run(["up", "--port", "9999", "--data-dir", str(tmp_path / "d"), "--api-key", "k1"])
    out = capsys.readouterr().out
    assert code == 0
    assert seen[0].port == 9999 and seen[0].api_key == "k1"
    assert seen[0].data_dir == tmp_path / "d"
    assert "http://127.0.0.1:9999" in out and "dsk_from_platform" in out
    saved = json.loads((tmp_path / "xdg" / "dsec" / "config.json").read_text())
    assert saved == {"url": "http://127.0.0.1:9999", "api_key": "dsk_from_platform"}

    code = run(["up", "--no-save-config", "--port", "9998"])
    assert code == 0 and seen[1].port == 9998 and seen[1].api_key is None
    saved = json.loads((tmp_path / "xdg" / "dsec" / "config.json").read_text())
    assert saved["url"].endswith(":9999"), "--no-save-config leaves the config alone"


def test_up_prefers_the_blocking_runner(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[str] = []

    async def serve(config: PlatformConfig, *, ready: Any = None) -> None:
        calls.append("serve")

    def run_blocking(config: PlatformConfig, *, ready: Any = None) -> None:
        calls.append("run")
        ready(config.url, "k")

    fake = types.SimpleNamespace(serve=serve, run=run_blocking)
    monkeypatch.setitem(sys.modules, "dsec.roots.platform", fake)
    assert run(["up", "--no-save-config"]) == 0
    assert calls == ["run"]
    assert "http://127.0.0.1:8470" in capsys.readouterr().out


def test_up_without_root_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def serve(config: PlatformConfig, *, ready: Any = None) -> None:
        raise PermissionError("the platform needs root (mounts, cgroups, namespaces)")

    monkeypatch.setitem(sys.modules, "dsec.roots.platform", types.SimpleNamespace(serve=serve))
    assert run(["up"]) == 1
    assert_one_line_error(capsys.readouterr().err, "permission_denied")


def test_entry_point_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("dsec ")
    out = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "--url", dead_url(), "sandbox", "ls"],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_CONFIG_HOME": "/nonexistent"},
    )
    assert out.returncode == 1 and out.stderr.startswith("error: unavailable: ")
