"""The tiny command set an in-memory sandbox runs: deterministic, no processes.

``echo ARGS``, ``true``, ``false``, ``exit N``, ``cat FILE...``, ``pwd``, ``env``;
anything else exits 127 like a shell that cannot find the command. Enough for a
conformance test to tell exit codes, stdout, stderr and file contents apart.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    stdout: str
    stderr: str


def argv_of(command: str | list[str]) -> list[str]:
    """A string command is split like ``sh -c`` would for simple words; a list is argv."""
    return list(command) if isinstance(command, list) else shlex.split(command)


def run(
    argv: list[str], files: Mapping[str, bytes], *, env: Mapping[str, str], workdir: str
) -> Outcome:
    name, args = argv[0], argv[1:]
    if name == "echo":
        return Outcome(0, " ".join(args) + "\n", "")
    if name == "true":
        return Outcome(0, "", "")
    if name == "false":
        return Outcome(1, "", "")
    if name == "exit":
        try:
            return Outcome(int(args[0]) % 256 if args else 0, "", "")
        except ValueError:
            return Outcome(2, "", f"exit: {args[0]}: numeric argument required\n")
    if name == "pwd":
        return Outcome(0, workdir + "\n", "")
    if name == "env":
        return Outcome(0, "".join(f"{k}={v}\n" for k, v in sorted(env.items())), "")
    if name == "cat":
        out, err, code = [], [], 0
        for path in args:
            data = files.get(path)
            if data is None:
                err.append(f"cat: {path}: No such file or directory\n")
                code = 1
            else:
                out.append(data.decode(errors="replace"))
        return Outcome(code, "".join(out), "".join(err))
    return Outcome(127, "", f"{name}: command not found\n")
