#!/usr/bin/env bash
# End-to-end training throughput of gdntrain on one GPU at Qwen3.5 shapes (issue 8): random init,
# 8192-token steps as 1 document and as 4 packed documents (MQAR examples over the full 248k
# vocabulary, so every step has the real LM-head shape), AdamW with fp32 master weights. Prints
# tokens/s, MFU, memory and the time from launch to the first finished step, from each run's log.
#
#   bench/train_bench.sh BUILD_DIR OUT_DIR [shape ...]      shapes: 0.8b 4b (default: both)
#
# GDN_BENCH_STEPS (default 12) sets the steps per run; GDN_BENCH_PROFILE_STEP=N adds
# --profile-step N and prints that step's per-op table; GDN_BENCH_RECOMPUTE (default none) sets
# train.recompute; GDN_BENCH_DOCS (default "1 4") the documents per step (4B runs 1 only).
#
# The PyTorch stack's numbers on the same GPU model are in ../shared/docs/PEERS.md (HF + fla:
# 0.8B 33.3k tokens/s, 52.4 GiB; 4B 13.0k tokens/s, 97.1 GiB, 36% MFU; ~150 s to the first step).
set -u -o pipefail
BUILD=${1:?build dir}
OUT=${2:?out dir}
shift 2
SHAPES=${*:-0.8b 4b}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
for shape in $SHAPES; do
  for docs in ${GDN_BENCH_DOCS:-1 4}; do
    [ "$shape" = 4b ] && [ "$docs" = 4 ] && continue  # one 4B run fits the time budget
    rc_policy=${GDN_BENCH_RECOMPUTE:-none}
    run="$OUT/train_${shape}_${docs}doc_rc${rc_policy}"
    rm -rf "$run"
    seq=$((8192 / docs))
    /usr/bin/time -v "$BUILD/apps/gdntrain/gdntrain" train --device cuda \
      --set model.config="\"$ROOT/bench/configs/qwen35_${shape}.json\"" \
      --set data.mqar.vocab_size=248320 --set data.mqar.num_pairs=64 \
      --set data.mqar.seq_len=$seq --set train.micro_batch_tokens=8192 \
      --set train.steps="${GDN_BENCH_STEPS:-12}" --set log.every=1 --set eval.every=0 \
      --set train.recompute="\"$rc_policy\"" \
      --set checkpoint.every=0 --set checkpoint.at_end=false --set optim.warmup_steps=2 \
      ${GDN_BENCH_PROFILE_STEP:+--profile-step "$GDN_BENCH_PROFILE_STEP"} \
      --run-dir "$run" > "$run.log" 2>&1
    rc=$?
    echo "== $shape, $docs document(s) of $seq tokens, recompute $rc_policy: exit $rc"
    grep -E "model:|memory plan|optimizer state|start-up|first step finished|device memory in use|step +[0-9]+/" "$run.log" |
      grep -vE "step +[1-4]/" | tail -12
    grep -E "Maximum resident" "$run.log" || true
    if [ -n "${GDN_BENCH_PROFILE_STEP:-}" ]; then
      sed -n '/profile of step/,/step (wall)/p' "$run.log"
    fi
    [ $rc = 0 ] || tail -20 "$run.log"
  done
done
