"""Which backends exist, and which of them this host runs.

A table from ``BackendKind`` to the dotted path of the backend's class, imported on
first use (pip's lazy registry pattern): an edge that never runs a backend never
imports it, nor its dependencies, and a backend whose module cannot even be imported
is reported as unavailable instead of breaking the edge. The edge then holds one
instance per enabled kind (``dsec up --backends``; default: every backend whose
``probe`` passes on this host).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dsec.api.spec import BackendKind
from dsec.backends.base import Backend, BackendHost
from dsec.errors import InvalidArgument, Unsupported

log = logging.getLogger(__name__)

# kind -> "module:Class". A new backend is one line here plus its package.
BACKENDS: Mapping[BackendKind, str] = {
    BackendKind.CONTAINER: "dsec.backends.container.backend:ContainerBackend",
    BackendKind.MICROVM: "dsec.backends.microvm.backend:MicroVMBackend",
    BackendKind.FULLVM: "dsec.backends.fullvm.backend:FullVMBackend",
    BackendKind.MEMORY: "dsec.backends.memory.backend:MemoryBackend",
}


@dataclass(frozen=True)
class Selection:
    """The outcome of probing: the kinds to run, and why each other known kind is not
    run (asked for but unavailable is an error, not a row here)."""

    enabled: tuple[BackendKind, ...]
    unavailable: Mapping[BackendKind, str]


class BackendRegistry:
    def __init__(self, table: Mapping[BackendKind, str] = BACKENDS) -> None:
        self._table = dict(table)
        self._loaded: dict[BackendKind, type[Backend]] = {}

    def kinds(self) -> list[BackendKind]:
        """Every kind with a registered backend, in table order."""
        return list(self._table)

    def load(self, kind: BackendKind) -> type[Backend]:
        """The backend class of ``kind``, imported now if it was not yet. Unsupported
        (501, naming the kind) when no backend is registered for it."""
        cls = self._loaded.get(kind)
        if cls is not None:
            return cls
        target = self._table.get(kind)
        if target is None:
            raise Unsupported(f"no backend runs {kind.value} sandboxes", backend=kind.value)
        module_name, _, attr = target.partition(":")
        loaded = getattr(importlib.import_module(module_name), attr)
        if not (isinstance(loaded, type) and issubclass(loaded, Backend)):
            raise TypeError(f"{target} is not a Backend")
        if loaded.kind is not kind:
            raise TypeError(f"{target} runs {loaded.kind.value} sandboxes, not {kind.value}")
        self._loaded[kind] = loaded
        return loaded

    def probe(self, kind: BackendKind) -> str | None:
        """None if ``kind`` can run on this host, else why not (an import that fails
        is a reason too, not a crash)."""
        try:
            cls = self.load(kind)
        except Unsupported as exc:
            return exc.message
        except ImportError as exc:
            return f"cannot import the {kind.value} backend: {exc}"
        return cls.probe()

    def select(self, wanted: Iterable[str] | None = None) -> Selection:
        """The kinds to enable: ``wanted`` (names, e.g. from ``--backends``), each of
        which must be known (InvalidArgument) and able to run here (Unsupported,
        with the probe's reason); or, when None, every registered kind that probes ok."""
        if wanted is None:
            enabled: list[BackendKind] = []
            unavailable: dict[BackendKind, str] = {}
            for kind in self.kinds():
                reason = self.probe(kind)
                if reason is None:
                    enabled.append(kind)
                else:
                    log.warning("backend %s not enabled: %s", kind.value, reason)
                    unavailable[kind] = reason
            return Selection(tuple(enabled), unavailable)
        chosen: list[BackendKind] = []
        for name in wanted:
            try:
                kind = BackendKind(name.strip())
            except ValueError:
                known = ", ".join(k.value for k in self.kinds())
                raise InvalidArgument(
                    f"unknown backend {name.strip()!r} (known: {known})", backend=name
                ) from None
            if kind in chosen:
                continue
            reason = self.probe(kind)
            if reason is not None:
                raise Unsupported(
                    f"backend {kind.value} cannot run on this host: {reason}",
                    backend=kind.value,
                    reason=reason,
                )
            chosen.append(kind)
        if not chosen:
            raise InvalidArgument("at least one backend must be enabled")
        rest = {k: "not enabled (--backends)" for k in self.kinds() if k not in chosen}
        return Selection(tuple(chosen), rest)

    def build(self, selection: Selection, host: BackendHost) -> list[Backend]:
        """One instance per enabled kind."""
        return [self.load(kind).from_host(host) for kind in selection.enabled]
