"""The baseline a sandbox create is compared to: the same path done by hand with raw
`crun run`, on the same host and the same EROFS layer.

One implementation for `dsec demo` (which prints create / raw as a ratio) and the
benchmarks (bench/bench_platform.py), so the figure a user sees and the one the
README quotes are measured the same way. Needs root and the layer's blob file.

Per run: overlay (own upper) on the same mounted EROFS layer, `crun spec`'s default
config (all namespaces, cgroups) with a default 64 MiB sandbox's limits (memory, CPU
quota and weight, pids: oci_spec.sandbox_resources), `crun run` of /bin/true in the
foreground, unmount.
On hybrid-cgroup hosts crun 1.8 needs the v2 controllers hidden; we use the same
wrapper the platform uses, since plain crun cannot run here at all without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Literal

from dsec import linux
from dsec.agent.build import agent_binary
from dsec.api.spec import DSecContainerRunArgs
from dsec.backends.container.oci_spec import sandbox_resources
from dsec.resources import cgroups


def unavailable(layer_blob: Path) -> str | None:
    """Why the baseline cannot run here (not root, no crun, no blob), or None."""
    if os.geteuid() != 0:
        return "needs root (mounts, cgroups)"
    if shutil.which("crun") is None:
        return "no crun on PATH"
    if not layer_blob.is_file():
        return f"layer blob {layer_blob} not found on this host"
    return None


def blob_path(data_dir: Path, digest: str) -> Path:
    """Where a platform with data dir ``data_dir`` keeps layer ``digest``'s EROFS blob."""
    return data_dir / "images" / "blobs" / "sha256" / digest.split(":")[-1]


class RawCrun:
    """``with RawCrun(blob) as raw: raw.measure(n)``: seconds per `crun run`, each on an
    overlay of its own over the one mounted layer; everything removed on exit."""

    def __init__(self, layer_blob: Path, *, limits: Literal["sandbox", "bare"] = "sandbox") -> None:
        """``limits``: "sandbox", a default 64 MiB sandbox's cgroup limits (memory, CPU
        quota and weight, pids, no device; the baseline the create ratio is judged
        against); "bare": memory and pids only, the baseline before 2026-12-05, kept to
        compare with earlier figures."""
        self.layer_blob = layer_blob
        self.limits = limits
        # Its own cgroup parent: a demo and a bench may run at once.
        self.cgroup_parent = f"/dsec-baseline-{secrets.token_hex(4)}"
        self.base = Path(tempfile.mkdtemp(prefix="dsec-rawcrun-", dir="/tmp"))
        self.lower = self.base / "lower"
        self.crun = shutil.which("crun") or "crun"
        self.wrapper = agent_binary()
        self.empty = self.base / "empty"
        self._subreaper = False
        self._detached = 0  # detached runs so far: each its own directory and name

    def __enter__(self) -> RawCrun:
        self.lower.mkdir()
        self.empty.write_bytes(b"")
        linux.mount(self.layer_blob, self.lower, "erofs", linux.MS_RDONLY)
        bundle = self.base / "bundle"
        bundle.mkdir()
        subprocess.run([self.crun, "spec"], cwd=bundle, check=True)
        config = json.loads((bundle / "config.json").read_text())
        config["process"]["terminal"] = False
        config["process"]["args"] = ["/bin/true"]
        config["root"] = {"path": str(self.base / "rootfs"), "readonly": False}
        config["linux"]["cgroupsPath"] = f"{self.cgroup_parent}/raw"
        # The limits of a default 64 MiB sandbox, written by crun as for the platform's
        # ("bare": only its memory and pids limits).
        resources = sandbox_resources(
            DSecContainerRunArgs(container_image="busybox", memory_limit_mb=64),
            host_cpus=os.cpu_count() or 1,
            cpu_idle=False,
        )
        if self.limits == "bare":
            resources = {k: resources[k] for k in ("memory", "pids")}
        config["linux"]["resources"] = resources
        self.config = config
        return self

    def _argv(self, bundle: Path, cid: str) -> list[str]:
        prefix = [str(self.wrapper), "crun-wrap"]
        if cgroups.detect().crun_needs_empty_unified:
            prefix += ["--mask-cgroup2", str(self.empty)]
        return [
            *prefix,
            "--",
            self.crun,
            "--root",
            str(self.base / "state"),
            "run",
            "--bundle",
            str(bundle),
            cid,
        ]

    def _run_dir(self, name: str, args: list[str] | None = None) -> Path:
        """A fresh run directory ``name``: rootfs, upper and work directories and a
        config.json with its own rootfs and cgroup (``args``: another command)."""
        run = self.base / name
        for d in ("rootfs", "upper", "work"):
            (run / d).mkdir(parents=True)
        cfg = dict(self.config)
        if args is not None:
            cfg["process"] = dict(self.config["process"], args=args)
        cfg["root"] = {"path": str(run / "rootfs"), "readonly": False}
        cfg["linux"] = dict(self.config["linux"], cgroupsPath=f"{self.cgroup_parent}/{name}")
        (run / "config.json").write_text(json.dumps(cfg))
        return run

    def _mount_overlay(self, run: Path) -> None:
        """The run's own overlay over the one mounted layer (part of what is timed)."""
        opts = f"lowerdir={self.lower},upperdir={run / 'upper'},workdir={run / 'work'}"
        linux.mount("overlay", run / "rootfs", "overlay", 0, opts)

    def measure(self, n: int, warmup: int = 5) -> list[float]:
        """``n`` timed runs (seconds) after ``warmup`` untimed ones."""
        out = []
        for i in range(n + warmup):
            run = self._run_dir(f"r{i}")
            t = time.perf_counter()
            self._mount_overlay(run)
            subprocess.run(self._argv(run, f"raw{i}"), check=True)
            linux.umount(run / "rootfs")
            elapsed = time.perf_counter() - t
            shutil.rmtree(run)
            if i >= warmup:  # the first runs warm caches
                out.append(elapsed)
        return out

    def measure_detached(self, n: int, warmup: int = 3) -> list[float]:
        """``n`` timed ``crun run --detach`` of an idle ``sleep`` (seconds) after
        ``warmup`` untimed ones; see detached_once."""
        out = []
        for i in range(n + warmup):
            elapsed = self.detached_once()
            if i >= warmup:
                out.append(elapsed)
        return out

    def detached_once(self) -> float:
        """One timed ``crun run --detach`` of an idle ``sleep`` (seconds, overlay mount
        included: create to ready, the figure the issue compares a create with), then
        deleted and unmounted untimed: one round of an interleaved comparison
        (bench/bench_platform.py). The container's init is re-parented to us on
        ``--detach``, so this process becomes a subreaper and reaps exactly that pid
        (never ``waitpid(-1)``: a caller's other children are not ours to collect)."""
        if not self._subreaper:
            linux.become_subreaper()
            self._subreaper = True
        i = self._detached
        self._detached += 1
        run = self._run_dir(f"d{i}", args=["sleep", "3600"])
        cid, pid_file = f"rawd{i}", run / "init.pid"
        argv = self._argv(run, cid)
        argv[argv.index("run") + 1 : argv.index("run") + 1] = [
            "--detach",
            "--pid-file",
            str(pid_file),
        ]
        t = time.perf_counter()
        self._mount_overlay(run)
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
        elapsed = time.perf_counter() - t
        pid = int(pid_file.read_text().strip())
        crun = [self.crun, "--root", str(self.base / "state"), "delete", "--force", cid]
        subprocess.run(crun, check=True, capture_output=True)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        linux.umount(run / "rootfs")
        shutil.rmtree(run)
        return elapsed

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for m in reversed(linux.mounts(self.base)):
            linux.umount(m.mount_point, detach=True)
        cgroups.detect().kill_and_remove(self.cgroup_parent, timeout=2)
        shutil.rmtree(self.base, ignore_errors=True)
