"""Rewrite imports of the old wire modules to dsec.api (issue 14, for merging branches).

Before issue 14 the wire models lived in dsec.model, dsec.wire, dsec.*_model,
dsec.rl.model, dsec.cluster.model and dsec.security.events; they now live in dsec.api
(modules by topic). A branch written against the old layout can be brought over with

    .venv/bin/python scripts/rewrite_wire_imports.py src tests bench
    .venv/bin/ruff check --fix src tests bench && .venv/bin/ruff format src tests bench

Each ``from <old module> import a, b`` becomes one import per new home, found by
reading dsec/api (plus the few non-wire helpers that moved elsewhere, listed below).
Trailing comments of a rewritten single-line import (``# noqa: E402``) are kept.
Delete this script once no branch needs it.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

API = pathlib.Path(__file__).resolve().parent.parent / "src" / "dsec" / "api"
OLD = {
    "dsec.model",
    "dsec.wire",
    "dsec.batch_model",
    "dsec.fncall_model",
    "dsec.iam_model",
    "dsec.layer_model",
    "dsec.protected_model",
    "dsec.rl_model",
    "dsec.verify_model",
    "dsec.rl.model",
    "dsec.cluster.model",
    "dsec.security.events",
}
# Helpers with behaviour that went to the package using them, not to dsec.api.
MOVED = {
    ("dsec.protected_model", "redact_files"): "dsec.security.protected",
    ("dsec.protected_model", "protected_summary"): "dsec.security.protected",
    ("dsec.verify_model", "resolve_graded"): "dsec.security.graded_paths",
    ("dsec.verify_model", "collapse_graded"): "dsec.security.graded_paths",
    ("dsec.verify_model", "overlaps"): "dsec.security.graded_paths",
    ("dsec.security.events", "DEFAULT_SEVERITY"): "dsec.security.audit",
}
RENAMED = {"_check_abs_path": "check_abs_path"}  # dsec.model -> dsec.api.fields


def _top_level_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.ClassDef | ast.FunctionDef):
        return [node.name]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    names: list[str] = []
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Name):
                names.append(target.id)
            elif isinstance(target, ast.Tuple):
                names += [e.id for e in target.elts if isinstance(e, ast.Name)]
    return names


def homes() -> dict[str, str]:
    where: dict[str, str] = {}
    for path in sorted(API.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            for name in _top_level_names(node):
                where.setdefault(name, f"dsec.api.{path.stem}")
    return where


def home(where: dict[str, str], old: str, name: str) -> str:
    if (old, name) in MOVED:
        return MOVED[(old, name)]
    if name == "MAX_OUTPUT_BYTES":  # two constants of that name
        return "dsec.api.fncall" if old == "dsec.fncall_model" else "dsec.api.exec"
    name = RENAMED.get(name, name)
    if name not in where:
        raise SystemExit(f"no new home for {old}.{name}")
    return where[name]


def rewrite(path: pathlib.Path, where: dict[str, str]) -> bool:
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import) and any(a.name in OLD for a in node.names):
            raise SystemExit(f"{path}:{node.lineno}: plain import of an old module; edit by hand")
        if not (isinstance(node, ast.ImportFrom) and node.module in OLD):
            continue
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for alias in node.names:
            new_name = RENAMED.get(alias.name, alias.name)
            asname = alias.asname or (alias.name if new_name != alias.name else None)
            spelled = new_name + (f" as {asname}" if asname else "")
            groups[home(where, node.module, alias.name)].append(spelled)
        assert node.end_lineno is not None
        last = lines[node.end_lineno - 1]
        comment = ""
        if node.lineno == node.end_lineno and "#" in last:
            comment = "  " + last[last.index("#") :].rstrip("\n")
        indent = " " * node.col_offset
        new = "".join(
            f"{indent}from {module} import {', '.join(names)}{comment}\n"
            for module, names in sorted(groups.items())
        )
        edits.append((node.lineno, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1 : end] = [new]
    if edits:
        path.write_text("".join(lines))
    return bool(edits)


def main(roots: list[str]) -> None:
    where = homes()
    changed = [
        str(p)
        for root in roots
        for p in sorted(pathlib.Path(root).rglob("*.py"))
        if API not in p.resolve().parents and rewrite(p, where)
    ]
    print(f"{len(changed)} files rewritten", *changed, sep="\n")


if __name__ == "__main__":
    main(sys.argv[1:] or ["src", "tests", "bench"])
