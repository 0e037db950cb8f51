"""dsec.net.ports: free ports that no outgoing connection can take before the bind."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from dsec.net import ports


def test_a_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_port()
        assert not low <= port <= high
        assert ports.LOWEST <= port <= ports.HIGHEST
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # what the caller's server does next


def test_outgoing_connections_never_draw_a_candidate_port() -> None:
    """The race this module exists for: many outgoing connections at once, none of whose
    source ports is one free_port could have handed out."""
    candidates = set(ports.candidate_ports())
    with socket.create_server(("127.0.0.1", 0), backlog=512) as server:
        address = server.getsockname()
        clients = [socket.create_connection(address) for _ in range(200)]
        try:
            sources = {client.getsockname()[1] for client in clients}
        finally:
            for client in clients:
                client.close()
    assert not sources & candidates


def test_slots_split_the_candidates_without_overlap() -> None:
    slots = [set(ports.candidate_ports(slot, 4)) for slot in range(4)]
    assert set().union(*slots) == set(ports.candidate_ports())
    for i in range(4):
        for j in range(i + 1, 4):
            assert not slots[i] & slots[j]
    assert ports.free_port(slot=2, slots=4) in slots[2]


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(ports, "candidate_ports", lambda slot, slots: [taken, taken + 1])
        monkeypatch.setattr(ports, "_cursor", {})  # a fresh process's cursor:
        monkeypatch.setattr(random, "randrange", lambda n: 0)  # the taken one first
        assert ports.free_port() == taken + 1


def test_every_port_taken_is_a_typed_oserror(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "candidate_ports", lambda slot, slots: [taken])
        with pytest.raises(OSError, match="no free port"):
            ports.free_port()


def test_a_bad_slot_and_an_unreadable_range(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="slot 4"):
        ports.candidate_ports(4, 4)
    assert ports.ephemeral_range(tmp_path / "missing") == (32_768, 60_999)
    odd = tmp_path / "range"
    odd.write_text("40000\t50000\n")
    assert ports.ephemeral_range(odd) == (40_000, 50_000)


def test_picks_in_a_row_differ_even_before_anything_binds() -> None:
    """A caller may pick ports for several servers before starting any of them."""
    picked = [ports.free_port(slot=1, slots=3) for _ in range(200)]
    assert len(set(picked)) == len(picked)
