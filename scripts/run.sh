#!/usr/bin/env bash
# Quickstart command 1: install what is missing, build, and run the main job.
# The main job is `gdntrain probe` (every op resolved and checked against the fp64 reference)
# until the trainer lands; then it becomes `gdntrain train` on its built-in default task.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
preset=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && command -v nvcc >/dev/null 2>&1 ||
   { [ -x /usr/local/cuda/bin/nvcc ] && nvidia-smi -L >/dev/null 2>&1; }; then
  preset=cuda
fi
scripts/build.sh "$preset"
exec "build/$preset/apps/gdntrain/gdntrain" probe "$@"
