#!/usr/bin/env bash
# The whole test suite: lint, type check, then every test (real sandboxes, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
.venv/bin/mypy
# The Harbor plug-in against Harbor's real source (its venv is Python 3.12; see install.sh).
if [ -x .venv-harbor/bin/mypy ]; then .venv-harbor/bin/mypy --config-file scripts/mypy-harbor.ini; fi
# The slowest tests in the log, so the next cut of the suite's time starts from data.
exec .venv/bin/pytest -p no:cacheprovider --durations=40 "$@"
