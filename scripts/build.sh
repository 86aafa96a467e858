#!/usr/bin/env bash
# Configures and builds a preset (default: cpu). Usage: scripts/build.sh [cpu|cuda|debug]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-cpu}
jobs=${GDN_BUILD_JOBS:-$(nproc)}
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$jobs"
