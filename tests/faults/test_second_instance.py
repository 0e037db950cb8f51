"""Item 2 of issue 13: one edge per host identity. A second `dsec up` that would share
the data dir or the edge id (hence the cgroup subtree and the nft table) of a live one
refuses in one line and touches nothing: the first one's sandboxes keep running and
answering. A SIGKILLed platform leaves no lock behind: its restart re-adopts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec import DSecContainerRunArgs, DSecSyncClient, SandboxState
from dsec.sdk.sync import SyncSandbox
from tests.conftest import PlatformProcess, platform_process
from tests.faults.helpers import default_platform, scratch_dir, second_up

pytestmark = pytest.mark.root

SPEC = DSecContainerRunArgs(container_image="busybox:latest", memory_limit_mb=64)


@pytest.fixture(scope="module")
def first() -> Iterator[PlatformProcess]:
    with platform_process() as plat:
        with DSecSyncClient(plat.url, plat.api_key) as c:
            c.build_image("busybox")
        yield plat


def _still_serving(client: DSecSyncClient, sb: SyncSandbox, marker: str) -> None:
    assert client.get(sb.id).info.state is SandboxState.RUNNING
    assert sb.run_shell(f"cat /root/{marker}").stdout == f"{marker}\n"


def _refused(code: int, err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert len(lines) == 1, f"expected one line, got: {err}"
    assert lines[0].startswith("error: instance_conflict: "), err
    for word in words:
        assert word in lines[0], err


def test_same_edge_id_other_data_dir_refuses(first: PlatformProcess) -> None:
    with DSecSyncClient(first.url, first.api_key) as client:
        sb = client.run_container(SPEC)
        try:
            sb.run_shell("echo edge > /root/edge")
            with scratch_dir() as other:
                code, err = second_up(other, first.edge_id)
                _refused(code, err, f"edge id {first.edge_id!r}", "--edge-id")
            _still_serving(client, sb, "edge")
        finally:
            sb.stop()


def test_same_data_dir_default_id_refuses(first: PlatformProcess) -> None:
    with DSecSyncClient(first.url, first.api_key) as client:
        sb = client.run_container(SPEC)
        try:
            sb.run_shell("echo dir > /root/dir")
            code, err = second_up(first.data_dir, None)  # the default edge id
            _refused(code, err, f"data dir {first.data_dir}", "--data-dir")
            # ... and with the same data dir *and* the same edge id
            code, err = second_up(first.data_dir, first.edge_id)
            _refused(code, err, f"data dir {first.data_dir}")
            _still_serving(client, sb, "dir")
        finally:
            sb.stop()


def test_default_ids_differ_per_data_dir(first: PlatformProcess) -> None:
    """The failure of the issue: a second `dsec up` on another data dir with the default
    edge id. Now its id is its own, so both run side by side."""
    with DSecSyncClient(first.url, first.api_key) as client:
        sb = client.run_container(SPEC)
        try:
            sb.run_shell("echo side > /root/side")
            with default_platform() as (other, edge_id):
                assert (other.data_dir / "edge_id").read_text().strip() == edge_id
                with DSecSyncClient(other.url, other.api_key) as c2:
                    c2.build_image("busybox")
                    theirs = c2.run_container(SPEC)
                    assert theirs.id.startswith(f"{edge_id}-")
                    assert theirs.run_shell("echo hi").stdout == "hi\n"
                    # and a third instance on *its* data dir refuses too
                    code, err = second_up(other.data_dir, None)
                    _refused(code, err, f"data dir {other.data_dir}")
                    theirs.stop()
            _still_serving(client, sb, "side")
        finally:
            sb.stop()


def test_sigkill_frees_the_locks_and_restart_adopts() -> None:
    with platform_process() as plat:
        with DSecSyncClient(plat.url, plat.api_key) as client:
            client.build_image("busybox")
            sb = client.run_container(SPEC)
            sb.run_shell("echo crash > /root/crash")
        plat.kill()
        plat.start()  # the same data dir and edge id: the kernel released the locks
        with DSecSyncClient(plat.url, plat.api_key) as client:
            again = client.get(sb.id)
            _still_serving(client, again, "crash")
            # the restarted one holds the locks again
            code, err = second_up(plat.data_dir, plat.edge_id)
            _refused(code, err, "data dir")
            again.stop()
