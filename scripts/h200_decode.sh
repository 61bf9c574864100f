#!/usr/bin/env bash
# Decode sweeps on the H200 box (no network): B=64 and B=1 at the paper's lengths, and the earlier
# codebase's bench shape at 512..4096. Needs the wheelhouse (python scripts/wheelhouse.py --dest .whl).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  || { echo "wheelhouse install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true  # the box has no network
case "$OUT" in /*) TRK="tracking.uri=sqlite:///$OUT/mlflow.db";; *) TRK="tracking.uri=sqlite:///$PWD/$OUT/mlflow.db";; esac
run() { echo "== $*"; timeout 100 python3 "$@" 2>&1 | grep -v "INFO mlflow" | tee -a "$OUT/log.txt" | grep -E "FINISHED|FAILED|\] (nsa|layer|dense|sel|cmp|win):" ; }
for B in 64 1; do
  run -m experiments.decode -m hardware=h200 model=h200bench backend=triton "$TRK" seq=8192,16384,32768,65536 \
      model.batch=$B model.timing.warmup=5 model.timing.repeats=100
done
run -m experiments.decode -m hardware=h200 model=bench4090 backend=triton "$TRK" seq_len=smoke \
    model.timing.warmup=5 model.timing.repeats=100
tar czf "$OUT/runs.tgz" outputs 2>/dev/null
