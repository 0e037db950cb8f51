"""Dockerfile builds, the rest of Docker's surface, for real (crun sandboxes, pack_diff,
the session platform): multi-stage builds with --target and COPY --from, .dockerignore,
ADD of archives and URLs (through the build's egress rules), --chmod/--chown, globs,
SHELL/ENTRYPOINT/STOPSIGNAL/HEALTHCHECK in the config, and hostile contexts.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

import dsec.sdk.dockerfile as dockerfile
from dsec import DSecClient, DSecContainerRunArgs, ImageBuildError, InvalidArgument
from dsec.errors import PayloadTooLarge
from dsec.sdk.dockerfile import build_dockerfile
from dsec.sdk.dockerignore import IgnoreMatcher
from tests.conftest import FakeInternet

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for containers"),
]

MULTI = """\
ARG BASE=busybox:latest
ARG VERSION=1
FROM ${BASE} AS unused
RUN exit 3
FROM $BASE AS builder
ARG VERSION
RUN mkdir -p /out/sub && echo "v$VERSION" > /out/version && echo lib > /out/sub/lib.txt
FROM builder AS tester
RUN cat /out/version > /tested
FROM busybox:latest
COPY --from=builder /out/version /app/version
COPY --from=1 /out/ /app/out/
COPY --from=busybox:latest /bin/busybox /app/busybox
"""


async def _shell(client: DSecClient, ref: str, script: str) -> list[str]:
    args = DSecContainerRunArgs(container_image=ref, ttl_running_stop=120)
    async with await client.run_container(args) as sb:
        r = await sb.run_shell(script)
        return r.stdout.splitlines()


async def test_multi_stage_target_and_copy_from(
    client: DSecClient, busybox_image: str, tmp_path: Path
) -> None:
    (tmp_path / "Dockerfile").write_text(MULTI)
    df = tmp_path / "Dockerfile"
    first = await build_dockerfile(client, df, tmp_path, "dfms:1")
    assert first.stages_built == [1, 3]  # "unused" (RUN exit 3) and "tester" never ran
    base = await client.get_image(busybox_image)
    assert first.image.layers[: len(base.layers)] == base.layers
    assert len(first.image.layers) == len(base.layers) + 3  # only the final stage's
    out = await _shell(
        client,
        "dfms:1",
        "cat /app/version /app/out/sub/lib.txt; /app/busybox echo bb; "
        "ls /out /tested 2>/dev/null | wc -l",
    )
    assert out == ["v1", "lib", "bb", "0"]

    # --target builds only the stages the target needs; the cache is shared across them.
    tester = await build_dockerfile(client, df, tmp_path, "dfms:t", target="tester")
    assert tester.stages_built == [1, 2]
    builder_steps = [s for s in tester.steps if s.stage == 1 and s.layer is not None]
    assert builder_steps and all(s.cached for s in builder_steps)
    assert await _shell(client, "dfms:t", "cat /tested") == ["v1"]

    # A build arg changes the builder stage, and with it every COPY --from of it.
    again = await build_dockerfile(client, df, tmp_path, "dfms:1")
    assert again.cached_steps == len(again.steps)
    v2 = await build_dockerfile(client, df, tmp_path, "dfms:2", build_args={"VERSION": "2"})
    final = [s for s in v2.steps if s.stage == 3 and s.layer is not None]
    assert [s.cached for s in final] == [False, False, False]  # each chained on the last
    assert (await _shell(client, "dfms:2", "cat /app/version")) == ["v2"]
    with pytest.raises(InvalidArgument, match="build target 'nope' is not a stage"):
        await build_dockerfile(client, df, tmp_path, "dfms:x", target="nope")
    for ref in ("dfms:1", "dfms:t", "dfms:2"):
        await client.remove_image(ref)


def _tar_gz(
    members: dict[str, bytes],
    links: dict[str, str] | None = None,
    hardlinks: dict[str, str] | None = None,
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)
        for name, target in (hardlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.LNKTYPE
            info.linkname = target
            tf.addfile(info)
    return buf.getvalue()


IGNORE = "# comment\n*.secret\n**/*.log\nbuild\n!build/keep.txt\n/root-only.txt\n"
FEATURES = """\
FROM busybox:latest
SHELL ["/bin/sh", "-ec"]
COPY . /ctx/
COPY --chmod=0700 --chown=1000:1000 src/*.py /py/
ADD data.tar.gz /unpacked/
ADD --chmod=0640 plain.txt /plain.txt
RUN echo "$-" > /shell-was
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --retries=3 CMD ["true"]
EXPOSE 8080/tcp
ENTRYPOINT echo hi
"""


async def test_dockerignore_add_chmod_and_config(
    client: DSecClient, busybox_image: str, tmp_path: Path
) -> None:
    ctx = tmp_path / "ctx"
    files = {
        "a.secret": "s",
        "sub/b.secret": "kept: patterns are anchored at the root",
        "x.log": "l",
        "sub/deep/y.log": "l",
        "build/drop.txt": "d",
        "build/keep.txt": "k",
        "root-only.txt": "r",
        "sub/root-only.txt": "kept",
        "src/m1.py": "1",
        "src/m2.py": "2",
        "src/m3.txt": "3",
        "plain.txt": "plain",
    }
    for name, text in files.items():
        (ctx / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx / name).write_text(text)
    (ctx / "data.tar.gz").write_bytes(_tar_gz({"d/inner.txt": b"inner\n"}))
    (ctx / ".dockerignore").write_text(IGNORE)
    (ctx / "Dockerfile").write_text(FEATURES)
    built = await build_dockerfile(client, ctx / "Dockerfile", ctx, "dffeat:1")
    cfg = built.image.config
    assert cfg["shell"] == ["/bin/sh", "-ec"] and cfg["stop_signal"] == "SIGTERM"
    assert cfg["healthcheck"] == {"interval": 30.0, "retries": 3, "test": ["CMD", "true"]}
    assert cfg["entrypoint"] == ["/bin/sh", "-ec", "echo hi"] and cfg["cmd"] is None
    assert cfg["exposed_ports"] == ["8080/tcp"]
    out = await _shell(
        client,
        "dffeat:1",
        "cd /ctx && find . -type f | sort; stat -c '%a %u' /py/m1.py; ls /py; "
        "cat /unpacked/d/inner.txt; stat -c %a /plain.txt; cat /shell-was",
    )
    kept = [
        "./.dockerignore",
        "./Dockerfile",
        "./build/keep.txt",
        "./data.tar.gz",
        "./plain.txt",
        "./src/m1.py",
        "./src/m2.py",
        "./src/m3.txt",
        "./sub/b.secret",
        "./sub/root-only.txt",
    ]
    assert out[:-1] == [*kept, "700 1000", "m1.py", "m2.py", "inner", "640"]
    assert "e" in out[-1]  # RUN went through SHELL ["/bin/sh", "-ec"]
    # An ignored file changes nothing, not even the cache key of `COPY . /ctx/`.
    (ctx / "x.log").write_text("changed")
    (ctx / "build" / "drop.txt").write_text("changed")
    again = await build_dockerfile(client, ctx / "Dockerfile", ctx, "dffeat:1")
    assert again.cached_steps == len(again.steps)
    await client.remove_image("dffeat:1")


def test_dockerignore_semantics() -> None:
    """Docker's rules where gitignore (pathspec) differs: anchoring, re-inclusion."""
    m = IgnoreMatcher(["*.log", "secrets", "!secrets/public.txt", "/a/**/z", "[!x]y"])
    assert m.excluded("x.log") and not m.excluded("d/x.log")
    assert m.excluded("secrets/key") and not m.excluded("secrets/public.txt")
    assert m.excluded("a/z") and m.excluded("a/b/c/z") and m.excluded("a/b/z/file")
    assert m.excluded("ay") and not m.excluded("xy")
    assert not IgnoreMatcher(["!*"]).excluded("anything")
    with pytest.raises(InvalidArgument, match="unterminated"):
        IgnoreMatcher(["[abc"])


async def test_add_url_follows_the_build_egress(
    client: DSecClient, busybox_image: str, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    """ADD <url> is fetched inside a build sandbox: refused without a rule, fetched
    with one (busybox's wget, an address rule so no name to resolve)."""
    ip = fake_internet.pypi.ip
    (tmp_path / "Dockerfile").write_text(
        f"FROM busybox:latest\nADD http://{ip}/simple/dsecdemo/index.html /idx/\n"
    )
    df = tmp_path / "Dockerfile"
    with pytest.raises(ImageBuildError, match=r"line 2: ADD .* failed"):
        await build_dockerfile(client, df, tmp_path, "dfurl:1", no_cache=True)
    ok = await build_dockerfile(client, df, tmp_path, "dfurl:1", network_rules={f"{ip}:80": True})
    assert ok.layer_steps == 1
    out = await _shell(client, "dfurl:1", "stat -c %a /idx/index.html; cat /idx/index.html")
    assert out[0] == "600" and "dsecdemo-1.0" in out[1]
    await client.remove_image("dfurl:1")


async def test_hostile_contexts_and_dockerfiles(
    client: DSecClient,
    busybox_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    ctx = tmp_path / "ctx"
    (ctx / "dir").mkdir(parents=True)
    (ctx / "pw").symlink_to(outside / "secret")
    (ctx / "dir" / "out").symlink_to(outside)
    (ctx / "a.txt").write_text("a")
    (ctx / "b.txt").write_text("b")
    (ctx / "hidden.txt").write_text("h")
    (ctx / ".dockerignore").write_text("hidden.txt\n")
    (ctx / "escape.tar.gz").write_bytes(_tar_gz({"../../evil": b"x"}))
    (ctx / "abslink.tar.gz").write_bytes(_tar_gz({}, links={"l": "/etc/shadow"}))
    (ctx / "bomb.tar.gz").write_bytes(_tar_gz({"zeros": bytes(2 << 20)}))
    (ctx / "dangling.tar.gz").write_bytes(_tar_gz({}, hardlinks={"h": "missing"}))
    (ctx / "hardout.tar.gz").write_bytes(_tar_gz({}, hardlinks={"h": "../../etc/passwd"}))
    cases: list[tuple[str, type[Exception], str]] = [
        ("COPY ../outside/secret /x", InvalidArgument, "outside the build context"),
        ("COPY /../../outside/secret /x", InvalidArgument, "outside the build context"),
        ("COPY pw /x", InvalidArgument, "links outside the build context"),
        ("COPY dir /x/", InvalidArgument, "links outside the build context"),
        ("COPY hidden.txt /x", InvalidArgument, "not in the build context \\(.dockerignore\\)"),
        ("COPY *.txt /x", InvalidArgument, "needs a destination ending in '/'"),
        ("COPY nomatch*.bin /x/", InvalidArgument, "no file in the build context matches"),
        ("COPY --chmod=999 a.txt /x", InvalidArgument, "octal mode"),
        ("COPY --chown=a\\ b a.txt /x", InvalidArgument, "bad --chown"),
        ("COPY --mount=x a.txt /x", InvalidArgument, "--mount is not supported"),
        ("COPY --from=5 /a /b", InvalidArgument, "not an earlier stage"),
        ("COPY --from=busybox:latest /x* /b", InvalidArgument, "wildcards"),
        ("COPY --from=busybox:latest /no/such /b", InvalidArgument, "not in the source"),
        ("ADD file:///etc/passwd /x", InvalidArgument, "only http and https"),
        ("ADD http://127.0.0.1/ /x/", InvalidArgument, "cannot tell a file name"),
        ("ADD escape.tar.gz /x/", InvalidArgument, "archive member refused"),
        ("ADD abslink.tar.gz /x/", InvalidArgument, "archive member refused"),
        ("ADD bomb.tar.gz /x/", PayloadTooLarge, "unpacks to more than"),
        ("ADD dangling.tar.gz /x/", InvalidArgument, "linkname 'missing' not found"),
        ("ADD hardout.tar.gz /x/", InvalidArgument, "archive member refused"),
        ("VOLUME /data", InvalidArgument, "VOLUME is not supported"),
        ("RUN --mount=type=cache,target=/c true", InvalidArgument, "RUN --mount is not"),
        ("STOPSIGNAL SIGFOO", InvalidArgument, "not a signal"),
        ("HEALTHCHECK --interval=soon CMD true", InvalidArgument, "duration"),
        ("HEALTHCHECK --bogus=1 CMD true", InvalidArgument, "--bogus is not supported"),
        ("HEALTHCHECK echo", InvalidArgument, "expected HEALTHCHECK"),
        ("EXPOSE http", InvalidArgument, "not a port"),
        ("SHELL /bin/bash -c", InvalidArgument, "JSON form"),
    ]
    monkeypatch.setattr(dockerfile, "MAX_COPY_BYTES", 1 << 20)
    for text, kind, what in cases:
        (ctx / "Dockerfile").write_text(f"FROM busybox:latest\n{text}\n")
        with pytest.raises(kind, match=f"line 2: .*{what}"):
            await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfhostile:1", no_cache=True)
    (ctx / "Dockerfile").write_text("FROM busybox:latest AS a\nFROM busybox:latest AS a\n")
    with pytest.raises(InvalidArgument, match="line 2: stage name 'a' is used twice"):
        await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfhostile:1")
    (ctx / ".dockerignore").write_text("[bad\n")
    with pytest.raises(InvalidArgument, match="unterminated"):
        await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfhostile:1")
    (ctx / "secret").symlink_to(outside / "secret")
    (ctx / ".dockerignore").unlink()
    (ctx / ".dockerignore").symlink_to(outside / "secret")  # a link: not followed
    (ctx / "Dockerfile").write_text("FROM busybox:latest\nCOPY a.txt /a\n")
    built = await build_dockerfile(client, ctx / "Dockerfile", ctx, "dfhostile:1")
    assert built.layer_steps == 1
    await client.remove_image("dfhostile:1")
