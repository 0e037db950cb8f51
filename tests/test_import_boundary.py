"""The SDK installs light: ``import dsec`` and ``import dsec.sdk`` load only the wire.

The SDK depends on the wire models (dsec.api), the typed errors and the client config,
nothing else of ours: a caller's process must not load the cluster, RL, security or
server packages (their import time, their dependencies, their bugs) to talk to the
platform. Checked in a fresh interpreter, since this test process has loaded everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

ALLOWED_PREFIXES = ("dsec.api", "dsec.sdk")
ALLOWED_EXACT = {"dsec", "dsec.api", "dsec.sdk", "dsec.errors", "dsec.config"}


def loaded_dsec_modules(*imports: str) -> list[str]:
    """The dsec.* modules a fresh interpreter holds after ``import`` of ``imports``."""
    code = (
        "import json, sys\n"
        + "".join(f"import {name}\n" for name in imports)
        + "print(json.dumps(sorted(m for m in sys.modules if m == 'dsec' "
        "or m.startswith('dsec.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    mods: list[str] = json.loads(out.stdout)
    return mods


def outside_boundary(mods: list[str]) -> list[str]:
    return [m for m in mods if m not in ALLOWED_EXACT and not m.startswith(ALLOWED_PREFIXES)]


def test_import_dsec_loads_only_the_wire() -> None:
    mods = loaded_dsec_modules("dsec")
    assert "dsec.sdk" in mods  # the top level is the SDK
    assert outside_boundary(mods) == []


def test_import_dsec_sdk_loads_only_the_wire() -> None:
    mods = loaded_dsec_modules("dsec.sdk")
    assert "dsec.api.spec" in mods
    assert outside_boundary(mods) == []


def test_every_sdk_module_stays_inside() -> None:
    """The lazily imported SDK modules too (batches, trajectories, FnCall, IAM ...)."""
    from pathlib import Path

    import dsec.sdk

    sdk = Path(dsec.sdk.__file__).parent
    names = sorted(f"dsec.sdk.{p.stem}" for p in sdk.glob("*.py") if p.stem != "__init__")
    assert names
    assert outside_boundary(loaded_dsec_modules(*names)) == []


def test_the_check_catches_a_platform_module() -> None:
    """The boundary check itself can fail: a platform package is reported."""
    mods = loaded_dsec_modules("dsec", "dsec.rl.trajectory")
    assert "dsec.rl.trajectory" in outside_boundary(mods)
