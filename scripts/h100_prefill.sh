#!/usr/bin/env bash
# Issue 27's prefill figures and the compiled checks, on a GPU host without network (the device tool's
# H100/H200 boxes). Needs the wheelhouse (python scripts/wheelhouse.py --dest .whl). Runs go to $OUT/<step>.db.
#   STEPS="layer profile selection" OLD=<checkout of an earlier commit> bash scripts/h100_prefill.sh
#     layer:     the whole layer at 8k and 64k (per_branch=false), from OLD first when given (before/after,
#                one call, same card), dense cuDNN in the same runs
#     profile:   8k, each branch alone and the kernel tables (prefill.profile=true)
#     ops:       each branch's kernels alone (OPS_OPS, default compressed,window,selection) at SEQS, from OLD first when given
#     selection: the selected branch alone at 8k and 64k, variants SEL_SWEEP (default both kernel families,
#                tuning.selection.mode=query,block; e.g. SEL_SWEEP="tuning.selection.stages=2,3")
#     tests:     the compiled compile/decode tests (tests/test_compile_gpu.py, tests/test_decode_gpu.py)
# HW (default h100) names the hardware profile; SEQS (default 8192,65536) the layer step's lengths.
set -u
source scripts/gpu_lib.sh
STEPS=${STEPS:-layer}
SEQS=${SEQS:-8192,65536}
LAYER=(-m experiments.prefill hardware="$HW" model=h200bench backend=triton prefill.dense_flash=false "prefill.peers=[]"
       model.timing.warmup=2 model.timing.repeats=8 prefill.per_branch=false -m seq="$SEQS")
if has layer; then
  [ -n "${OLD:-}" ] && run 280 before "$OLD" python3 -- "${LAYER[@]}"
  run 280 layer "$PWD" python3 -- "${LAYER[@]}"
fi
OPS=(-m experiments.kernels hardware="$HW" model=h200bench kernels.peers=false -m op="${OPS_OPS:-compressed,window,selection}"
     seq="$SEQS")
if has ops; then
  [ -n "${OLD:-}" ] && run 280 ops_before "$OLD" python3 -- "${OPS[@]}"
  run 280 ops "$PWD" python3 -- "${OPS[@]}"
fi
has profile && run 200 profile "$PWD" python3 -- -m experiments.prefill hardware="$HW" model=h200bench backend=triton \
  prefill.dense_flash=false "prefill.peers=[]" prefill.profile=true seq=8192
has selection && run 200 selection "$PWD" python3 -- -m experiments.kernels hardware="$HW" model=h200bench op=selection \
  kernels.peers=false -m seq=8192,65536 ${SEL_SWEEP:-tuning.selection.mode=query,block}
if has tests; then
  PYTHONPATH=/tmp/site:$PWD timeout "${TEST_S:-400}" python3 -m pytest -q -m gpu tests/test_compile_gpu.py \
    tests/test_decode_gpu.py >"$OUT/tests.txt" 2>&1; echo "pytest exit $?"; tail -n 15 "$OUT/tests.txt"
fi
exit 0
