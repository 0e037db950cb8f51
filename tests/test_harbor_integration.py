"""The Harbor plug-in (dsec.integrations.harbor) in real Harbor trials, on a real platform.

Harbor needs Python >= 3.12 and the project's venv is 3.11, so each trial runs as
``.venv-harbor/bin/harbor run`` (scripts/install.sh makes that venv): Harbor's own job
and trial loop, our environment and a scripted agent (tests/harbor_agent.py, no LLM)
loaded by import path, the task's verifier script computing the reward. The task also
switches network policies between phases (agent: an allowlist, verifier: no network),
which Harbor applies through the environment's ``update_network``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dsec import DSecSyncClient
from tests.conftest import FakeInternet, PlatformProcess
from tests.harbor_shell import fetch

pytestmark = [pytest.mark.root]

ROOT = Path(__file__).resolve().parent.parent
HARBOR = ROOT / ".venv-harbor" / "bin" / "harbor"

TASK_TOML = """\
schema_version = "1.4"

[agent]
timeout_sec = 60.0

[verifier]
timeout_sec = 60.0
network_mode = "no-network"

[environment]
docker_image = "{image}"
workdir = "/srv/task"
network_mode = "allowlist"
allowed_hosts = ["pypi.org", "{ip}"]
"""

# Reward 1 only for the right answer, and only if the verifier phase really has no
# network (the agent phase could reach pypi.org).
TEST_SH = """\
#!/bin/sh
if {fetch_name} || {fetch_ip}; then
  echo "network still open in the verifier phase"; echo 0 > /logs/verifier/reward.txt; exit 0
fi
if [ "$(cat /srv/task/answer.txt)" = "42" ]; then r=1; else r=0; fi
echo "answer: $(cat /srv/task/answer.txt)"
echo $r > /logs/verifier/reward.txt
"""


def _task(tmp: Path, image: str, ip: str) -> Path:
    task = tmp / "multiply"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "task.toml").write_text(TASK_TOML.format(image=image, ip=ip))
    (task / "instruction.md").write_text("Multiply the numbers in question.txt.\n")
    (task / "environment" / "question.txt").write_text("6 7\n")
    (task / "tests" / "test.sh").write_text(
        TEST_SH.format(fetch_name=fetch("pypi.org"), fetch_ip=fetch(ip))
    )
    (task / "tests" / "test.sh").chmod(0o755)
    return task


def _harbor(
    platform: PlatformProcess, task: Path, jobs: Path, answer: str, ip: str
) -> subprocess.CompletedProcess[str]:
    env = os.environ | {
        "DSEC_URL": platform.url,  # the plug-in's config, as a user's shell would set it
        "DSEC_API_KEY": platform.api_key,
        "HARBOR_TELEMETRY": "0",
        "PYTHONPATH": str(ROOT),  # where the scripted agent's module (tests.harbor_agent) is
        "COLUMNS": "400",  # Harbor's rich console wraps a long error message otherwise
    }
    cmd = [
        str(HARBOR), "run", "-p", str(task), "-o", str(jobs), "-y",
        "--agent", "tests.harbor_agent:ScriptedAgent",
        "--ak", f"answer={answer}", "--ak", f"pypi_ip={ip}",
        "--env", "dsec.integrations.harbor:DSecEnvironment",
        "--ek", 'host_services={"pypi.org": "pypi"}', "--ek", "memory_limit_mb=256",
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _run(
    platform: PlatformProcess, task: Path, jobs: Path, answer: str, ip: str
) -> dict[str, object]:
    """One trial through ``harbor run``; its result.json."""
    proc = _harbor(platform, task, jobs, answer, ip)
    results = [
        json.loads(p.read_text())
        for p in jobs.glob("*/*/result.json")  # <job>/<trial>/result.json
    ]
    assert len(results) == 1, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    result: dict[str, object] = results[0]
    return result


@pytest.mark.skipif(
    not HARBOR.exists(),
    reason="no .venv-harbor: Harbor needs Python 3.12, which scripts/install.sh did not find",
)
def test_a_harbor_trial_runs_on_dsec_and_gets_its_reward(
    platform: PlatformProcess, busybox_image: str, fake_internet: FakeInternet, tmp_path: Path
) -> None:
    ip = fake_internet.pypi.ip
    task = _task(tmp_path, busybox_image, ip)
    with DSecSyncClient(platform.url, platform.api_key) as client:
        before = {s.id for s in client.list_sandboxes()}
        try:
            for answer, reward in (("right", 1.0), ("wrong", 0.0)):
                jobs = tmp_path / f"jobs-{answer}"
                result = _run(platform, task, jobs, answer, ip)
                assert result.get("exception_info") is None, result.get("exception_info")
                verifier = result["verifier_result"]
                assert isinstance(verifier, dict)
                assert verifier["rewards"] == {"reward": reward}, result
                trial = next(jobs.glob("*/*/"))
                # What the agent left in /logs/agent came back through download_dir.
                assert (trial / "agent" / "deep" / "seen").read_text().strip() in ("42", "41")
                assert "answer:" in (trial / "verifier" / "test-stdout.txt").read_text()
            # A task that only has a Dockerfile: refused, typed, before any sandbox.
            (task / "environment" / "Dockerfile").write_text("FROM busybox\n")
            (task / "task.toml").write_text(
                TASK_TOML.replace('docker_image = "{image}"\n', "").format(ip=ip)
            )
            proc = _harbor(platform, task, tmp_path / "jobs-dockerfile", "right", ip)
            out = proc.stdout + proc.stderr
            assert proc.returncode != 0 and "Unsupported" in out, out[-3000:]
            assert "does not build Dockerfiles" in " ".join(out.split()), out[-3000:]
        finally:
            left = [s for s in client.list_sandboxes() if s.id not in before]
            for s in left:
                s.stop()
        assert left == [], f"sandboxes left running: {[s.id for s in left]}"


@pytest.mark.skipif(
    not HARBOR.exists(),
    reason="no .venv-harbor: Harbor needs Python 3.12, which scripts/install.sh did not find",
)
def test_a_start_cancelled_midway_leaves_no_sandbox(
    platform: PlatformProcess, busybox_image: str
) -> None:
    env = os.environ | {"DSEC_URL": platform.url, "DSEC_API_KEY": platform.api_key}
    proc = subprocess.run(
        [str(HARBOR.parent / "python"), "-m", "tests.harbor_lifecycle", busybox_image],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["left"] == [], report
    print(report)  # create_reply_seen: which path stop() took (timing decides)
