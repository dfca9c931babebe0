#!/usr/bin/env bash
# Issue 27's acceptance on a GPU, in one call on a machine with a CUDA device:
#
#   bash benchmarks/device_verdict.sh OUT_DIR [ROUNDS] [MODEL]
#
# In this order, each part under its own time limit:
#   1. the GPU tests (pytest -m gpu)                                           log.txt
#      then the speed check's own scatter: one executor a check against three (speed_check_spread.py)
#   2. ROUNDS (default 10) rounds of kvsim validate --backend cuda --model MODEL (default small:
#      about 27 s a round; llama-3.1-8b's steps, 20-40x longer, move less between minutes), each round the
#      right model, the profile biased by 1.2x and the row-count terms removed, in turn; the
#      first half of the rounds start with an empty profile cache (benchmarks/validate_runs.py)
#                                                                              verdict.md
#   3. kvsim validate --backend cuda --model small-moe, then small-mla, if time is left
# VARIANTS (default: the three above) picks the variants of a round, e.g. VARIANTS="right= bias=--perturb-profile=1.2"
# where the device time allows only two; CHECKS (default 8; 0: none) the speed checks of each setting in part 1;
# TESTS=0 leaves out the GPU tests (when this tree's realexec already passed them on a GPU); FRESH (default
# ROUNDS / 2) the rounds that start from an empty profile cache.
# Every run's validation.json and log go into runs.tgz; summary.txt holds the tables.
set -u
OUT=${1:?usage: device_verdict.sh OUT_DIR [ROUNDS] [MODEL]}
ROUNDS=${2:-10}
MODEL=${3:-small}
BUDGET_S=${BUDGET_S:-540}  # the whole check
TAIL_S=${TAIL_S:-60}       # kept for the MoE and MLA runs whatever the rounds took
VARIANTS=${VARIANTS:-right= bias=--perturb-profile=1.2 norow=--no-row-count-terms}
CHECKS=${CHECKS:-8}
WORK=/tmp/device-verdict
. benchmarks/device_env.sh

if [ "${TESTS:-1}" != 0 ]; then
    part 60 "$TAIL_S" "GPU tests" python3 -m pytest -m gpu -x -p no:cacheprovider tests
    tail -n 3 "$LOG" | tee -a "$SUMMARY"
fi
if [ "$CHECKS" -gt 0 ]; then
    part 90 "$TAIL_S" "speed check spread" python3 benchmarks/speed_check_spread.py --backend cuda --model "$MODEL" --checks "$CHECKS"
    grep -A5 "^cuda (" "$LOG" | tee -a "$SUMMARY"
fi

left=$((BUDGET_S - (SECONDS - start) - TAIL_S))
say "verdict rounds: $ROUNDS, no run started past $((left - 25)) s"
python3 benchmarks/validate_runs.py --runs "$ROUNDS" --fresh-rounds ${FRESH:-$((ROUNDS / 2))} --out "$WORK/verdict" \
    --label gpu --deadline-s $((left - 25)) $(printf -- '--variant %s ' $VARIANTS) \
    -- --backend cuda --model "$MODEL" | tee "$OUT/verdict.md" | tee -a "$SUMMARY"

for model in small-moe small-mla; do
    part 60 0 "validate $model" kvsim validate --backend cuda --model "$model" --out "$WORK/$model"
    [ -f "$WORK/$model/validation.json" ] && checks "$WORK/$model"
done
(cd "$WORK" && tar czf "$OUT/runs.tgz" --exclude='*.html' --exclude='*.csv' --exclude='*.jsonl' --exclude=cache . 2>/dev/null)
say "done"
