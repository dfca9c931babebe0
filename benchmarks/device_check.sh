#!/usr/bin/env bash
# The GPU check, in one call on a machine with a CUDA device (docs/benchmarks.md, "Validation on a GPU"):
#
#   bash benchmarks/device_check.sh OUT_DIR [MODEL]
#
# In this order, each part under its own time limit so that one stuck part cannot eat the next:
#   1. the GPU tests (pytest -m gpu)                                   log.txt
#   2. kvsim doctor --backend cuda                                     log.txt
#   3. kvsim validate --backend cuda, small model, eager then graphs   small-eager.json, small-graphs.json
#   4. MODEL (default llama-3.1-8b) in bf16: kvsim execute eager and with graphs (the decode
#      steps' host share), then kvsim validate with graphs (a --quick profile measured on the
#      spot, then the default workload: 64 blocks of 16 tokens)        big.json, big-profile.toml
# Every table is printed and everything goes to OUT_DIR/log.txt; summary.txt holds the tables.
set -u
OUT=${1:?usage: device_check.sh OUT_DIR [MODEL]}
MODEL=${2:-llama-3.1-8b}
BUDGET_S=${BUDGET_S:-560}  # the whole check; the model-sized validation keeps BIG_S of it whatever ran before
BIG_S=${BIG_S:-250}
WORK=/tmp/device-check
. benchmarks/device_env.sh

part 100 "$BIG_S" "GPU tests" python3 -m pytest -m gpu -x -p no:cacheprovider tests
tail -n 3 "$LOG" | tee -a "$SUMMARY"
part 30 "$BIG_S" "doctor" kvsim doctor --backend cuda

for mode in eager graphs; do
    flag=$([ "$mode" = eager ] && echo --enforce-eager)
    if part 80 "$BIG_S" "validate small $mode" kvsim validate --backend cuda $flag --out "$WORK/small-$mode"; then :; fi
    [ -f "$WORK/small-$mode/validation.json" ] && cp "$WORK/small-$mode/validation.json" "$OUT/small-$mode.json" && checks "$WORK/small-$mode"
done

for mode in eager graphs; do
    flag=$([ "$mode" = eager ] && echo --enforce-eager)
    part 45 "$BIG_S" "execute $MODEL $mode" kvsim execute --backend cuda --model "$MODEL" $flag --quiet --out "$WORK/execute-$mode"
done
if [ -f "$WORK/execute-eager/steps.csv" ] && [ -f "$WORK/execute-graphs/steps.csv" ]; then
    python3 benchmarks/graph_vs_eager.py "$WORK/execute-eager" "$WORK/execute-graphs" | tee -a "$SUMMARY"
fi

part 300 0 "validate $MODEL graphs" kvsim validate --backend cuda --model "$MODEL" --out "$WORK/big"
[ -f "$WORK/big/validation.json" ] && cp "$WORK/big/validation.json" "$OUT/big.json" && checks "$WORK/big"
cp "$KVSIM_CACHE"/profiles/cuda-"$MODEL"-*graphs*.toml "$OUT/big-profile.toml" 2>/dev/null
say "done"
