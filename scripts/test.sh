#!/usr/bin/env bash
# The whole test suite: lint, type check, then every test (real sandboxes, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
.venv/bin/mypy
exec .venv/bin/pytest -p no:cacheprovider "$@"
