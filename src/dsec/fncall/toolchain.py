"""A Debian image with compilers and Node.js for the FnCall languages (C, C++, Node).

``debian-python:bookworm`` has only python3; the judge needs gcc/g++. The tree is
bootstrapped once per host (debootstrap --include=build-essential,nodejs, a few
minutes) and cached under ``$DSEC_CACHE_DIR/fncall`` so every test platform and
bench run imports the same directory (``client.import_image(ref, path)``) instead of
bootstrapping again.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

from dsec import native
from dsec.images import builders

TOOLCHAIN_REF = "debian-toolchain:bookworm"
PACKAGES = ("python3", "ca-certificates", "build-essential", "nodejs")
RECIPE_VERSION = 1


def toolchain_dir() -> Path:
    return native.cache_dir() / "fncall" / "debian-toolchain-bookworm"


def _stamp_ok(stamp: Path) -> bool:
    try:
        doc = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("version") == RECIPE_VERSION


async def ensure_toolchain_tree() -> Path:
    """The cached root file system tree (bootstrapping it the first time)."""
    base = toolchain_dir()
    tree, stamp = base / "rootfs", base / "recipe.json"
    if await asyncio.to_thread(_stamp_ok, stamp):
        return tree
    base.mkdir(parents=True, exist_ok=True)
    staging = base / "rootfs.partial"
    await asyncio.to_thread(shutil.rmtree, staging, True)
    await asyncio.to_thread(shutil.rmtree, tree, True)
    await builders.debootstrap(staging, include=PACKAGES)
    await builders.customize_debian(staging)
    await asyncio.to_thread(os.rename, staging, tree)
    await asyncio.to_thread(stamp.write_text, json.dumps({"version": RECIPE_VERSION}))
    return tree


if __name__ == "__main__":
    print(asyncio.run(ensure_toolchain_tree()))
