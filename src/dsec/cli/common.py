"""What every `dsec` command shares: global options, consoles, output and input helpers.

Human output goes through rich; ``--json`` output and command output passed through
from a sandbox are written raw, so scripts can parse them.

Much of what the CLI shows is controlled by a sandbox (paths, commands, process and
DNS names, error texts), so the consoles are safe by construction: they never parse
markup or emoji codes, and every string they render goes through
``dsec.security.safe_text`` (control characters and escape sequences shown as
``\x1b``...). Untrusted table cells use ``cells()``, which escapes line breaks too.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.text import Text

from dsec.errors import DSecError, InvalidArgument
from dsec.sdk import DSecSyncClient
from dsec.security.safe_text import cell, cells, inert, lines

__all__ = ["cell", "cells", "err", "inert", "out"]


class SafeConsole(Console):
    """A rich console that cannot be steered by the text it prints: no markup, no
    emoji codes, no highlighting, and every string made inert (line breaks kept, so
    our own multi-line messages still work; untrusted cells escape them via ``cell``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=False, emoji=False, highlight=False, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        kwargs["markup"] = False
        kwargs["emoji"] = False
        return super().render_str(lines(text), **kwargs)


out = SafeConsole()
err = SafeConsole(stderr=True)


@dataclass(frozen=True)
class Globals:
    """The global options (``dsec --url U --api-key K <command>``)."""

    url: str | None = None
    api_key: str | None = None


def globals_of(ctx: typer.Context) -> Globals:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Globals) else Globals()


def sync_client(ctx: typer.Context, *, timeout: float | None = 60.0) -> DSecSyncClient:
    g = globals_of(ctx)
    return DSecSyncClient(g.url, g.api_key, timeout=timeout)


class UsageFailure(Exception):
    """Bad command-line input found after parsing (e.g. a spec the model refuses): exit 2."""

    def __init__(self, error: DSecError) -> None:
        super().__init__(error.message)
        self.error = error


def usage_from(exc: ValidationError) -> UsageFailure:
    parts = [
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: "
        + str(e["msg"]).removeprefix("Value error, ")
        for e in exc.errors()[:5]
    ]
    return UsageFailure(InvalidArgument("; ".join(parts)))


def print_error(error: DSecError) -> None:
    """The one-line form of every typed error: ``error: <code>: <message>``."""
    message = inert(" ".join(error.message.split()))  # may quote a sandbox's path
    err.print(f"error: {error.code}: {message}", style="red", markup=False, soft_wrap=True)


#: The --port help of every server command (dsec.net.ports.listen binds port 0).
ANY_PORT_HELP = "0: any free port (the one chosen is printed)"


@contextlib.contextmanager
def serving(what: str) -> Iterator[None]:
    """Around a server process's blocking run (`dsec up`, `dsec edge`, `dsec
    apiserver`, `dsec store serve`): Ctrl-C exits 130, and what stops it from starting
    (a port in use, an address this host lacks: dsec.net.ports.listen) is an error in
    words, not a traceback. A PermissionError goes on to the CLI's own handler (exit 1)."""
    try:
        yield
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except PermissionError:
        raise
    except OSError as exc:
        raise DSecError(f"cannot start {what}: {exc}") from None


def parse_pairs(values: Sequence[str], option: str) -> dict[str, str]:
    """``["k=v", ...]`` from a repeatable option; a malformed pair is a usage error."""
    pairs: dict[str, str] = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {value!r}", param_hint=option)
        pairs[key] = val
    return pairs


def to_jsonable(value: BaseModel | Iterable[BaseModel]) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return [item.model_dump(mode="json") for item in value]


def emit_json(value: BaseModel | Iterable[BaseModel]) -> None:
    sys.stdout.write(json.dumps(to_jsonable(value), indent=2) + "\n")
    sys.stdout.flush()


def emit(value: BaseModel, text: str, as_json: bool) -> None:
    """One result: the model as JSON with --json, else one plain line for people."""
    if as_json:
        emit_json(value)
    else:
        out.print(lines(text), markup=False)


M = TypeVar("M", bound=BaseModel)


def emit_rows(items: Sequence[M], row: Callable[[M], str], as_json: bool) -> None:
    """A listing: the models as one JSON array with --json, else one line per item.

    The one printer for record listings (rollouts, projects, principals, keys): names,
    error texts and other fields in a row may come from a sandbox or a caller, so each
    row is printed as a ``cell`` (inert, line breaks escaped): it can neither steer the
    terminal nor forge a second row."""
    if as_json:
        emit_json(items)
        return
    for item in items:
        out.print(cell(row(item)))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def percentile(samples: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation): a value that was actually measured."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]
