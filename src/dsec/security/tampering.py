"""Detect changes to what a sandbox's later commands, and a verifier, would run.

Everything a sandbox changes lands in its overlay upper directory on the host, so
tampering is visible from outside without trusting anything inside: after each
command (and right before a verify) the edge looks at the places a tamperer writes to
hijack what runs next: system binaries and libraries, the loader's configuration
(``/etc/ld.so.preload``, ``ld.so.conf.d``, ``ld.so.cache``), shell start-up files
(``/etc/profile``, ``bash.bashrc``, ``environment``), accounts, interpreter start-up
hooks (``sitecustomize``/``usercustomize``, ``.pth`` files in site-/dist-packages), and
``/usr/local/bin`` entries that shadow a system command. Installing packages touches
these paths too: a change is a warning for the trainer to judge, not a verdict.

The sandbox is hostile and controls the tree, so the scan *fails closed*:

* **Iterative and bounded.** No recursion; at most ``MAX_DEPTH`` levels and
  ``MAX_NODES`` tracked directories per sandbox; every directory is opened relative to
  its parent with ``O_NOFOLLOW`` (a planted link never leads the edge out of the upper
  dir). A pass spends at most ``MAX_OPS`` operations (directories opened, entries
  examined; an entry merely skipped costs 1/``SKIP_DIV``). Whatever it could not look
  at is returned as ``ScanResult.incomplete`` (why and where it stopped), which the
  edge records as a critical ``scan_incomplete`` event instead of going quiet.
* **Cheap when nothing changed.** A pass costs one open and ``fstat`` per tracked
  directory (there are few: only directories that exist in the upper dir). A directory
  is listed again only when its ctime or mtime moved (an entry added, removed or
  renamed, an overlay xattr such as *opaque* set: all of these change the directory);
  an entry is new when its own ctime is not older than that directory's last listing.
  So no per-file memory is kept: what was reported is remembered by time, not by name.
* **Not starvable.** The small, high-value places (bin dirs, /etc files, start-up
  hooks) are checked first on every pass, one huge directory among them gets only a
  slice of the budget per pass (plus a direct look at the commands most worth
  hijacking), and the big library trees follow from a cursor that moves on across
  passes, so a hundred thousand junk entries delay a report by passes, each of which
  says it was incomplete, but never hide it.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

TREE = "tree"  # the directory and everything below it
FILE = "file"  # exactly this entry
STARTUP = "startup"  # interpreter start-up hooks among the directory's entries
SHADOW = "shadow"  # entries named like a system command (/usr/local/bin)
Rule: TypeAlias = "str | Mapping[str, Rule]"

_PYTHON_SITE: Rule = {"site-packages": STARTUP, "dist-packages": STARTUP}
# What to watch, keyed by upper-dir path component (fnmatch patterns allowed). Order
# is priority: small, high-value places first, the big library trees last.
WATCHED: Mapping[str, Rule] = {
    "etc": {
        "ld.so.preload": FILE,
        "ld.so.conf": FILE,
        "ld.so.cache": FILE,
        "ld.so.conf.d": TREE,
        "profile": FILE,
        "profile.d": TREE,
        "bash.bashrc": FILE,
        "environment": FILE,
        "shells": FILE,
        "passwd": FILE,
        "shadow": FILE,
        "group": FILE,
        "sudoers": FILE,
        "sudoers.d": TREE,
        "python3*": TREE,  # Debian's sitecustomize.py lives here
    },
    "usr": {
        "local": {
            "bin": SHADOW,
            "sbin": SHADOW,
            "lib": {"python3*": _PYTHON_SITE},
        },
        "bin": TREE,
        "sbin": TREE,
        "libexec": TREE,
        "lib64": TREE,
        "lib32": TREE,
        "libx32": TREE,
        "lib": TREE,
    },
    "bin": TREE,
    "sbin": TREE,
    "root": {".local": {"lib": {"python3*": _PYTHON_SITE}}},  # root's user site
    "lib64": TREE,
    "lib32": TREE,
    "libx32": TREE,
    "lib": TREE,
}
STARTUP_NAMES = ("*.pth", "sitecustomize*", "usercustomize*")
# Looked at directly in a bin directory too big to list in one pass.
CRITICAL_NAMES = (
    "sh", "bash", "dash", "env", "python", "python3", "pytest", "pip", "pip3", "node",
    "perl", "ruby", "make", "cc", "gcc", "ld", "timeout", "diff", "cmp", "cat", "grep",
    "test", "[", "true", "false", "sudo", "su", "ld.so", "ld-linux-x86-64.so.2",
)  # fmt: skip
BIN_DIRS = {"bin", "sbin", "usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin"}
# Names that count as system commands when the sandbox's root cannot be asked.
FALLBACK_SYSTEM_NAMES = frozenset(CRITICAL_NAMES) | {"python3.11", "python3.12", "ls", "sed"}

MAX_OPS = 5_000  # operations per pass (directories opened + entries examined)
SKIP_DIV = 32  # an entry skipped over (resuming a big listing) costs 1/32 of an op
HOT_SLICE = MAX_OPS // 4  # one directory of the priority set gets at most this per pass
MAX_DEPTH = 64  # deeper directories are reported as not scanned
MAX_NODES = 10_000  # tracked directories per sandbox (memory bound)
MAX_MATCHES = 16  # directories one pattern (python3*) may match
MAX_RECENT = 2048  # recently reported paths, to fold the duplicates a race can cause
MARGIN_NS = 50_000_000  # file times are coarse (a tick, <= 10 ms): a ctime this close is racy
MAX_REPORTED = 50  # paths listed in one event

_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OVERLAY_XATTRS = (
    ("trusted.overlay.opaque", "replaced"),
    ("user.overlay.opaque", "replaced"),
    ("trusted.overlay.redirect", "renamed"),
    ("user.overlay.redirect", "renamed"),
)
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def shown(path: str) -> str:
    """A path as valid text: bytes that are not UTF-8 become ``\\xNN`` (a lone
    surrogate would break JSON encoders downstream). Control characters stay: JSON
    escapes them and operator surfaces render them inert (dsec.cli.safe_text)."""
    try:
        path.encode()
    except UnicodeEncodeError:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    return path


@dataclass(frozen=True)
class Incomplete:
    """Why a pass could not look at everything, and where it stopped."""

    reason: str
    at: str
    detail: dict[str, object] = field(default_factory=dict)


@dataclass
class ScanResult:
    changes: list[tuple[str, str]] = field(default_factory=list)  # (path, change)
    incomplete: list[Incomplete] = field(default_factory=list)


@dataclass
class _Partial:
    """A listing cut short by the budget, resumed on the next pass."""

    offset: int
    started_ns: int
    sig: tuple[int, int, int]
    since_ns: int | None
    modified: bool = False
    dirs: set[str] = field(default_factory=set)
    flag: str | None = None


class _Node:
    """A directory of the upper dir that exists and is watched."""

    __slots__ = (
        "children",
        "depth",
        "flag",
        "fresh_ns",
        "hot",
        "name",
        "order",
        "partial",
        "rule",
        "sig",
        "since_ns",
        "xattrs",
    )

    def __init__(self, name: str, rule: Rule, depth: int, hot: bool) -> None:
        self.name = name
        self.rule = rule
        self.depth = depth
        self.hot = hot  # checked first on every pass
        self.sig: tuple[int, int, int] | None = None  # (ino, ctime, mtime) at last listing
        self.fresh_ns = 0  # when the last complete listing started
        self.since_ns: int | None = None  # entries with a ctime from here on are new
        self.children: dict[str, _Node] = {}
        self.order: list[str] | None = None  # children's names, sorted (cached)
        self.partial: _Partial | None = None
        self.flag: str | None = None  # a persistent "could not track" reason
        self.xattrs: frozenset[str] = frozenset()


def _child_rule(rule: Rule, name: str) -> Rule | None:
    if isinstance(rule, str):
        return TREE if rule == TREE else None
    found = rule.get(name)
    if found is not None:
        return found
    for pattern, sub in rule.items():
        if "*" in pattern and fnmatch.fnmatchcase(name, pattern):
            return sub
    return None


def _priority(rule: Rule, name: str) -> int:
    if isinstance(rule, str):
        return 0
    for i, pattern in enumerate(rule):
        if pattern == name or ("*" in pattern and fnmatch.fnmatchcase(name, pattern)):
            return i
    return len(rule)


class _Budget:
    def __init__(self, ops: int) -> None:
        self.units = ops * SKIP_DIV

    def take(self, ops: int = 1) -> bool:
        if self.units < ops * SKIP_DIV:
            self.units = 0
            return False
        self.units -= ops * SKIP_DIV
        return True

    def skip(self) -> bool:
        if self.units <= 0:
            return False
        self.units -= 1
        return True

    @property
    def ops(self) -> int:
        return self.units // SKIP_DIV


class _State:
    def __init__(self) -> None:
        self.root = _Node("", WATCHED, 0, hot=True)
        self.nodes = 1
        self.cursor: tuple[str, ...] | None = None  # where the last deep pass stopped
        self.recent: OrderedDict[str, None] = OrderedDict()


SystemNames = Callable[[str], bool]


class _Pass:
    """One scan of one sandbox's upper dir."""

    def __init__(self, state: _State, system_names: SystemNames | None, ops: int) -> None:
        self.state = state
        self.budget = _Budget(ops)
        self.system_names = system_names
        self.result = ScanResult()
        self.exhausted = False
        self.leads: set[int] = set()  # hot nodes on the way to deep ones
        self.last_done: tuple[str, ...] | None = None

    # -- reporting ---------------------------------------------------------------------
    def report(self, path: str, change: str) -> None:
        recent = self.state.recent
        key = f"{change} {path}"
        if key in recent:
            recent.move_to_end(key)
            return
        recent[key] = None
        if len(recent) > MAX_RECENT:
            recent.popitem(last=False)
        self.result.changes.append((shown(path), change))

    def incomplete(self, reason: str, at: str, **detail: object) -> None:
        if len(self.result.incomplete) < 8:
            self.result.incomplete.append(Incomplete(reason, "/" + shown(at.lstrip("/")), detail))

    # -- the walk ----------------------------------------------------------------------
    def run(self, root_fd: int) -> None:
        root = self.state.root
        if not self.check(root, root_fd, ""):
            return self.out_of_budget("/")
        self.walk(root_fd, root, "", self.decide_hot, by_priority=True)
        if self.exhausted:
            return None
        if not self.leads:
            self.state.cursor = None
            return None
        cursor = self.state.cursor
        self.walk(root_fd, root, "", lambda n, k: self.decide_after(n, k, cursor))
        if cursor is not None and not self.exhausted:
            self.walk(root_fd, root, "", lambda n, k: self.decide_before(n, k, cursor))
        if not self.exhausted:
            self.state.cursor = None
        return None

    def out_of_budget(self, at: str) -> None:
        if not self.exhausted:
            self.exhausted = True
            self.incomplete(
                "budget",
                at,
                budget_ops=MAX_OPS,
                tracked_dirs=self.state.nodes,
                note="too many entries to look at in one pass; the scan goes on next pass",
            )

    # decide(node, key) -> "check" | "open" | "prune"
    def decide_hot(self, node: _Node, key: tuple[str, ...]) -> str:
        return "check" if node.hot else "prune"

    def decide_after(self, node: _Node, key: tuple[str, ...], c: tuple[str, ...] | None) -> str:
        if node.hot:
            return "open" if id(node) in self.leads else "prune"
        if c is None or key > c:
            return "check"
        return "open" if c[: len(key)] == key else "prune"

    def decide_before(self, node: _Node, key: tuple[str, ...], c: tuple[str, ...]) -> str:
        if node.hot:
            return "open" if id(node) in self.leads else "prune"
        return "check" if key <= c else "prune"

    def walk(
        self,
        root_fd: int,
        root: _Node,
        root_path: str,
        decide: Callable[[_Node, tuple[str, ...]], str],
        *,
        by_priority: bool = False,
    ) -> None:
        """Depth-first over the tracked tree with an explicit stack of open fds."""
        stack: list[tuple[_Node, int, str, Iterator[str]]] = [
            (root, root_fd, root_path, iter(self.children(root, by_priority)))
        ]
        try:
            while stack:
                node, fd, path, names = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    if fd != root_fd:
                        os.close(fd)
                    continue
                child = node.children.get(name)
                if child is None:  # dropped while listing its parent this pass
                    continue
                cpath = f"{path}/{name}" if path else name
                key = tuple(cpath.split("/"))
                mode = decide(child, key)
                if mode == "prune":
                    continue
                if not self.budget.take():
                    self.out_of_budget(cpath)
                    return
                try:
                    cfd = os.open(name, _OPEN_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in _GONE:  # removed or replaced: its parent's listing says so
                        self.drop(node, name)
                    else:
                        self.incomplete("error", cpath, error=os.strerror(exc.errno or 0))
                    continue
                if mode == "check":
                    done = self.check(child, cfd, cpath)
                    if not done:
                        os.close(cfd)
                        self.out_of_budget(cpath)
                        return
                    if not child.hot:
                        self.last_done = key
                        self.state.cursor = key
                if by_priority and any(not c.hot for c in child.children.values()):
                    self.leads.update(id(n) for n, *_ in stack)  # the way to deep nodes
                    self.leads.add(id(child))
                stack.append((child, cfd, cpath, iter(self.children(child, by_priority))))
        finally:
            for _, fd, _, _ in stack:
                if fd != root_fd:
                    os.close(fd)

    def children(self, node: _Node, by_priority: bool) -> list[str]:
        if node.order is None:
            node.order = sorted(node.children)
        if by_priority and isinstance(node.rule, Mapping):
            rule = node.rule
            return sorted(node.order, key=lambda n: _priority(rule, n))
        return node.order

    def drop(self, parent: _Node, name: str) -> None:
        child = parent.children.pop(name, None)
        if child is None:
            return
        parent.order = None
        todo = [child]
        while todo:
            n = todo.pop()
            self.state.nodes -= 1
            todo.extend(n.children.values())

    # -- one directory -----------------------------------------------------------------
    def check(self, node: _Node, fd: int, path: str) -> bool:
        """Look at one open directory; False if the budget ran out in it."""
        try:
            st = os.fstat(fd)
        except OSError as exc:
            self.incomplete("error", path, error=os.strerror(exc.errno or 0))
            return True
        sig = (st.st_ino, st.st_ctime_ns, st.st_mtime_ns)
        racy = st.st_ctime_ns >= node.fresh_ns - MARGIN_NS
        if node.partial is None and sig == node.sig and not racy:
            if node.flag is not None:
                self.incomplete(node.flag, path, depth=node.depth)
            return True
        done = self.list(node, fd, path, sig)
        if node.flag is not None:
            self.incomplete(node.flag, path, depth=node.depth)
        return done

    def list(self, node: _Node, fd: int, path: str, sig: tuple[int, int, int]) -> bool:
        part = node.partial
        if part is None:
            part = _Partial(0, time.time_ns(), sig, node.since_ns)
            self.xattrs(node, fd, path)
        elif sig != part.sig:
            part.modified, part.sig = True, sig
        limit = HOT_SLICE if node.hot else MAX_OPS
        spent = 0
        try:
            with os.scandir(fd) as entries:
                for i, entry in enumerate(entries):
                    if i < part.offset:
                        if not self.budget.skip():
                            return self.pause(node, fd, part, i, path)
                        continue
                    if spent >= limit or not self.budget.take():
                        return self.pause(node, fd, part, i, path)
                    spent += 1
                    self.entry(node, fd, path, entry, part)
        except OSError as exc:
            if exc.errno in _GONE:
                return True
            self.incomplete("error", path, error=os.strerror(exc.errno or 0))
            node.partial = None
            return True
        node.partial = None
        for name in [n for n in node.children if n not in part.dirs]:
            self.drop(node, name)  # gone, or no longer a directory
        node.flag = part.flag
        if part.modified:  # changed while listed in slices: list again, same threshold
            node.sig = None
        else:
            node.sig = part.sig
            node.fresh_ns = part.started_ns
            node.since_ns = part.started_ns - MARGIN_NS
        return True

    def pause(self, node: _Node, fd: int, part: _Partial, offset: int, path: str) -> bool:
        part.offset = offset
        node.partial = part
        if path in BIN_DIRS:  # the commands most worth hijacking: looked at directly
            for name in CRITICAL_NAMES:
                self.if_new(fd, f"{path}/{name}", name, part, shadow=node.rule == SHADOW)
        if self.budget.ops > 0:  # only this directory's slice is used up: go on
            self.incomplete(
                "large_directory",
                path,
                listed=offset,
                note="listed in slices across passes; its tail is not scanned yet",
            )
            return True
        return False

    def xattrs(self, node: _Node, fd: int, path: str) -> None:
        found = set()
        for attr, change in _OVERLAY_XATTRS:
            try:
                os.getxattr(fd, attr)
            except OSError:
                continue
            found.add(change)
        for change in found - node.xattrs:
            self.report("/" + path, change)
        node.xattrs = frozenset(found)

    def entry(
        self, node: _Node, fd: int, path: str, entry: os.DirEntry[str], part: _Partial
    ) -> None:
        name = entry.name
        rule = node.rule
        sub = _child_rule(rule, name)
        cpath = f"{path}/{name}" if path else name
        if rule == STARTUP:
            if any(fnmatch.fnmatchcase(name, p) for p in STARTUP_NAMES):
                self.if_new(fd, cpath, name, part)
            return
        if rule == SHADOW:
            if not entry.is_dir(follow_symlinks=False):
                self.if_new(fd, cpath, name, part, shadow=True)
            return
        if sub is None:
            return
        if entry.is_dir(follow_symlinks=False) and sub != FILE:
            part.dirs.add(name)
            if name in node.children:
                return
            if node.depth + 1 > MAX_DEPTH:
                part.flag = "too_deep"
                return
            if self.state.nodes >= MAX_NODES:
                part.flag = "too_many_directories"
                return
            patterned = isinstance(rule, Mapping) and name not in rule  # python3*
            if patterned and sum(1 for n in node.children if n not in rule) >= MAX_MATCHES:
                part.flag = "too_many_matches"
                return
            hot = rule != TREE
            node.children[name] = _Node(name, sub, node.depth + 1, hot=hot)
            node.order = None
            self.state.nodes += 1
            return
        self.if_new(fd, cpath, name, part)

    def if_new(
        self, fd: int, cpath: str, name: str, part: _Partial, *, shadow: bool = False
    ) -> None:
        """Report ``name`` (in the directory ``fd``) if it changed since the last listing."""
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return
        if part.since_ns is not None and st.st_ctime_ns < part.since_ns:
            return
        whiteout = stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # an overlay whiteout
        if shadow:
            if not whiteout and self.is_system_name(name):
                self.report("/" + cpath, "shadowed")
            return
        self.report("/" + cpath, "deleted" if whiteout else "written")

    def is_system_name(self, name: str) -> bool:
        if self.system_names is not None:
            try:
                return self.system_names(name)
            except OSError:
                pass
        return name in FALLBACK_SYSTEM_NAMES


def merged_names(root: Path) -> SystemNames:
    """``name -> True`` if ``/usr/bin/name`` (or sbin, /bin, /sbin) exists in the
    sandbox's merged tree seen through ``root`` (its ``/proc/<pid>/root``): opened
    component by component with O_NOFOLLOW, so its links lead nowhere."""

    def exists(name: str) -> bool:
        if "/" in name or name in (".", ".."):
            return False
        for rel in ("usr/bin", "usr/sbin", "bin", "sbin"):
            fd = -1
            try:
                fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                for part in rel.split("/"):
                    nfd = os.open(part, _OPEN_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = nfd
                os.stat(name, dir_fd=fd, follow_symlinks=False)
                return True
            except OSError:
                continue
            finally:
                if fd >= 0:
                    os.close(fd)
        return False

    return exists


class TamperWatch:
    """Per-sandbox scan state (bounded), so each change is reported once."""

    def __init__(self, *, max_ops: int = MAX_OPS) -> None:
        self._states: dict[str, _State] = {}
        self.max_ops = max_ops

    def scan(
        self, sandbox_id: str, upper: Path, *, system_names: SystemNames | None = None
    ) -> ScanResult:
        """New changes under the watched paths since the last scan, and what this
        pass could not look at."""
        try:
            root_fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return ScanResult()  # the sandbox is gone
        except OSError as exc:
            return ScanResult(
                incomplete=[Incomplete("error", "/", {"error": os.strerror(exc.errno or 0)})]
            )
        state = self._states.setdefault(sandbox_id, _State())
        scan = _Pass(state, system_names, self.max_ops)
        try:
            scan.run(root_fd)
        finally:
            os.close(root_fd)
        return scan.result

    def tracked(self, sandbox_id: str) -> tuple[int, int]:
        """(tracked directories, remembered paths) of a sandbox: the memory it costs."""
        state = self._states.get(sandbox_id)
        return (state.nodes, len(state.recent)) if state else (0, 0)

    def forget(self, sandbox_id: str) -> None:
        self._states.pop(sandbox_id, None)
