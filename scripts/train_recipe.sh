#!/usr/bin/env bash
# Issue 42's recipe on the GPUs of one host: training runs side by side, each pinned to one GPU
# (CUDA_VISIBLE_DEVICES, round robin) into its own MLflow store $OUT/runs/<name>.db; at the end
# `scripts/train_summary.py` prints one row per run and writes $OUT/summary.csv, and the stores go
# into $OUT/runs.tar.gz.
#   JOBS=<file> bash scripts/train_recipe.sh
# JOBS: one job a line, "<name> <overrides...>" (overrides of `python -m experiments.train`, hardware and
# tracking added here); lines starting with # are skipped. LIMIT_S: each job's timeout (default 540).
set -u
source scripts/gpu_lib.sh
mkdir -p "$OUT/runs"
NGPU=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
i=0
while read -r name args; do
  case "$name" in ''|'#'*) continue;; esac
  gpu=$(( i % NGPU )); i=$(( i + 1 ))
  # shellcheck disable=SC2086  # args holds several overrides
  (PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=$gpu timeout "${LIMIT_S:-540}" python3 -m experiments.train \
     hardware="$HW" $args "tracking.uri=sqlite:///$OUT/runs/$name.db" hydra.run.dir="/tmp/runs/$name" \
     >"/tmp/runs_$name.log" 2>&1; echo "$name exit $?" >>"$OUT/exits.txt") &
done <"$JOBS"
wait
PYTHONPATH=/tmp/site python3 scripts/train_summary.py "$OUT/runs" --csv "$OUT/summary.csv"
tail -n 3 /tmp/runs_*.log >"$OUT/tails.txt" 2>&1
tar -czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$OUT/runs"
cat "$OUT/exits.txt"
