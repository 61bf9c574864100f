#!/usr/bin/env bash
# Issue 28: the compressed branch on its two designs (triton two-pass, cudnn fold + triton scores) on one GPU.
#   STEPS="probe layer" bash scripts/h100_cmp.sh
#     probe: scripts/cmp_cudnn_probe.py (checks against a float32 reference, branch timings and parts) at PROBE_SEQS
#     layer: the whole layer, backend.cmp=triton,cudnn at SEQS (dense cuDNN in the same runs)
#     peers: the whole layer beside flash_nsa (experiments/peers.py; its flash_nsa directory carried in .peers/,
#            copied onto the path), backend=triton backend.cmp=triton,cudnn at PEER_SEQS, one window kernel (triton)
#     profile: the ceilings (scripts/ceilings.py) and the kernel tables of one 64k layer call with backend.cmp=cudnn
#            (prefill.profile=true; the tables in $OUT/log.txt)
#     tests: the compiled kernel tests (TESTS, default tests/test_kernels_gpu.py: every branch to 128k, the cudnn
#            compressed branch among them; pytest-xdist's -n 3 where the box has it)
set -u
source scripts/gpu_lib.sh
STEPS=${STEPS:-probe layer}
SEQS=${SEQS:-8192,65536}
if has probe; then
  PYTHONPATH=/tmp/site:$PWD timeout "${PROBE_S:-300}" python3 scripts/cmp_cudnn_probe.py --seqs "${PROBE_SEQS:-8192,16384,32768,65536}" \
    --shapes "${PROBE_SHAPES:-64x4x128}" >"$OUT/probe.txt" 2>&1; echo "probe exit $?"; tail -n 25 "$OUT/probe.txt"
fi
has layer && run "${LAYER_S:-280}" layer "$PWD" python3 -- -m experiments.prefill hardware="$HW" model=h200bench backend=triton \
  prefill.dense_flash=false "prefill.peers=[]" model.timing.warmup=2 model.timing.repeats=8 prefill.per_branch=false \
  -m seq="$SEQS" backend.cmp="${CMP:-triton,cudnn}"
if has peers; then
  cp -r .peers/flash_nsa /tmp/site/ 2>/dev/null || echo "no .peers/flash_nsa: the flash_nsa row is skipped"
  PYTHONPATH=/tmp/site python3 -c "import pkg_resources, pandas" 2>&1 | tail -n 1
  run "${PEERS_S:-540}" peers "$PWD" python3 -- -m experiments.prefill hardware="$HW" model=h200bench backend=triton \
    "prefill.peers=[flash_nsa]" prefill.dense_flash=false prefill.per_branch=false model.timing.warmup=2 \
    model.timing.repeats=8 -m seq="${PEER_SEQS:-8192,16384,32768,65536}" backend.cmp="${CMP:-triton,cudnn}"
fi
if has profile; then
  PYTHONPATH=/tmp/site:$PWD python3 scripts/ceilings.py
  SUMMARY='^#  ' run "${PROFILE_S:-300}" profile "$PWD" python3 -- -m experiments.prefill hardware="$HW" model=h200bench \
    backend=triton backend.cmp="${CMP:-cudnn}" prefill.dense_flash=false "prefill.peers=[]" prefill.per_branch=false \
    prefill.profile=true seq="${PROFILE_SEQ:-65536}"
fi
if has tests; then
  xd=(); python3 -c "import xdist" 2>/dev/null && xd=(-n 3 --dist loadgroup)
  PYTHONPATH=/tmp/site:$PWD timeout "${TEST_S:-540}" python3 -m pytest -q -rfEs -m gpu ${TESTS:-tests/test_kernels_gpu.py} \
    "${xd[@]}" --durations=12 >"$OUT/tests.txt" 2>&1; echo "pytest exit $?"; tail -n 40 "$OUT/tests.txt"
fi
exit 0
