#!/usr/bin/env bash
# Issue 28's training shapes on one GPU: lm=small's attention (8 query heads on 2 key/value heads, d = 64) at the
# three stages of train=needles32k that it names, 2k x 16, 8k x 4 and 32k x 1 sequences (32k tokens a step each).
#   STEPS="attn train" bash scripts/h100_train.sh
#     attn:  experiments.prefill at that shape: NSA (backend=triton, per branch) beside dense SDPA (cuDNN) and
#            FA-2; PROFILE=true adds the kernel tables (logged on each run as profile/*.txt)
#     train: experiments.train on needles32k's model, each stage alone for TRAIN_STEPS steps, NSA and dense:
#            tokens/s is the median of the logged windows (every LOG_EVERY steps, default 10; the first holds
#            the compilation); TRAIN_ARGS="train.compile=reduce-overhead" compiles both models
#   SHAPES: "seq:batch ..." (default "2048:16 8192:4 32768:1"); ATTN_ARGS / TRAIN_ARGS: overrides added to each step.
#   AB=.ab: as in scripts/h100_sel.sh (each step also on a copy of the tree with .ab/ laid over it).
set -u
source scripts/gpu_lib.sh
STEPS=${STEPS:-attn train}
SHAPES=${SHAPES:-2048:16 8192:4 32768:1}
SMALL="model.nsa.dim=512 model.nsa.n_heads=8 model.nsa.n_kv_heads=2 model.nsa.d_k=64 model.nsa.d_v=64 model.nsa.phi=avg"
for tt in "${trees[@]}"; do
  tree=${tt%%:*} tag=${tt#*:}
  for sb in $SHAPES; do
    S=${sb%%:*} B=${sb#*:}
    if has attn; then
      # shellcheck disable=SC2086  # SMALL and ATTN_ARGS hold several overrides
      run "${ATTN_S:-200}" "attn$tag" "$tree" python3 -- -m experiments.prefill hardware="$HW" model=h200bench $SMALL \
        model.batch="$B" seq="$S" backend=triton "prefill.peers=[]" prefill.profile="${PROFILE:-false}" \
        model.timing.warmup=5 model.timing.repeats=20 ${ATTN_ARGS:-}
    fi
    if has train; then
      gap=$(( S >= 32768 ? 2048 : S / 4 ))
      # shellcheck disable=SC2086
      run "${TRAIN_S:-240}" "train$tag" "$tree" python3 -- -m experiments.train hardware="$HW" train=needles32k \
        -m attention=nsa,dense "train.curriculum=[]" data.seq_len="$S" data.gap="$gap" train.batch="$B" \
        train.steps="${TRAIN_STEPS:-60}" train.log_every="${LOG_EVERY:-10}" train.eval_batches=0 train.ckpt_every="${TRAIN_STEPS:-60}" \
        train.warmup=10 train.time_limit_s=200 ${TRAIN_ARGS:-}
    fi
  done
done
exit 0
