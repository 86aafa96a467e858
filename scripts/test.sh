#!/usr/bin/env bash
# Quickstart command 2 (and what CI runs): install what is missing, build the CPU preset and,
# when the CUDA toolkit is present, the CUDA preset (every .cu compiles and links), then run every
# `cpu`-labelled test; on a machine with a GPU also every `gpu`-labelled test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh cpu
has_nvcc=0
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  has_nvcc=1
  scripts/build.sh cuda
fi
# Passive OpenMP waiting: with several test processes on few cores, spinning threads starve
# the ones doing work.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
ctest --preset cpu -j "$(nproc)"
# Again under OpenBLAS's oldest x86 kernels, which it picks on CPUs it does not recognise (issue 21):
# the results must not depend on the kernel set's rounding or thread behaviour.
OPENBLAS_CORETYPE=Prescott ctest --preset cpu -j "$(nproc)"
if [ $has_nvcc = 1 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  ctest --preset gpu
fi
