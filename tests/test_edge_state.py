"""edge.db's runtime column (dsec.edge.state.RuntimeColumn): typed facts, the edge's
network and the data plane's sessions; rows the release before typed facts wrote (one
flat object) still load, so an edge upgraded in place re-adopts its sandboxes."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

from dsec.api.images import ImageInfo
from dsec.api.sandbox import SandboxState
from dsec.api.spec import DSecContainerRunArgs
from dsec.backends.base import SandboxRecord, StoredFacts
from dsec.backends.container.facts import ContainerFacts
from dsec.edge.state import EdgeStateDB
from dsec.security.protected import Prepared

SID = "e1-00112233445566ff"
LAYER = "sha256:" + "1" * 64
# The runtime column of a running sandbox with egress rules, a protected path and an
# open session, exactly as the release before typed facts wrote it.
LEGACY_RUNTIME = (
    '{"dir": "/var/lib/dsec/sandboxes/e1-00112233445566ff", "layers": ["' + LAYER + '"], '
    '"layers_held": ["' + LAYER + '"], "net": {"slot": 3, "ip": "10.213.0.14", '
    '"ifname": "dsv3", "netns": "/run/netns/dsec-e1-3", "resolv_conf": '
    '"/var/lib/dsec/run/net/3.resolv"}, "disk_qgroup": 259, "protected": [{"path": '
    '"/grader", "source": "/var/lib/dsec/sandboxes/e1-00112233445566ff/protected/0", '
    '"decoy": "/var/lib/dsec/sandboxes/e1-00112233445566ff/decoy/0", "digest": null}], '
    '"pid": 48213, "seccomp": "notify", "sessions": {"s0a1b2c3d4e5f6a7b": {"user": '
    '"root", "workdir": "/work", "created_at": "2026-11-30T10:00:00+00:00"}}}'
)
LEGACY_ROW = (
    SID,
    "running",
    '{"backend": "container", "container_image": "busybox:latest"}',
    '{"name": "busybox", "tag": "latest", "digest": "sha256:'
    + "0" * 64
    + '", "layers": ["'
    + LAYER
    + '"], "size_bytes": 1, "created_at": "2026-11-30T09:59:00Z"}',
    "2026-11-30T10:00:00+00:00",
    "2026-11-30T10:00:01+00:00",
    None,
    LEGACY_RUNTIME,
)


def _insert(path: Path, row: tuple[object, ...]) -> None:
    db = EdgeStateDB(path)  # creates the schema
    db.close()
    con = sqlite3.connect(path)
    with con:
        con.execute("INSERT INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
    con.close()


def test_a_row_of_the_release_before_typed_facts_loads(tmp_path: Path) -> None:
    path = tmp_path / "edge.db"
    _insert(path, LEGACY_ROW)
    db = EdgeStateDB(path)
    try:
        (rec,) = db.load("e1")
        assert rec.state is SandboxState.RUNNING and rec.kind.value == "container"
        assert rec.net is not None and rec.net["netns"] == "/run/netns/dsec-e1-3"
        assert rec.sessions["s0a1b2c3d4e5f6a7b"]["workdir"] == "/work"
        # The backend's part, and only it, reaches the backend; typed by it.
        assert isinstance(rec.facts, StoredFacts) and rec.facts.init_pid is None
        assert not {"net", "sessions"} & set(rec.facts.to_json())
        facts = ContainerFacts.from_json(rec.facts.to_json())
        assert facts == ContainerFacts(
            dir=Path("/var/lib/dsec/sandboxes/" + SID),
            layers=[LAYER],
            layers_held=[LAYER],
            disk_qgroup=259,
            pid=48213,
            protected=[
                Prepared(
                    "/grader",
                    f"/var/lib/dsec/sandboxes/{SID}/protected/0",
                    f"/var/lib/dsec/sandboxes/{SID}/decoy/0",
                    None,
                )
            ],
            seccomp="notify",
        )
        assert facts.init_pid == 48213 and facts.upper == Path(
            f"/var/lib/dsec/sandboxes/{SID}/upper"
        )
        # Written back in the new shape, it reads the same.
        rec.facts = facts
        db.save_state(rec)
        (again,) = db.load("e1")
        assert ContainerFacts.of(again.facts) == facts
        assert again.net == rec.net and again.sessions == rec.sessions
    finally:
        db.close()
    column = json.loads(
        sqlite3.connect(path).execute("SELECT runtime FROM sandboxes").fetchone()[0]
    )
    assert set(column) == {"facts", "net", "sessions"}
    # The backend's JSON is what the old release wrote for it, key for key.
    legacy = json.loads(LEGACY_RUNTIME)
    assert column["facts"] == {k: v for k, v in legacy.items() if k not in ("net", "sessions")}


def test_a_creating_row_of_the_old_release_keeps_its_protected_layers_out_of_the_facts(
    tmp_path: Path,
) -> None:
    """While creating, the old edge kept the resolved protected layers in the same
    object; they are the edge's input to create, not a backend fact."""
    path = tmp_path / "edge.db"
    row = (*LEGACY_ROW[:1], "creating", *LEGACY_ROW[2:7], '{"protected_layers": [null]}')
    _insert(path, row)
    db = EdgeStateDB(path)
    try:
        (rec,) = db.load("e1")
        assert rec.state is SandboxState.CREATING
        assert rec.facts.to_json() == {} and rec.net is None and rec.sessions == {}
        assert ContainerFacts.of(rec.facts) == ContainerFacts()
    finally:
        db.close()


def test_a_new_record_round_trips(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    rec = SandboxRecord(
        id=SID,
        spec=DSecContainerRunArgs(container_image="busybox"),
        image=ImageInfo(
            name="busybox", tag="latest", digest="sha256:0", layers=[], size_bytes=0, created_at=now
        ),
        state=SandboxState.CREATING,
        created_at=now,
        updated_at=now,
        edge="e1",
    )
    db = EdgeStateDB(tmp_path / "edge.db")
    try:
        db.save(rec)  # before create returned: no facts yet
        (loaded,) = db.load("e1")
        assert loaded.facts.to_json() == {} and loaded.net is None and loaded.sessions == {}
        rec.facts = ContainerFacts(dir=Path("/d"), layers=[LAYER], pid=9, seccomp="errno")
        rec.net = {"slot": 1}
        rec.state = SandboxState.RUNNING
        db.save_state(rec)
        (loaded,) = db.load("e1")
        assert ContainerFacts.of(loaded.facts) == rec.facts
        assert loaded.net == {"slot": 1} and loaded.state is SandboxState.RUNNING
    finally:
        db.close()
