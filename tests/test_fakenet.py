"""The fake services' addresses (tests.fakenet): what keeps two test workers' fake
internets apart on one host."""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.fakenet import candidate_octets, fake_service, octets_on_host, service_octet

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]


def test_octets_held_at_once_are_distinct_and_come_back() -> None:
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(service_octet()) for _ in range(20)]
        assert len(set(held)) == 20 and all(1 <= o <= 255 for o in held)
    with service_octet() as again:  # released: usable again (by this or another run)
        assert 1 <= again <= 255


def test_an_octet_a_host_address_uses_is_never_handed_out() -> None:
    """The lock is one guard; an address on the host is the other (a holder that is
    not a test of ours, or a dead run's leftover): such an octet is not a candidate."""
    with service_octet() as octet, fake_service("x", octet, 0):
        assert octet in octets_on_host()
        assert octet not in candidate_octets()
