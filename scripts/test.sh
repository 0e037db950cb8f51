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
# Two pytest-xdist workers: run alone, the suite kept 0.8 of our 2 cores busy (tests
# wait on sandboxes, VMs and servers). --dist loadfile keeps a module's tests, and the
# platform or VM its fixtures start, in one worker. Every test platform has its own data
# dir, edge id, cgroups, nft table and address block, so two run side by side.
# DSEC_TEST_WORKERS=0 runs everything in this process, in order (to debug a failure).
# The slowest tests in the log, so the next cut of the suite's time starts from data.
exec .venv/bin/pytest -p no:cacheprovider -n "${DSEC_TEST_WORKERS:-2}" --dist loadfile \
    --durations=40 "$@"
