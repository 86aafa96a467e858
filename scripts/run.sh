#!/usr/bin/env bash
# Quickstart command 1: install what is missing, build, and run the main job: `gdntrain train` on
# its built-in default (a tiny Qwen3.5 trained on multi-query associative recall; it prints the
# recall accuracy at the end). Extra arguments go to `gdntrain train`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
preset=cpu
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  preset=cuda
fi
scripts/build.sh "$preset"
# Passive OpenMP waiting: spinning threads cost more than they save on small machines.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec "build/$preset/apps/gdntrain/gdntrain" train --device auto \
  --run-dir "runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
