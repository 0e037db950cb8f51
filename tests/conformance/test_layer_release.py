"""A teardown that is cut midway still releases the image layers its sandbox held
(``LayerMounts.release_held`` in a ``finally``), for the backends that hold layers:
the container and microVM backends, through the platform's own root as in the
conformance suite. CI once saw a layer counted as used at close by a sandbox that was
gone (the layer-holder trace); a teardown cancelled or failing before its release step
leaves exactly that."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dsec.api.sandbox import SandboxState
from dsec.api.spec import BackendKind
from tests.conformance.conftest import Harness

pytestmark = pytest.mark.root


# The conformance suite's harness, for the backends that hold layers only.
@pytest.mark.parametrize(
    "harness", [BackendKind.CONTAINER, BackendKind.MICROVM], indirect=True, ids=lambda k: k.value
)
@pytest.mark.parametrize("cut", ["cancelled", "failed"])
async def test_a_teardown_cut_midway_releases_its_layers(
    harness: Harness, cut: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No warm sandbox: it would hold the same layers, and the counts are compared.
    monkeypatch.setenv("DSEC_WARM_POOL", "0")
    edge = await harness.edge()
    sid = (await edge.create(harness.make_spec(), timeout=harness.create_timeout)).id
    rec = edge.find(sid)
    assert rec is not None
    backend: Any = edge.backend_of(rec)
    layers = list(rec.image.layers)
    before = {d: backend.layers.refcount(d) for d in layers}
    assert layers and all(n >= 1 for n in before.values()), before
    real = backend._remove_objects
    started = asyncio.Event()

    async def cut_short(*args: Any) -> None:
        started.set()
        if cut == "failed":
            raise OSError("injected: a step of the teardown failed")
        await asyncio.sleep(3600)  # until cancelled, as a close cancels a teardown

    monkeypatch.setattr(backend, "_remove_objects", cut_short)
    facts = backend.facts(rec)
    task = asyncio.create_task(backend.destroy(rec))
    await started.wait()
    if cut == "cancelled":
        task.cancel()
    with pytest.raises(asyncio.CancelledError if cut == "cancelled" else OSError):
        await task
    assert {d: backend.layers.refcount(d) for d in layers} == {d: n - 1 for d, n in before.items()}
    assert facts.layers_held == []
    # The rest of the teardown is still done by the next try, which releases nothing twice.
    monkeypatch.setattr(backend, "_remove_objects", real)
    await edge.stop(sid)
    assert {d: backend.layers.refcount(d) for d in layers} == {d: n - 1 for d, n in before.items()}


async def test_a_stop_during_the_create_waits_for_it_and_leaves_nothing_held(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop while the sandbox is still CREATING (a named create's id is known before
    it returns) waits for the create to settle, then tears down what it made: the
    record ends STOPPED, the sandbox does not run, and no layer stays held. Torn down
    at once, the stop met facts that held nothing; the create then stored facts that
    held the layers, which nothing released (the layer counted as used at close in CI
    on b9eae9e and 1335cd2; reproduced here with the stop 20 ms into the create)."""
    monkeypatch.setenv("DSEC_WARM_POOL", "0")
    edge = await harness.edge()
    spec = harness.make_spec()
    for delay in (0.0, 0.01, 0.02, 0.05):
        sid = edge.new_sandbox_id()
        creating = asyncio.create_task(
            edge.create_named(spec, timeout=harness.create_timeout, sandbox_id=sid)
        )
        await asyncio.sleep(delay)
        assert (await edge.stop(sid)).state is SandboxState.STOPPED
        assert (await creating).id == sid
        rec = edge.find(sid)
        assert rec is not None and rec.state is SandboxState.STOPPED, delay
        backend: Any = edge.backend_of(rec)
        assert not await backend.still_running(rec)
        held = {d: backend.layers.refcount(d) for d in rec.image.layers}
        assert all(n == 0 for n in held.values()), (delay, held)
