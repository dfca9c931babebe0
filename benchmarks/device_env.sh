# Sourced by the device scripts (device_check.sh, device_verdict.sh) once OUT, WORK and BUDGET_S
# are set: the clock, log.txt and summary.txt under OUT, their logging and time-limited parts,
# then kvsim installed on a bare lent machine. Python packages the machine lacks (simpy,
# plotly) come as wheels in .whl/ beside the tree (the device tool's README says how); kvsim
# installs without build isolation (no index there).
start=$SECONDS
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 KVSIM_CACHE=/tmp/kvsim-cache
LOG="$OUT/log.txt"
SUMMARY="$OUT/summary.txt"

say() { echo "== $* ($((SECONDS - start)) s)" | tee -a "$LOG" "$SUMMARY"; }
part() {  # part LIMIT_S RESERVE_S NAME COMMAND...: run within LIMIT_S and what the budget leaves past RESERVE_S
    local limit=$1 reserve=$2 name=$3; shift 3
    local left=$((BUDGET_S - (SECONDS - start) - reserve))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 5 ] && { say "$name: skipped, no time left"; return 124; }
    say "$name (limit $limit s)"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    say "$name: exit $rc"
    return $rc
}
checks() {  # checks RUN_DIR: the checks table a validate run printed, into the summary
    python3 - "$1" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from kvsim.cli.validate import format_checks
print(format_checks(json.load(open(sys.argv[1] + "/validation.json"))))
EOF
}

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || { say "install failed"; exit 1; }
if ! command -v kvsim >/dev/null; then  # the console script went where PATH does not look
    mkdir -p "$WORK/bin"
    printf '#!/bin/sh\nexec python3 -c "import sys; from kvsim.cli.main import run; sys.argv[0] = \\"kvsim\\"; run()" "$@"\n' >"$WORK/bin/kvsim"
    chmod +x "$WORK/bin/kvsim"
    export PATH="$WORK/bin:$PATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$LOG" "$SUMMARY"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG" "$SUMMARY"

