"""Cost of the after-command tamper scan: the old recursive scan vs the new one.

The scan runs after every command and right before every verify, so its normal path
(nothing changed) must stay a handful of system calls. Both scans run interleaved in
one process over the same fake upper dirs (so machine noise hits both alike):

* ``unchanged``: an upper dir with N files in /usr/bin, /usr/lib/<pkg>/ and /etc, that
  both scans have already seen (the steady state of every command);
* ``changed``: the same with one new file in /usr/bin before each scan.

Run: ``.venv/bin/python bench/bench_tamper.py [--rounds 400]`` (prints medians and p99
in microseconds and the new/old ratio).

Measured (2 shared cores, load ~7, 400 rounds; microseconds, p50 / p99):

    case              old p50   old p99   new p50   new p99   new/old
    unchanged N=0        74.7     722.1      25.6      76.9      0.34
    unchanged N=30      193.0    1809.1      44.0     147.3      0.23
    unchanged N=300    1319.0   17421.5      82.9    2767.2      0.06
    unchanged N=1500   8997.3   20766.3     232.1    3853.7      0.03
    changed N=0        1281.8    8261.0     632.9    6604.6      0.49
    changed N=1500    11734.5   43847.7    2970.8   12417.7      0.25

The old scan walked every watched entry on every command (up to its 2,000 budget);
the new one opens and stats each tracked directory and lists only the changed ones.
"""

from __future__ import annotations

import argparse
import os
import stat
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dsec.security.tampering import TamperWatch

# -- the scan as it was before (src/dsec/security/tampering.py at 22f5ad9) ---------------
OLD_WATCHED = (
    "bin", "sbin", "lib", "lib32", "lib64", "usr/bin", "usr/sbin", "usr/lib", "usr/lib64",
    "usr/libexec", "etc/ld.so.preload", "etc/ld.so.conf", "etc/ld.so.conf.d", "etc/passwd",
    "etc/shadow", "etc/sudoers",
)  # fmt: skip
OLD_MAX_SCAN = 2000


def _old_walk(root: Path, rel: str, budget: list[int]) -> Iterator[tuple[str, str]]:
    path = root / rel
    try:
        st = os.lstat(path)
    except OSError:
        return
    if budget[0] <= 0:
        return
    budget[0] -= 1
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        yield "/" + rel, "deleted"
        return
    if not stat.S_ISDIR(st.st_mode):
        yield "/" + rel, "written"
        return
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return
    for name in names:
        yield from _old_walk(root, f"{rel}/{name}", budget)


class OldTamperWatch:
    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}

    def scan(self, sandbox_id: str, upper: Path) -> list[tuple[str, str]]:
        seen = self._seen.setdefault(sandbox_id, set())
        budget = [OLD_MAX_SCAN]
        found = []
        for rel in OLD_WATCHED:
            if not os.path.lexists(upper / rel):
                continue
            for path, change in _old_walk(upper, rel, budget):
                if path not in seen:
                    seen.add(path)
                    found.append((path, change))
        return found


# -- the bench -----------------------------------------------------------------------------
def make_upper(root: Path, files: int) -> Path:
    """An upper dir as after some work: a few system files changed, N files in all."""
    upper = root / f"upper-{files}"
    for d in ("usr/bin", "etc", "tmp", "root"):
        (upper / d).mkdir(parents=True)
    per_pkg = 20
    for i in range(files):
        if i % 3 == 0:
            (upper / "usr/bin" / f"tool{i}").write_bytes(b"x")
        elif i % 3 == 1:
            pkg = upper / "usr/lib" / f"pkg{i // (3 * per_pkg)}"
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / f"lib{i}.so").write_bytes(b"x")
        else:
            (upper / "etc" / f"conf{i}").write_bytes(b"x")
    (upper / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    return upper


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1000


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, int(len(ordered) * 0.99) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--files", type=int, nargs="*", default=[0, 30, 300, 1500])
    args = ap.parse_args()
    print(f"{'case':<24}{'old p50':>10}{'old p99':>10}{'new p50':>10}{'new p99':>10}{'ratio':>8}")
    with tempfile.TemporaryDirectory(prefix="bench-tamper-") as tmp:
        for files in args.files:
            upper = make_upper(Path(tmp), files)
            old, new = OldTamperWatch(), TamperWatch()
            old.scan("s", upper)
            new.scan("s", upper)
            time.sleep(0.1)  # past the racy window: the steady state
            new.scan("s", upper)
            for case in ("unchanged", "changed"):
                t_old: list[float] = []
                t_new: list[float] = []
                for i in range(args.rounds):
                    if case == "changed":
                        (upper / "usr/bin" / f"new{i}").write_bytes(b"x")
                    # interleaved, alternating which goes first
                    pair: list[tuple[str, Callable[[], object]]] = [
                        ("old", lambda o=old, u=upper: o.scan("s", u)),  # type: ignore[misc]
                        ("new", lambda n=new, u=upper: n.scan("s", u)),  # type: ignore[misc]
                    ]
                    if i % 2:
                        pair.reverse()
                    for name, fn in pair:
                        (t_old if name == "old" else t_new).append(timed(fn))
                mo, mn = statistics.median(t_old), statistics.median(t_new)
                print(
                    f"{case + f' N={files}':<24}{mo:>10.1f}{p99(t_old):>10.1f}"
                    f"{mn:>10.1f}{p99(t_new):>10.1f}{mn / mo:>8.2f}"
                )


if __name__ == "__main__":
    main()
