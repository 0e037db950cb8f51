"""What every `dsec` command shares: global options, consoles, output and input helpers.

Human output goes through rich; ``--json`` output and command output passed through
from a sandbox are written raw, so scripts can parse them.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console

from dsec.errors import DSecError, InvalidArgument
from dsec.sdk import DSecSyncClient

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


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
    message = " ".join(error.message.split())
    err.print(f"error: {error.code}: {message}", style="red", markup=False, soft_wrap=True)


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
        out.print(text, markup=False)


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
