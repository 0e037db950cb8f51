"""``.dockerignore`` with Docker's own semantics (moby/patternmatcher), for the builder.

Why not a library: ``pathspec``'s gitwildmatch (the nearest well-kept one) implements
*gitignore*, which differs from Docker where it matters for a build context:

* gitignore matches a pattern without a slash at any depth (``*.log`` hides ``a/b.log``);
  Docker anchors every pattern at the context root (``*.log`` hides only ``b.log``,
  ``**/*.log`` hides both);
* gitignore cannot re-include a file below an excluded directory; Docker can
  (``secrets`` then ``!secrets/public.txt`` keeps that one file);
* a trailing ``/`` means "directories only" to git; Docker cleans it away.

So this is a transcription of patternmatcher's rules (about forty lines):
each line is trimmed, ``#`` lines and blank lines skipped, ``!`` marks an exception,
the pattern is ``path.Clean``-ed and a leading ``/`` dropped. A path is excluded when
the last pattern that matches it (or one of its parent directories, compared on as
many components as the pattern has) is not an exception. ``*`` and ``?`` stop at
``/``, ``**`` spans any number of directories, ``[...]`` is a class (``[!x]`` and
``[^x]`` negate), ``\\`` escapes.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import InvalidArgument, PayloadTooLarge

MAX_IGNORE_BYTES = 1 << 20
MAX_PATTERNS = 10_000


@dataclass(frozen=True)
class _Pattern:
    text: str
    regex: re.Pattern[str]
    exclusion: bool
    depth: int  # path components of the pattern


def _clean(path: str) -> str:
    cleaned = posixpath.normpath(path)
    return "." if cleaned in ("", ".") else cleaned


def _compile(pattern: str) -> re.Pattern[str]:
    out = ["^"]
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        i += 1
        if ch == "*":
            if i < n and pattern[i] == "*":
                i += 1
                if i < n and pattern[i] == "/":
                    i += 1
                out.append(".*" if i >= n else "(.*/)?")
            else:
                out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "\\":
            if i < n:
                out.append(re.escape(pattern[i]))
                i += 1
            else:
                out.append(re.escape("\\"))
        elif ch == "[":
            end = pattern.find("]", i + 1 if i < n and pattern[i] in "!^" else i)
            if end < 0:
                raise InvalidArgument(f".dockerignore: unterminated [ in {pattern!r}")
            body = pattern[i:end]
            neg = body[:1] in ("!", "^")
            body = body[1:] if neg else body
            body = body.replace("\\", "\\\\").replace("[", "\\[")
            out.append(("[^" if neg else "[") + body + "]")
            i = end + 1
        else:
            out.append(re.escape(ch))
    out.append("$")
    try:
        return re.compile("".join(out), re.DOTALL)
    except re.error as exc:
        raise InvalidArgument(f".dockerignore: bad pattern {pattern!r}: {exc}") from None


class IgnoreMatcher:
    """The patterns of one ``.dockerignore``; ``excluded(rel)`` for context paths."""

    def __init__(self, lines: list[str]) -> None:
        self.patterns: list[_Pattern] = []
        for raw in lines:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exclusion = line.startswith("!")
            if exclusion:
                line = line[1:].strip()
            if not line:
                raise InvalidArgument(".dockerignore: an exclusion '!' without a pattern")
            text = _clean(line)
            if len(text) > 1 and text.startswith("/"):
                text = text[1:]
            text = _clean(text)
            self.patterns.append(_Pattern(text, _compile(text), exclusion, len(text.split("/"))))
            if len(self.patterns) > MAX_PATTERNS:
                raise PayloadTooLarge(f".dockerignore has over {MAX_PATTERNS} patterns")
        self.has_exceptions = any(p.exclusion for p in self.patterns)

    @classmethod
    def load(cls, context: Path) -> IgnoreMatcher:
        """The context's ``.dockerignore`` (none: nothing excluded). Not followed
        through a symlink: a context file is data, never a pointer elsewhere."""
        path = context / ".dockerignore"
        if path.is_symlink() or not path.is_file():
            return cls([])
        if path.stat().st_size > MAX_IGNORE_BYTES:
            raise PayloadTooLarge(f".dockerignore is larger than {MAX_IGNORE_BYTES} bytes")
        return cls(path.read_text(errors="replace").splitlines())

    def excluded(self, rel: str) -> bool:
        """Whether the context path ``rel`` (relative, ``/``-separated) is ignored."""
        path = _clean(rel)
        if path == ".":
            return False
        parent = posixpath.dirname(path)
        parent_dirs = parent.split("/") if parent else []
        matched = False
        for p in self.patterns:
            if p.exclusion and not matched:
                continue
            hit = p.regex.match(path) is not None
            if not hit and parent and p.depth <= len(parent_dirs):
                hit = p.regex.match("/".join(parent_dirs[: p.depth])) is not None
            if hit:
                matched = not p.exclusion
        return matched

    def prunable(self, rel_dir: str) -> bool:
        """A directory whose whole subtree is excluded: with no exception pattern
        nothing below can come back, so the walk need not enter it."""
        return not self.has_exceptions and self.excluded(rel_dir)
