"""bench/host_floor.py's holders (issue 19): each really has the kernel objects the bench
says it measures, and none outlives the run, also when the probe itself dies.

The holders run in a child interpreter: ``Holders`` makes its process a subreaper, which
the pytest worker must not become (other tests' orphans would come to it)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import linux

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, cgroups)")

# Makes three holders, reports what each is, then ends them: "close" through the
# probe's own clean-up, "kill" by killing the probe first (its holders die with it and
# are reaped by this process, their subreaper).
_RUN = """
import json, os, signal, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from bench.host_floor import Holders, cgroup_parents
from bench.shrinkers import superblocks

def ns(pid, kind):
    return os.readlink(f"/proc/{{pid}}/ns/{{kind}}")

def look(holders):
    holders.add(3)
    probe = holders.proc.pid
    pids = [int(p) for p in Path(f"/proc/{{probe}}/task/{{probe}}/children").read_text().split()]
    kinds = ("net", "pid", "ipc", "uts", "mnt")
    files = ("memory.limit_in_bytes", "memory.max", "cpu.cfs_quota_us", "cpu.max", "pids.max")
    return {{
        "probe": probe,
        "count": holders.count,
        "holders": [
            {{
                "pid": pid,
                "own": {{k: ns(pid, k) != ns("self", k) for k in kinds}},
                "cgroups": Path(f"/proc/{{pid}}/cgroup").read_text(),
                "superblocks": superblocks(pid),
            }}
            for pid in pids
        ],
        "parents": [str(p) for p in holders.parents],
        "limits": sorted(
            (p / "h0" / f).read_text().strip()
            for p in holders.parents
            for f in files
            if (p / "h0" / f).exists()
        ),
    }}

holders = Holders(Path({binary!r}), cgroup_parents({name!r}))
try:
    report = look(holders)
    print(json.dumps(report), flush=True)
    if {mode!r} == "kill":
        os.kill(holders.proc.pid, signal.SIGKILL)
finally:  # a failure here still ends every holder, and the probe is reaped by us
    holders.close()
"""


@pytest.fixture(scope="module")
def probe_binary() -> Iterator[Path]:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    sys.path.insert(0, str(REPO))
    from bench.probes import static_binary

    out = Path(tempfile.mkdtemp(prefix="dsec-t-holder-", dir="/tmp"))
    try:
        binary = out / "holder_probe"
        binary.write_bytes(static_binary("holder_probe.c", out))
        binary.chmod(0o755)
        yield binary
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_holders(binary: Path, mode: str) -> dict[str, object]:
    name = f"dsec-t-floor-{secrets.token_hex(4)}"
    code = _RUN.format(repo=str(REPO), binary=str(binary), name=name, mode=mode)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, object] = json.loads(done.stdout.splitlines()[0])
    return report


def assert_nothing_left(report: dict[str, object]) -> None:
    holders = report["holders"]
    assert isinstance(holders, list)
    for h in holders:
        st = linux.proc_stat(h["pid"])
        # gone, or (pid reused) some other process: never a holder left as a zombie
        assert st is None or not st.dead, f"holder {h['pid']} left unreaped"
    assert linux.proc_stat(int(str(report["probe"]))) is None
    parents = report["parents"]
    assert isinstance(parents, list)
    for parent in parents:
        assert not Path(parent).exists(), f"{parent} left behind"


@pytest.mark.parametrize("mode", ["close", "kill"])
def test_holders_are_what_the_bench_measures_and_leave_nothing(
    probe_binary: Path, mode: str
) -> None:
    report = run_holders(probe_binary, mode)
    holders = report["holders"]
    assert isinstance(holders, list) and report["count"] == 3 and len(holders) == 3
    for h in holders:
        assert all(h["own"].values()), h["own"]  # net, pid, ipc, uts, mount of its own
        # proc, the /dev tmpfs, devpts and the ipc namespace's mqueue: 4 of its own
        # (mqueue is not mounted, so it is not seen here: 3 under its mounts)
        sb = h["superblocks"]
        assert sb["proc"] >= 1 and sb["devpts"] >= 1 and sb["tmpfs"] >= 1, sb
        assert sb["own_superblocks"] >= 3, sb
        for parent in report["parents"]:  # type: ignore[attr-defined]
            # in a cgroup of its own under each parent (v1: one line per hierarchy)
            rel = "/" + Path(parent).name + "/h"
            assert rel in h["cgroups"], (rel, h["cgroups"])
    # a default 64 MiB sandbox's limits: memory, CPU quota (1 core), pids
    limits = report["limits"]
    assert isinstance(limits, list)
    assert "67108864" in limits and "1024" in limits, limits
    assert "100000" in limits or "100000 100000" in limits, limits
    pids = [h["pid"] for h in holders]
    assert len(set(pids)) == 3
    assert_nothing_left(report)
