#!/usr/bin/env bash
# Issue 27's decode figures, on a GPU host without network (the device tool's H100/H200 boxes). Needs the
# wheelhouse (python scripts/wheelhouse.py --dest .whl). Each step's runs go to $OUT/<step>.db (MLflow).
#   STEPS=card OLD=<checkout of an earlier commit> bash scripts/h100_decode_card.sh
#     card:    the design card's command as typed (no backend named: backend=auto) for model=tiny, then the
#              same for bench4090 and h200bench, at seq=512..4096; with OLD, the card's command from OLD first
#              (before/after in one call, same card)
#     long:    model=h200bench, B=1, seq=8k..64k
#     serving: model=h200bench at 4 GiB of K/V per branch: B=256 at 8k, B=32 at 64k
#     ragged:  model=h200bench, decode.ragged=true (lengths in [seq/2, seq]), B=8 at 8k and B=32 at 64k
#     tests:   the compiled decode tests (tests/test_decode_gpu.py)
# HW (default h100, as the card says) names the hardware profile; HW=auto takes the card found.
set -u
SUMMARY='^#  seq'
source scripts/gpu_lib.sh
STEPS=${STEPS:-card}
if has card; then
  [ -n "${OLD:-}" ] && run 240 before "$OLD" python3 -- -m experiments.decode hardware="$HW" -m seq=512,1024,2048,4096
  for M in tiny bench4090 h200bench; do
    run 200 card "$PWD" python3 -- -m experiments.decode hardware="$HW" model=$M -m seq=512,1024,2048,4096
  done
fi
has long && run 240 long "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench -m seq=8192,16384,32768,65536
if has serving; then
  run 200 serving "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.batch=256 seq=8192
  run 200 serving "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.batch=32 seq=65536
fi
if has ragged; then
  run 200 ragged "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.ragged=true decode.batch=8 seq=8192
  run 200 ragged "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.ragged=true decode.batch=32 seq=65536
fi
has tests && (PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu tests/test_decode_gpu.py 2>&1 \
  | grep -E "passed|failed|Error|^E " | tail -n 12)
exit 0
