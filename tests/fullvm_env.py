"""What every full-VM test module shares: the marks that run it only where it can run
(root, QEMU and qemu-img installed) and how long a create may take under TCG."""

from __future__ import annotations

import os
import shutil

import pytest

FULLVM_MARKS = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None,
        reason="QEMU is not installed (scripts/install.sh installs it)",
    ),
]
BOOT = 240  # seconds a create may take under TCG on a loaded 2-core host
