"""Languages as data: adding one is a new entry here, not a new code path.

Each entry names the source file the code is written to (in /work, the sandbox's
working directory), an optional compile command, and the run command. ``{src}`` and
``{bin}`` are replaced by the file names. A compiled language's judge compiles once and
copies the binary (``artifact``) into each test's fresh sandbox. ``prestart``: the
interpreter is started while the sandbox is built and waits for its program (see
``prestart()`` in zygote.c); such a language gets warm pools of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsec.errors import InvalidArgument


@dataclass(frozen=True)
class Language:
    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    artifact: str | None = None  # what compile produces and run needs
    aliases: tuple[str, ...] = ()
    needs: str = ""  # the image's program it needs (named in errors)
    prestart: bool = False  # interpreter started ahead, reads {src} when a call comes

    def argv(self, cmd: tuple[str, ...]) -> list[str]:
        return [a.format(src=self.source, bin=self.artifact or "") for a in cmd]


LANGUAGES: tuple[Language, ...] = (
    Language(
        "python",
        "main.py",
        ("python3", "-B", "{src}"),
        aliases=("py", "python3"),
        needs="python3",
        prestart=True,
    ),
    Language("bash", "main.sh", ("bash", "{src}"), needs="bash", prestart=True),
    Language("sh", "main.sh", ("sh", "{src}"), aliases=("busybox",), needs="sh", prestart=True),
    Language(
        "c",
        "main.c",
        ("./{bin}",),
        compile=("gcc", "-O2", "-std=gnu17", "-pipe", "-o", "{bin}", "{src}", "-lm"),
        artifact="main",
        needs="gcc",
    ),
    Language(
        "cpp",
        "main.cpp",
        ("./{bin}",),
        compile=("g++", "-O2", "-std=gnu++17", "-pipe", "-o", "{bin}", "{src}"),
        artifact="main",
        aliases=("c++", "cxx"),
        needs="g++",
    ),
    Language(
        "node", "main.js", ("node", "{src}"), aliases=("javascript", "js", "nodejs"), needs="node"
    ),
)

_BY_NAME = {alias: lang for lang in LANGUAGES for alias in (lang.name, *lang.aliases)}


def language(name: str) -> Language:
    """The entry for ``name`` (or an alias); InvalidArgument (422) names the known ones."""
    lang = _BY_NAME.get(name.strip().lower())
    if lang is None:
        known = ", ".join(sorted(lang.name for lang in LANGUAGES))
        raise InvalidArgument(f"unknown language {name!r}; supported: {known}", language=name)
    return lang
