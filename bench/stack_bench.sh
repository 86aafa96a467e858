#!/usr/bin/env bash
# gdntrain against the PyTorch stack (Hugging Face transformers Qwen3.5 + fla GDN kernels) on one
# GPU, in one invocation (issue 8): the same shapes (Qwen3.5-0.8B and 4B, random init, 8192-token
# steps), tokens/s, MFU, peak memory and launch-to-first-step for both, then one table.
#
#   bench/stack_bench.sh BUILD_DIR OUT_DIR PEERS_DIR
#
# PEERS_DIR holds the peers' pure-Python wheels unpacked (fla, liger_kernel) and copies of
# ../shared/bench/hf_baseline.py and peers.py (the GPU machine has torch, triton and transformers
# but no internet; peers.py is what `cuda_bench_ops --peers PEERS_DIR` runs). Prepare it on a
# machine with pip:
#   mkdir -p .peers/wheels && pip download --no-deps -d .peers/wheels flash-linear-attention==0.5.2 \
#     fla-core==0.5.2 liger-kernel==0.8.5 && (cd .peers && for w in wheels/*.whl; do
#     python3 -m zipfile -e "$w" .; done) && cp ../shared/bench/hf_baseline.py ../shared/bench/peers.py .peers/
# The PyTorch stack runs one 8192-token sequence per step (hf_baseline.py's setting) with fla's
# Hopper backward guard lifted for timing (PEERS.md); gdntrain runs 1 document and 4 packed
# documents for 0.8B and 1 document for 4B, with recompute none and, for 4B, selective as well (the
# policy that brings 4B under 0.7x the stack's memory: docs/PERF.md run 22).
# Knobs: STACK_SHAPES (default "0.8B 4B"), GDN_BENCH_STEPS (gdntrain steps per run, default 10).
set -u -o pipefail
BUILD=${1:?build dir}
OUT=${2:?out dir}
PEERS=${3:?peers dir (fla, liger_kernel, hf_baseline.py)}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
PEERS="$(cd "$PEERS" && pwd)"
[ -f "$PEERS/hf_baseline.py" ] || { echo "error: $PEERS/hf_baseline.py missing" >&2; exit 1; }
export GDN_BENCH_STEPS=${GDN_BENCH_STEPS:-10}
SHAPES=${STACK_SHAPES:-0.8B 4B}

for shape in $SHAPES; do
  lower=$(echo "$shape" | tr 'A-Z' 'a-z')
  if [ "$lower" = 0.8b ]; then
    GDN_BENCH_DOCS="1 4" "$ROOT/bench/train_bench.sh" "$BUILD" "$OUT/gdn" "$lower"
  else
    GDN_BENCH_DOCS=1 "$ROOT/bench/train_bench.sh" "$BUILD" "$OUT/gdn" "$lower"
    GDN_BENCH_DOCS=1 GDN_BENCH_RECOMPUTE=selective "$ROOT/bench/train_bench.sh" "$BUILD" "$OUT/gdn" \
      "$lower"
  fi
  echo "== PyTorch stack (HF transformers + fla), $shape, 1 sequence of 8192 tokens"
  PYTHONPATH="$PEERS" /usr/bin/time -v python3 "$ROOT/bench/hf_stack.py" --peers "$PEERS" \
    --shape "$shape" --out "$OUT/hf_${shape}.json" > "$OUT/hf_${shape}.log" 2>&1
  echo "exit $?"
  grep -E "^hf|error|Maximum resident" "$OUT/hf_${shape}.log"
done
python3 "$ROOT/bench/stack_table.py" "$OUT"
