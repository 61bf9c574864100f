#!/usr/bin/env bash
# Issue 29's ablations on one GPU (the device tool's nvidia-h100-x1), the needle task of train=needles_smoke
# (lm=smoke, 256 tokens, fp32, reference backend) run STEPS_N steps, the sweeps side by side (each its own
# MLflow store $OUT/<name>.db): the paper's choices (P) and the preset's switches (S), each under
# train.ablation.selection=topn,full,oracle; P under train.ablation.branches=[cmp],[sel],[win]; P with the
# full selection and the selected branch alone; dense.
#   STEPS_N=1000 bash scripts/h100_ablations.sh
set -u
source scripts/gpu_lib.sh
N=${STEPS_N:-1000}
BASE=(hardware="$HW" dtype=float32 train=needles_smoke train.steps="$N" train.ckpt_every="$N" train.eval_every=100
      train.time_limit_s="${LIMIT_S:-170}")
P=(lm.nsa.shared_kv=false lm.nsa.phi=mlp lm.nsa.n_sel=4 train.gates_open_steps=0)
export OMP_NUM_THREADS=2
T=${T_SWEEP:-560}
run "$T" p_selection "$PWD" python3 -- -m experiments.train -m attention=nsa "${BASE[@]}" "${P[@]}" \
  train.ablation.selection=topn,full,oracle &
run "$T" p_branches "$PWD" python3 -- -m experiments.train -m attention=nsa "${BASE[@]}" "${P[@]}" \
  "train.ablation.branches=[cmp],[sel],[win]" &
run "$T" s_selection "$PWD" python3 -- -m experiments.train -m attention=nsa "${BASE[@]}" \
  train.ablation.selection=topn,full,oracle &
run "$T" p_full_sel "$PWD" python3 -- -m experiments.train -m attention=nsa,dense "${BASE[@]}" "${P[@]}" \
  "train.ablation.branches=[sel]" train.ablation.selection=full &
wait
exit 0
