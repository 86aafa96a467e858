#!/usr/bin/env bash
# One command for the GPU machine (H200): build the cuda preset, run the GPU tests, the op probe,
# a compute-sanitizer pass over the CUDA kernels and the op benchmark. Every step's log (and the
# benchmark's JSON) goes to $OUT; the last lines printed are a summary table, so the tail of the
# output says what passed.
#
#   OUT=/some/dir scripts/gpu_check.sh          (OUT defaults to ./gpu_check_out)
#
# Knobs (environment): JOBS (build parallelism, default nproc); GPU_CHECK_SKIP, a space-separated
# list of steps to leave out (tests probe sanitize bench; e.g. GPU_CHECK_SKIP="sanitize" to fit a
# short time limit, then GPU_CHECK_SKIP="tests probe bench" for the sanitizer alone; the build is
# incremental); GPU_CHECK_BENCH_ARGS, extra arguments for cuda_bench_ops (e.g. "--filter rmsnorm").
# The cuda preset builds only the gpu-labelled tests (GDN_CPU_TESTS=OFF).
# Exit status: 0 when every step passed, 1 otherwise (a failed build stops the script early).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
JOBS="${JOBS:-$(nproc)}"
BUILD="$ROOT/build/cuda"

declare -a SUMMARY=()
FAILED=0

# wanted STEP: false when STEP is listed in GPU_CHECK_SKIP.
wanted() {
  case " ${GPU_CHECK_SKIP:-} " in
    *" $1 "*)
      SUMMARY+=("$(printf '%-26s %-8s %6s  %s' "$1" skip '' 'GPU_CHECK_SKIP')")
      return 1
      ;;
  esac
  return 0
}

# step NAME COMMAND...: runs the command, output to the terminal and $OUT/NAME.log.
step() {
  local name="$1"
  shift
  local t0=$SECONDS rc
  echo
  echo "=== [$name] $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  local dt=$((SECONDS - t0))
  SUMMARY+=("$(printf '%-26s %-8s %5ss  %s' "$name" "$([ "$rc" = 0 ] && echo ok || echo "FAIL($rc)")" "$dt" "$OUT/$name.log")")
  [ "$rc" = 0 ] || FAILED=1
  return "$rc"
}

summary() {
  echo
  echo "=== summary (logs in $OUT)"
  for line in "${SUMMARY[@]}"; do echo "$line"; done
  if [ -f "$OUT/bench.log" ]; then
    echo
    echo "=== benchmark (from $OUT/bench.log)"
    grep -vE '^(\[resolve\]|wrote )' "$OUT/bench.log" || true
  fi
  echo
  if [ "$FAILED" = 0 ]; then echo "GPU CHECK: PASS"; else echo "GPU CHECK: FAIL"; fi
}

# --- environment -------------------------------------------------------------------------------
{
  echo "date: $(date -Is)"
  echo "commit: ${GDN_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi 2>&1 || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 || true
  command -v nvcc >/dev/null && nvcc --version
  cmake --version | head -1
  c++ --version | head -1
  echo "nproc: $(nproc)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# --- configure and build -----------------------------------------------------------------------
CONFIGURE=(cmake --preset cuda)
if [ ! -x /usr/local/cuda/bin/nvcc ] && command -v nvcc >/dev/null; then
  CONFIGURE+=("-DCMAKE_CUDA_COMPILER=$(command -v nvcc)")
fi
# A cache written for another source directory (a build tree copied from elsewhere) cannot be
# reused: start that build directory afresh.
if [ -f "$BUILD/CMakeCache.txt" ] &&
  ! grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=$ROOT\$" "$BUILD/CMakeCache.txt"; then
  echo "removing $BUILD (configured for another source directory)"
  rm -rf "$BUILD"
fi
if ! step configure "${CONFIGURE[@]}"; then
  summary
  exit 1
fi
if ! step build cmake --build "$BUILD" -j "$JOBS"; then
  summary
  exit 1
fi

# --- tests, probe, sanitizer, benchmark ----------------------------------------------------------
if wanted tests; then
  step ctest_gpu ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 600 -j 4 \
    --output-junit "$OUT/ctest_gpu.xml"
fi
if wanted probe; then
  step probe "$BUILD/apps/gdntrain/gdntrain" probe --backend cpu --backend cuda
fi

if wanted sanitize; then
  if command -v compute-sanitizer >/dev/null; then
    # Small shapes through every kernel path: scalar and 16-byte packs, one and several rows per
    # block, re-read tails, the grid-stride walk; plus the wrong-kernel and unaligned tests.
    FILTER='Shapes/RmsNormCudaSweep.MatchesRef/R3_D97_*:Shapes/RmsNormCudaSweep.MatchesRef/R64_D128_*'
    FILTER+=':Shapes/RmsNormCudaSweep.MatchesRef/R130_D4096_*:Shapes/RmsNormCudaSweep.MatchesRef/R2_D4100_*'
    FILTER+=':Shapes/RmsNormCudaSweep.MatchesRef/R3_D12288_*:Shapes/RmsNormCudaSweep.MatchesRef/R7_D9001_*'
    FILTER+=':Shapes/RmsNormCudaSweep.MatchesRef/R70000_D64_plain:RmsNormCuda.Unaligned*'
    for tool in memcheck racecheck synccheck; do
      step "sanitize_rmsnorm_$tool" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        "$BUILD/tests/test_rmsnorm_cuda" --gtest_filter="$FILTER"
    done
    # cuBLASLt with odd sizes, sliced operands and K = 0 (our scale kernel).
    GFILTER='Shapes/GemmCudaSweep.MatchesRef/M13_N11_K37_*:GemmCuda.Operands*:GemmCuda.EmptyProductScalesC'
    step sanitize_gemm_memcheck compute-sanitizer --tool memcheck --error-exitcode 99 \
      "$BUILD/tests/test_gemm_cuda" --gtest_filter="$GFILTER"
  else
    SUMMARY+=("$(printf '%-26s %-8s %6s  %s' sanitize skip '' 'compute-sanitizer not on PATH')")
  fi
fi

if wanted bench; then
  # shellcheck disable=SC2086
  step bench "$BUILD/bench/cuda_bench_ops" "$OUT/bench_ops.json" ${GPU_CHECK_BENCH_ARGS:-}
fi

summary
exit "$FAILED"
