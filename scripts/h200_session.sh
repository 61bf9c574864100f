#!/usr/bin/env bash
# One device call on a GPU host without network (the H200 box): install the carried wheelhouse
# (python scripts/wheelhouse.py --dest .whl [--peers]), then run prefill, decode and parity (and, in STEPS,
# kernels) into an MLflow store under $OUT (default ./gpu_out). Each step has its own time limit; a step
# that fails is logged.
#   bash scripts/h200_session.sh            (SEQS=65536 STEPS="prefill parity" bash ... for a subset;
#                                             PREFILL_ARGS="backend.win=triton,fa2" adds overrides/sweeps;
#                                             STEPS=kernels OPS=selection,compressed KERNELS_ARGS=... the ops;
#                                             STEPS=validate [HW=h200|h100] experiments.validate, its report in
#                                             $OUT/validate; STEPS=diag: scripts/gpu_diag.py sel, compile, varlen;
#                                             STEPS=train [TRAIN=needles32k ATTN=nsa,dense] experiments.train;
#                                             STEPS=groups: whole NSA prefill at G = 1, 2, 4, 8, 16)
set -u
# The hardware profile: auto (the profile matching the card found: the device tool may lend an H100 for
# an H200 call) unless HW names one, which must then match the card.
HW=${HW:-auto}
source scripts/gpu_lib.sh
export PYTHONPATH=/tmp/site:$PWD
TRK="tracking.uri=sqlite:///$OUT/mlflow.db"
SEQS=${SEQS:-8192,16384,32768,65536}
# step <seconds> args...: python3 args, the output's last 30 lines printed, all of it in $OUT/log.txt
step() { local t=$1; shift; echo "== $*"; timeout "$t" python3 "$@" 2>&1 | grep -v "INFO mlflow" | tee -a "$OUT/log.txt" | tail -n 30; }
STEPS=${STEPS:-prefill decode parity}  # any subset, e.g. STEPS=prefill
has prefill && step "${T_PREFILL:-170}" -m experiments.prefill -m hardware="$HW" model=h200bench backend=triton "$TRK" seq="$SEQS" \
    model.timing.warmup=2 model.timing.repeats=8 ${PREFILL_ARGS:-}
has decode && step "${T_DECODE:-130}" -m experiments.decode -m hardware="$HW" model=h200bench backend=triton "$TRK" seq="$SEQS" \
    model.batch=64 model.timing.warmup=5 model.timing.repeats=50
has kernels && step "${T_KERNELS:-500}" -m experiments.kernels -m hardware="$HW" "$TRK" seq="$SEQS" \
    op="${OPS:-selection,compressed,topn,window,gate,layer,decode}" ${KERNELS_ARGS:-}
has validate && step "${T_VALIDATE:-560}" -m experiments.validate hardware="$HW" "$TRK" "hydra.run.dir=$OUT/validate" \
    ${VALIDATE_ARGS:-}
has train && step "${T_TRAIN:-570}" -m experiments.train hardware="$HW" train="${TRAIN:-needles32k}" "$TRK" \
    -m attention="${ATTN:-nsa,dense}" ${TRAIN_ARGS:-}
# the small-group table: whole NSA at HQ=64 on H = 64..4 key/value heads (G = 1..16), one process per job
has groups && step "${T_GROUPS:-420}" -m experiments.prefill -m hardware="$HW" model=h200bench backend=triton "$TRK" \
    seq="${GROUP_SEQS:-16384,65536}" model.nsa.n_kv_heads=64,32,16,8,4 prefill.per_branch=false \
    prefill.dense_flash=false "prefill.peers=[]" model.timing.warmup=2 model.timing.repeats=8
for part in sel compile varlen; do has diag && PYTHONPATH=tests step "${T_DIAG:-150}" scripts/gpu_diag.py $part; done
has parity && step "${T_PARITY:-100}" -m experiments.parity -m hardware="$HW" model=h200bench backend=triton "$TRK" seq="${PARITY_SEQS:-8192}" parity.batch=1
tar czf "$OUT/runs.tgz" --exclude="*.pt" outputs multirun mlruns 2>/dev/null  # at most 8 files come back: one archive (no checkpoints)
ls -la "$OUT"
