"""Turn text a sandbox controls into inert display text, for operators and logs.

A sandbox names its files, processes, DNS queries and commands, and writes its
output; all of that reaches the operator through the CLI and the platform's logs.
Shown as is, it is an attack on the operator: rich markup (``[/bold]`` crashes a
table, ``[link=...]`` forges a link), terminal control sequences (ANSI colours and
cursor moves, OSC 8 hyperlinks, ``\\r`` and backspaces that overwrite what was
printed, a newline that forges a log line) and Unicode bidi overrides that reorder
what is read. So every such string goes through ``inert`` (plain text: each control
or invisible character shown as a visible escape such as ``\\x1b`` or ``\\u202e``,
the length bounded) and, for rich, through ``cell`` (a ``Text``: never parsed as
markup). The escapes are one way: nothing here tries to make text round-trip.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.text import Text

DEFAULT_LIMIT = 4096
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Unicode categories that do not print as themselves: controls, format characters
# (bidi overrides, zero-width marks), surrogates (undecodable bytes), private use,
# unassigned, and the line/paragraph separators.
_INVISIBLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}


class Inert(str):
    """Text already made inert (log records pass it through as it is)."""

    __slots__ = ()


def _escape(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def inert(value: object, limit: int = DEFAULT_LIMIT) -> Inert:
    """``value`` as text that displays as what it is: no control character, escape
    sequence, bidi override or invisible character survives, and at most ``limit``
    characters of the input are shown (the rest is counted)."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) - limit if len(text) > limit else 0
    if cut:
        text = text[:limit]
    if not (text.isascii() and text.isprintable()):
        text = "".join(
            ch
            if (ch.isascii() and ch.isprintable())
            or (not ch.isascii() and unicodedata.category(ch) not in _INVISIBLE)
            else _escape(ch)
            for ch in text
        )
    return Inert(f"{text}... (+{cut} chars)" if cut else text)


def cell(value: object, limit: int = DEFAULT_LIMIT, *, style: str = "") -> Text:
    """A rich table cell or printable: ``inert`` text that rich never parses as markup."""
    from rich.text import Text  # here: server processes need only ``inert``

    return Text(inert(value, limit), style=style)


def cells(*values: object, limit: int = DEFAULT_LIMIT) -> list[Text]:
    return [cell(v, limit) for v in values]


def lines(text: str, limit: int = DEFAULT_LIMIT) -> Inert:
    """Several lines of our own making that embed untrusted text: each line made
    inert, the line breaks kept."""
    return Inert("\n".join(inert(line, limit) for line in text.split("\n")))


def joined(values: Iterable[object], sep: str = ", ", limit: int = DEFAULT_LIMIT) -> str:
    return inert(sep.join(str(v) for v in values), limit)


_installed = False


def _inert_arg(arg: object) -> object:
    if isinstance(arg, int | float | Inert) or arg is None:
        return arg  # numbers format with %d/%f; they carry no text
    return inert(arg)


def escape_log_records(prefix: str = "dsec") -> None:
    """Make every log record of the ``prefix`` loggers inert, structurally: the
    arguments of the message (where sandbox names, paths, commands and error texts end
    up) are escaped when the record is made, so no sandbox can forge a log line or
    send escape sequences to the terminal of whoever reads the log. Idempotent; other
    libraries' records are left alone."""
    global _installed
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name.startswith(prefix):
            if isinstance(record.args, tuple) and record.args:
                record.args = tuple(_inert_arg(a) for a in record.args)
            elif isinstance(record.args, Mapping) and record.args:
                record.args = {k: _inert_arg(v) for k, v in record.args.items()}
            elif not record.args and isinstance(record.msg, str):
                record.msg = inert(record.msg)  # an f-string message
        return record

    logging.setLogRecordFactory(factory)
