#!/usr/bin/env bash
# Issue 30's context-parallel figures on a host with N GPUs (the device tool's nvidia-h100-x2/-x4), no network.
# Needs the wheelhouse (python scripts/wheelhouse.py --dest .whl). Runs go to $OUT/<step>.db (MLflow).
#   STEPS="parity cp one" NGPU=2 bash scripts/h100_cp.sh
#     parity: torchrun experiments.parity parallel.cp=NGPU parity.batch=1 at PARITY_SEQ (default 131072): cp_max_rel_err,
#             the output and every gradient against the one-device run of the same backends, bf16
#     cp:     torchrun experiments.prefill parallel.cp=NGPU at CP_SEQS (default 131072 262144 524288): per-rank
#             fwd and fwd+bwd, the all-gather's share, peak memory (CP_TIMEOUT seconds each, default 200)
#     one:    experiments.prefill on one GPU at ONE_SEQS (default 131072 262144 524288), NSA and dense cuDNN,
#             the baseline of the scaling efficiency (a length one GPU cannot hold fails with its message)
#     slurm:  the SLURM per_gpu launcher from the .deb files carried in .debs (scripts/cluster.sh fetch .debs;
#             .debs/wheels: submitit, hydra-submitit-launcher, cloudpickle): unpack, up --prefix, the README's
#             4-job prefill sweep (SLURM_SEQS), down; the daemons' logs into $OUT/slurm_logs.tgz
set -u
source scripts/gpu_lib.sh
STEPS=${STEPS:-parity cp one}
NGPU=${NGPU:-2}
COMMON=(hardware="$HW" model=h200bench backend=triton model.timing.warmup=2 model.timing.repeats=5)
TR=(torchrun --standalone --nproc_per_node "$NGPU")
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
if has parity; then
  run 240 parity "$PWD" "${TR[@]}" -- -m experiments.parity parallel.cp="$NGPU" "${COMMON[@]}" parity.batch=1 seq="${PARITY_SEQ:-131072}"
  grep -hE "cp_max_rel_err|cp_.*_rel_l2_err" "$OUT/log.txt" | tail -n 12
fi
if has cp; then
  for S in ${CP_SEQS:-131072 262144 524288}; do
    run "${CP_TIMEOUT:-200}" cp "$PWD" "${TR[@]}" -- -m experiments.prefill parallel.cp="$NGPU" "${COMMON[@]}" seq="$S"
  done
fi
if has one; then
  for S in ${ONE_SEQS:-131072 262144 524288}; do
    CUDA_VISIBLE_DEVICES=0 run 240 one "$PWD" python3 -- -m experiments.prefill "${COMMON[@]}" prefill.per_branch=false \
      prefill.dense_flash=false "prefill.peers=[]" seq="$S"
  done
fi
if has slurm; then
  install_wheels .debs/wheels/*.whl
  if scripts/cluster.sh unpack .debs /tmp/slurm >/dev/null && scripts/cluster.sh up --prefix /tmp/slurm --no-tracking --dir /tmp/cl; then
    # shellcheck disable=SC1091
    . /tmp/cl/slurm.env
    run 420 slurm "$PWD" python3 -- -m experiments.prefill -m hydra/launcher=per_gpu hardware="$HW" \
      model=h200bench backend=triton seq="${SLURM_SEQS:-8192,16384,32768,65536}"
    grep -h "jobs ran on\|at once" "$OUT/log.txt" | tail -n 2
    sacct -X --format=JobID,State,Elapsed,AllocTRES%40 | tail -n 6
  fi
  scripts/cluster.sh down --dir /tmp/cl
  tar czf "$OUT/slurm_logs.tgz" -C /tmp/cl slurm/log $(cd /tmp/cl 2>/dev/null && ls mariadb/*.log munge/private/*.log 2>/dev/null)
fi
exit 0
