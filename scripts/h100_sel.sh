#!/usr/bin/env bash
# Issue 28: the selected branch's kernels on one GPU, beside their gather floor and flash_nsa's select_attn.
#   STEPS="kernels" bash scripts/h100_sel.sh
#     kernels: experiments.kernels op=OP (default selection) at SEQS, a sweep of launch parameters (SWEEP, Hydra -m
#              overrides; default the query-outer warps); op=selection's rows: triton, gather_floor (the forward's
#              loads alone) and flash_nsa (its directory carried in .peers/, copied onto the path)
#     layer:   the whole layer beside flash_nsa (backend=triton, backend.cmp=CMP) at LAYER_SEQS, with LAYER_SWEEP
#   AB=.ab: each step also runs on a copy of the tree with the files under .ab/ laid over it (the same relative
#   paths), first: a before/after in one call. Make it with, e.g.
#     mkdir -p .ab/nsa/backends/triton && git show <rev>:nsa/backends/triton/selection.py > .ab/nsa/backends/triton/selection.py
#   (.ab/ is carried as an untracked directory; delete it after). Databases: <step>_base.db and <step>.db.
set -u
source scripts/gpu_lib.sh
STEPS=${STEPS:-kernels}
cp -r .peers/flash_nsa /tmp/site/ 2>/dev/null || echo "no .peers/flash_nsa: the flash_nsa rows are skipped"
for tt in "${trees[@]}"; do
  tree=${tt%%:*} tag=${tt#*:}
  if has kernels; then
    # shellcheck disable=SC2086  # SWEEP holds several overrides
    run "${KERNELS_S:-480}" "kernels$tag" "$tree" python3 -- -m experiments.kernels hardware="$HW" model=h200bench \
      op="${OP:-selection}" -m seq="${SEQS:-8192,65536}" ${SWEEP:-tuning.selection.warps=1,2,4}
  fi
  if has layer; then
    # shellcheck disable=SC2086
    run "${LAYER_S:-540}" "layer$tag" "$tree" python3 -- -m experiments.prefill hardware="$HW" model=h200bench \
      backend=triton "prefill.peers=[flash_nsa]" prefill.dense_flash=false prefill.per_branch=false \
      model.timing.warmup=2 model.timing.repeats=8 backend.cmp="${CMP:-triton}" -m seq="${LAYER_SEQS:-8192,65536}" ${LAYER_SWEEP:-}
  fi
done
exit 0
