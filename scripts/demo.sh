#!/usr/bin/env bash
# The platform's main job: install, start the embedded single-node platform, show it working.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/dsec demo "$@"
