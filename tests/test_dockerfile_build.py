"""Dockerfile builds on the platform's own sandboxes, for real: each RUN in a crun
container with the build's egress rules, each step a layer packed with pack_diff,
a cache keyed by step, and a sandbox started from the result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, ImageBuildError, InvalidArgument
from dsec.sdk.dockerfile import build_dockerfile
from tests.conftest import FakeInternet, PlatformProcess

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for containers"),
]

DOCKERFILE = """\
ARG GREETING=hello
FROM busybox:latest
ARG GREETING
ENV APP_HOME=/srv/app MODE=test
WORKDIR $APP_HOME
COPY app/ ./
COPY run.sh /usr/local/bin/run.sh
RUN echo "$GREETING from $MODE" > greeting.txt \\
    && chmod 0755 /usr/local/bin/run.sh
RUN ["/bin/sh", "-c", "ls /srv/app > listing.txt"]
WORKDIR sub
RUN pwd > /srv/app/where.txt && rm /srv/app/remove-me.txt
LABEL org.example.kind=test
EXPOSE 8080
CMD ["/usr/local/bin/run.sh"]
USER 1000:1000
"""


def _context(root: Path) -> Path:
    ctx = root / "ctx"
    (ctx / "app" / "lib").mkdir(parents=True)
    (ctx / "app" / "main.txt").write_text("main\n")
    (ctx / "app" / "lib" / "util.txt").write_text("util\n")
    (ctx / "app" / "remove-me.txt").write_text("gone soon\n")
    (ctx / "run.sh").write_text("#!/bin/sh\necho running\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    return ctx


async def test_dockerfile_build_cache_and_sandbox(
    client: DSecClient, busybox_image: str, tmp_path: Path
) -> None:
    ctx = _context(tmp_path)
    first = await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfbuild:1")
    assert first.layer_steps == 5 and first.cached_steps < len(first.steps)
    base = await client.get_image(busybox_image)
    assert first.image.layers[: len(base.layers)] == base.layers
    assert len(first.image.layers) == len(base.layers) + 5
    cfg = first.image.config
    assert cfg["workdir"] == "/srv/app/sub" and cfg["cmd"] == ["/usr/local/bin/run.sh"]
    assert cfg["user"] == "1000:1000"
    assert cfg["labels"] == {"org.example.kind": "test"} and cfg["exposed_ports"] == ["8080"]

    args = DSecContainerRunArgs(container_image="dfbuild:1", ttl_running_stop=120)
    async with await client.run_container(args) as sb:
        r = await sb.run_shell(
            'pwd; echo "$MODE $APP_HOME"; cat /srv/app/greeting.txt /srv/app/where.txt; '
            "cat /srv/app/main.txt /srv/app/lib/util.txt; ls /srv/app/remove-me.txt; "
            "/usr/local/bin/run.sh; id -u"
        )
        assert r.stdout.splitlines() == [
            "/srv/app/sub",
            "test /srv/app",
            "hello from test",
            "/srv/app/sub",
            "main",
            "util",
            "running",
            "1000",
        ], r.stderr
        assert "remove-me.txt" in (await sb.read_text("/srv/app/listing.txt"))

    # A rebuild is all cache; a changed context file re-runs its COPY and what follows.
    again = await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfbuild:1")
    assert again.cached_steps == len(again.steps)
    assert again.image.layers == first.image.layers
    (ctx / "run.sh").write_text("#!/bin/sh\necho changed\n")
    changed = await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfbuild:2")
    layer_steps = [s for s in changed.steps if s.layer is not None]
    assert [s.cached for s in layer_steps] == [True, False, False, False, False]
    assert (
        changed.image.layers[: len(base.layers) + 1] == first.image.layers[: len(base.layers) + 1]
    )
    for ref in ("dfbuild:1", "dfbuild:2"):
        await client.remove_image(ref)


async def test_run_egress_follows_the_build_rules(
    client: DSecClient, busybox_image: str, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    """A RUN reaches only what the build allows (busybox nc: the static busybox's wget
    crashes without glibc's NSS modules; an address rule, so no name to resolve)."""
    ip = fake_internet.pypi.ip
    ctx = tmp_path / "net"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        "FROM busybox:latest\n"
        f"RUN printf 'GET /simple/ HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {ip} 80 > /index.html"
        " && grep -q ' 200 ' /index.html\n"
    )
    with pytest.raises(ImageBuildError, match="line 2: RUN exited"):
        await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfnet:1", no_cache=True)
    allowed = await build_dockerfile(
        client, ctx / "Dockerfile", ctx, "dfnet:1", network_rules={f"{ip}:80": True}
    )
    assert allowed.layer_steps == 1
    await client.remove_image("dfnet:1")


async def test_unsupported_instruction_names_its_line(
    client: DSecClient, busybox_image: str, tmp_path: Path
) -> None:
    for text, line, what in (
        ("FROM busybox:latest\nENV A=1\nVOLUME /data\n", 3, "VOLUME is not supported"),
        ("FROM busybox:latest\nONBUILD RUN true\n", 2, "ONBUILD is not supported"),
        ("FROM busybox:latest\nCOPY --from=x /a /b\n", 2, "x:latest not found"),
        ("FROM busybox:latest\nCOPY ../secret /x\n", 2, "outside the build context"),
        ("FROM nope:1\n", 1, "nope:1 not found"),
        ("FROM busybox:latest\nENV my-var=1\n", 2, "invalid environment variable"),
        ("FROM busybox:latest\nENV A=${B:-x}\n", 2, "not supported"),
    ):
        (tmp_path / "Dockerfile").write_text(text)
        with pytest.raises(InvalidArgument, match=f"line {line}: .*{what}"):
            await build_dockerfile(client, tmp_path / "Dockerfile", tmp_path, "dfbad:1")
    with pytest.raises(InvalidArgument, match="not on this platform"):
        await client.compose_image("dfbad:1", ["sha256:" + "0" * 64])


def test_image_build_cli(platform: PlatformProcess, busybox_image: str, tmp_path: Path) -> None:
    ctx = tmp_path / "cli"
    ctx.mkdir()
    (ctx / "hello.txt").write_text("hi\n")
    (ctx / "Dockerfile").write_text("FROM busybox:latest\nCOPY hello.txt /hello.txt\n")
    env = dict(os.environ, DSEC_URL=platform.url, DSEC_API_KEY=platform.api_key)

    def dsec(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "dsec.cli.main", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    built = dsec("image", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "dfcli:1", "--json")
    assert built.returncode == 0, built.stderr
    assert '"dfcli"' in built.stdout and "line 2: COPY" in built.stderr
    (ctx / "Dockerfile").write_text(
        "FROM busybox:latest AS one\nRUN echo one > /stage\n"
        "FROM busybox:latest AS two\nRUN echo two > /stage\n"
    )
    staged = dsec(
        "image", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "dfcli:3", "--target", "one"
    )
    assert staged.returncode == 0 and "line 2: RUN" in staged.stderr, staged.stderr
    assert "line 4: RUN" not in staged.stderr  # stage "two" is not built
    assert dsec("image", "rm", "dfcli:3").returncode == 0
    (ctx / "Dockerfile").write_text("FROM busybox:latest\n" + "# padding\n" * 120_000)
    big = dsec("image", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "dfcli:2")
    assert big.returncode == 1 and "larger than" in big.stderr
    (ctx / "Dockerfile").write_text("FROM busybox:latest\nVOLUME /data\n")
    bad = dsec("image", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "dfcli:2")
    assert bad.returncode == 1 and "line 2: VOLUME is not supported" in bad.stderr
    assert dsec("image", "rm", "dfcli:1").returncode == 0
