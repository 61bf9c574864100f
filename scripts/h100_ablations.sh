#!/usr/bin/env bash
# Issue 29's ablations on one GPU (the device tool's nvidia-h100-x1): the needle task of train=needles_smoke
# (lm=smoke, 256 tokens, fp32, reference backend) for STEPS_N steps, the sweeps side by side, each into its own
# MLflow store $OUT/<name>.db. P: the paper's choices (one projection per branch, phi = MLP, n_sel = 4, free
# gates); S: the preset's switches.
#   STEPS="p_selection p_branches s_selection p_full_sel" STEPS_N=1000 bash scripts/h100_ablations.sh
#     p_selection: P under train.ablation.selection=topn,full,oracle   p_branches: P, branches [cmp],[sel],[win]
#     s_selection: S under the three selections                         p_full_sel: P, full selection, [sel] alone; dense
#     p_switches:  P with shared_kv x phi (2 x 2)                       p_nsel_gates: P with n_sel=8; gates held 0 / 300
#     p_seed1:     P topn and oracle, and dense, on seed 1
set -u
source scripts/gpu_lib.sh
STEPS=${STEPS:-p_selection p_branches s_selection p_full_sel}
N=${STEPS_N:-1000}
BASE=(hardware="$HW" dtype=float32 train=needles_smoke train.steps="$N" train.ckpt_every="$N" train.eval_every=100
      train.time_limit_s="${LIMIT_S:-170}")
P=(lm.nsa.shared_kv=false lm.nsa.phi=mlp lm.nsa.n_sel=4 train.gates_open_steps=0)
export OMP_NUM_THREADS=2
T=${T_SWEEP:-560}
sweep() { local name=$1; shift; has "$name" && run "$T" "$name" "$PWD" python3 -- -m experiments.train -m "$@" & }
sweep p_selection attention=nsa "${BASE[@]}" "${P[@]}" train.ablation.selection=topn,full,oracle
sweep p_branches attention=nsa "${BASE[@]}" "${P[@]}" "train.ablation.branches=[cmp],[sel],[win]"
sweep s_selection attention=nsa "${BASE[@]}" train.ablation.selection=topn,full,oracle
sweep p_full_sel attention=nsa,dense "${BASE[@]}" "${P[@]}" "train.ablation.branches=[sel]" train.ablation.selection=full
sweep p_switches attention=nsa "${BASE[@]}" "${P[@]}" lm.nsa.shared_kv=false,true lm.nsa.phi=mlp,avg
sweep p_nsel_gates attention=nsa "${BASE[@]}" "${P[@]}" lm.nsa.n_sel=8 train.gates_open_steps=0,300
sweep p_seed1 attention=nsa,dense "${BASE[@]}" "${P[@]}" train.ablation.selection=topn,oracle seed=1
wait
exit 0
