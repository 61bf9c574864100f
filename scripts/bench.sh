#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, by named step, on a GPU host without network (the device tool's boxes):
#   bash scripts/bench.sh --list                  the steps, one line each
#   [VAR=value ...] bash scripts/bench.sh <step> [<step> ...]
#   [VAR=value ...] bash scripts/bench.sh --print <step> [...]   the commands the steps run, without running them
# Needs the wheelhouse (python scripts/wheelhouse.py --dest .whl; scripts/gpu_lib.sh installs it). Each step's
# runs go to the MLflow store $OUT/<db>.db (OUT default ./gpu_out), the whole log to $OUT/log.txt, and
# $OUT/runs.tgz holds the outputs folders (the device tool brings few files back).
# HW (default auto: the profile of the card found) names the hardware profile; HW=h100 must match the card.
# OLD=<checkout> (decode-card, prefill-layer, prefill-ops) runs the same command from OLD first; AB=<folder>
# (sel-*, train-*) also runs each step on a copy of this tree with the files under <folder> laid over it (the
# same relative paths), first: a before/after in one call, e.g.
#   mkdir -p .ab/nsa/backends/triton && git show <rev>:nsa/backends/triton/selection.py > .ab/nsa/backends/triton/selection.py
# The variables each step reads (sequence lengths, sweeps, time limits) are named in its description.
set -u

# name|description (the --list table; a step is the function step_<name> with - as _)
STEPS_TABLE='decode-card|the design card'"'"'s decode command (backend=auto) for model=tiny, bench4090, h200bench at seq 512..4096; OLD: before/after
decode-long|decode, model=h200bench, B=1, seq 8k..64k
decode-serving|decode, model=h200bench at 4 GiB of K/V per branch: B=256 at 8k, B=32 at 64k
decode-ragged|decode, model=h200bench, decode.ragged=true: B=8 at 8k, B=32 at 64k
decode-b64|decode sweep, model=h200bench backend=triton, B=64 at SEQS (default 8k..64k), 50 repeats
decode-paper|decode sweeps, model=h200bench backend=triton, B=64 and B=1 at 8k..64k, and model=bench4090 at seq_len=smoke, 100 repeats
decode-tests|the compiled decode tests (tests/test_decode_gpu.py)
prefill|prefill sweep, model=h200bench backend=triton, both dense baselines, at SEQS (default 8k..64k); PREFILL_ARGS adds overrides
prefill-layer|the whole prefill layer (per_branch=false) at SEQS (default 8192,65536), dense cuDNN in the same runs; OLD: before/after
prefill-replay|the whole layer (per_branch=false) at SEQS (default 8192,65536) on the top-n of random inputs and on INDICES (the selections file of a train.save_selections=true run, e.g. train=text8k'"'"'s selections/layer3.pt), dense cuDNN and FlashAttention-2 in the same runs; then scripts/gpu_diag.py replay INDICES at SEQS (the selected branch on the trained selections as saved, sorted, shared by 64 / 512 queries, one set for all, against random; the layer with the indices range-checked every call and once)
prefill-ops|each branch'"'"'s kernels alone (experiments.kernels op=OPS_OPS, default compressed,window,selection) at SEQS (default 8192,65536); OLD: before/after
prefill-profile|prefill at 8k, each branch alone and the kernel tables (prefill.profile=true)
prefill-selection|the selected branch alone (experiments.kernels op=selection) at 8k and 64k over SEL_SWEEP (default tuning.selection.mode=query,block)
prefill-groups|the whole NSA prefill at HQ=64 on H = 64..4 key/value heads (G = 1..16) at GROUP_SEQS (default 16384,65536)
prefill-tests|the compiled compile and decode tests (tests/test_compile_gpu.py, tests/test_decode_gpu.py)
cmp-probe|scripts/cmp_cudnn_probe.py: the compressed branch on triton and cuDNN against a float32 reference, at PROBE_SEQS (default 8k..64k)
cmp-layer|the whole layer, backend.cmp=CMP (default triton,cudnn) at SEQS (default 8192,65536)
cmp-peers|the whole layer beside flash_nsa (its directory carried in .peers/), backend.cmp=CMP at PEER_SEQS (default 8k..64k)
cmp-profile|scripts/ceilings.py and the kernel tables of one layer call at PROFILE_SEQ (default 65536), backend.cmp=CMP (default cudnn)
cmp-tests|the compiled kernel tests (TESTS, default tests/test_kernels_gpu.py; -n 3 where pytest-xdist is installed)
sel-kernels|experiments.kernels op=OP (default selection) at SEQS (default 8192,65536) over SWEEP (default tuning.selection.warps=1,2,4), flash_nsa rows where .peers/ has it; AB: before/after
sel-layer|the whole layer beside flash_nsa, backend.cmp=CMP (default triton) at LAYER_SEQS (default 8192,65536) over LAYER_SWEEP; AB: before/after
train-attn|prefill at lm=small'"'"'s attention shape per SHAPES (seq:batch, default "2048:16 8192:4 32768:1"); PROFILE=true adds the kernel tables; ATTN_ARGS; AB
train-shapes|experiments.train needles32k, NSA and dense, each SHAPES stage alone for TRAIN_STEPS (default 60) steps; TRAIN_ARGS (e.g. train.compile=reduce-overhead); AB
train-fsdp|experiments.train needles32k'"'"'s 32k stage alone for FSDP_STEPS (default 100) steps, ATTN (default nsa,dense): one process, then the same under torchrun --nproc_per_node 1 (FSDP2, DCP, the sharded data path), REPEAT (default 2) times alternating; TRAIN_ARGS; AB: the torchrun rows before/after
train|experiments.train train=TRAIN (default needles32k) -m attention=ATTN (default nsa,dense); TRAIN_ARGS
train-jobs|experiments.train jobs side by side, one per line "<name> <overrides>" of the file JOBS (default scripts/train_jobs/recipe_seeds.txt), pinned to the GPUs round robin, each into $OUT/runs/<name>.db (LIMIT_S, default 540 s each); a table of them (scripts/train_summary.py) in $OUT/summary.csv
train-sweep|experiments.train -m TRAIN (default train=text8k) attention=ATTN (default nsa,dense) seed=SEEDS (default 0,1,2,3,4) on hydra/launcher=local_gpus, JOBS_PER_GPU (default 3) jobs sharing each GPU, one parent run in $OUT/train_sweep.db (the curves on one chart; LIMIT_S default 570 s); SWEEP_ARGS adds overrides
ablations|the needle ablations of train=needles_smoke side by side, ABLATIONS (default p_selection p_branches s_selection p_full_sel; also p_switches p_nsel_gates p_seed1), STEPS_N steps
kernels|experiments.kernels op=OPS (default every op) at SEQS (default 8k..64k); KERNELS_ARGS
parity|parity, model=h200bench backend=triton, B=1, at PARITY_SEQS (default 8192)
validate|experiments.validate, its report in $OUT/validate; VALIDATE_ARGS
diag|scripts/gpu_diag.py sel, compile and varlen
cp-parity|torchrun experiments.parity parallel.cp=NGPU (default 2) at PARITY_SEQ (default 131072) against one device
cp-prefill|torchrun experiments.prefill parallel.cp=NGPU at CP_SEQS (default "131072 262144 524288"), one job each
cp-one|experiments.prefill on one GPU at ONE_SEQS (default "131072 262144 524288"): the context-parallel baseline
hf-generate|experiments.generate: a 336M-parameter transformers Llama (random init) generating GEN_TOKENS (default 64) tokens after GEN_SEQS (default 8k..64k) of context, NSA (backend=triton, decode auto) and dense (SDPA), one sweep, and NSA on GEN_DECODES (e.g. graph,model_step: the same sweep on those decode paths) where set; then the NSA model'"'"'s tokens against backend=reference (float32, 256 + 32 tokens), and the compiled tests of generate'"'"'s decode paths (tests/test_hf_gpu.py)
cp-slurm|the SLURM per_gpu launcher from the .deb files carried in .debs: the README'"'"'s prefill sweep over SLURM_SEQS'

step_names() { cut -d'|' -f1 <<<"$STEPS_TABLE"; }

PRINT=false
[ "${1:-}" = "--print" ] && { PRINT=true; shift; }
case "${1:-}" in
  --list) column -t -s'|' <<<"$STEPS_TABLE" 2>/dev/null || tr '|' '\t' <<<"$STEPS_TABLE"; exit 0;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0;;  # the header
  "") echo "bench.sh: no step given; usage: bash scripts/bench.sh <step> [<step> ...] (--list names the steps)" >&2; exit 2;;
esac
for s in "$@"; do
  if ! step_names | grep -qxF -- "$s"; then
    echo "bench.sh: unknown step '$s'; one of: $(step_names | paste -sd' ') (--list describes them)" >&2
    exit 2
  fi
done

# py <seconds> <out file> args...: python3 args into $OUT/<out file>, its exit code and last lines printed
py() {
  local t=$1 f=$2; shift 2
  timeout "$t" python3 "$@" >"$OUT/$f" 2>&1; echo "$f: exit $?"; tail -n "${TAIL:-30}" "$OUT/$f"
}
peers_on_path() { cp -r .peers/flash_nsa /tmp/site/ 2>/dev/null || echo "no .peers/flash_nsa: the flash_nsa rows are skipped"; }
HW=${HW:-auto}
CLUSTER=scripts/cluster.sh
if $PRINT; then  # each command on one line, nothing run: no wheelhouse, no GPU
  OUT=${OUT:-gpu_out} trees=("$PWD:") CLUSTER="echo scripts/cluster.sh"
  run() {
    local db=$2 launcher=(); shift 3
    while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
    echo "${launcher[*]} $* tracking.uri=sqlite:///$OUT/$db.db"
  }
  py() { shift 2; echo "python3 $*"; }
  for c in python3 nvidia-smi sacct tar install_wheels peers_on_path; do eval "$c() { echo \"$c \$*\"; }"; done
else
  source scripts/gpu_lib.sh
fi
export PYTHONPATH=/tmp/site:$PWD
H200BENCH=(hardware="$HW" model=h200bench backend=triton)
LAYER_ONLY=(prefill.dense_flash=false "prefill.peers=[]" prefill.per_branch=false model.timing.warmup=2 model.timing.repeats=8)

step_decode_card() {
  local SUMMARY='^#  seq'  # the summary table's first line
  local M
  [ -n "${OLD:-}" ] && run 240 before "$OLD" python3 -- -m experiments.decode hardware="$HW" -m seq=512,1024,2048,4096
  for M in tiny bench4090 h200bench; do
    run 200 card "$PWD" python3 -- -m experiments.decode hardware="$HW" model=$M -m seq=512,1024,2048,4096
  done
}
step_decode_long() {
  local SUMMARY='^#  seq'  # the summary table's first line
  run 240 long "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench -m seq=8192,16384,32768,65536
}
step_decode_serving() {
  local SUMMARY='^#  seq'  # the summary table's first line
  run 200 serving "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.batch=256 seq=8192
  run 200 serving "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.batch=32 seq=65536
}
step_decode_ragged() {
  local SUMMARY='^#  seq'  # the summary table's first line
  run 200 ragged "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.ragged=true decode.batch=8 seq=8192
  run 200 ragged "$PWD" python3 -- -m experiments.decode hardware="$HW" model=h200bench decode.ragged=true decode.batch=32 seq=65536
}
step_decode_b64() {
  run "${T_DECODE:-130}" decode "$PWD" python3 -- -m experiments.decode "${H200BENCH[@]}" -m seq="${SEQS:-8192,16384,32768,65536}" \
    model.batch=64 model.timing.warmup=5 model.timing.repeats=50
}
step_decode_paper() {
  local B
  for B in 64 1; do
    run 100 decode_paper "$PWD" python3 -- -m experiments.decode "${H200BENCH[@]}" -m seq=8192,16384,32768,65536 model.batch=$B \
      model.timing.warmup=5 model.timing.repeats=100
  done
  run 100 decode_paper "$PWD" python3 -- -m experiments.decode hardware="$HW" model=bench4090 backend=triton -m seq_len=smoke \
    model.timing.warmup=5 model.timing.repeats=100
}
step_decode_tests() { py 200 decode_tests.txt -m pytest -q -m gpu tests/test_decode_gpu.py; }

step_prefill() {
  # shellcheck disable=SC2086  # PREFILL_ARGS holds several overrides
  run "${T_PREFILL:-170}" prefill "$PWD" python3 -- -m experiments.prefill "${H200BENCH[@]}" -m seq="${SEQS:-8192,16384,32768,65536}" \
    model.timing.warmup=2 model.timing.repeats=8 ${PREFILL_ARGS:-}
}
step_prefill_layer() {
  local layer=(-m experiments.prefill "${H200BENCH[@]}" "${LAYER_ONLY[@]}" -m seq="${SEQS:-8192,65536}")
  [ -n "${OLD:-}" ] && run 280 before "$OLD" python3 -- "${layer[@]}"
  run 280 layer "$PWD" python3 -- "${layer[@]}"
}
step_prefill_replay() {
  [ -n "${INDICES:-}" ] || { echo "prefill-replay: set INDICES=<selections file> (train.save_selections)"; return; }
  run "${T_REPLAY:-300}" replay "$PWD" python3 -- -m experiments.prefill "${H200BENCH[@]}" prefill.per_branch=false \
    "prefill.peers=[]" model.timing.warmup=2 model.timing.repeats=8 -m seq="${SEQS:-8192,65536}" prefill.indices="random,$INDICES"
  PYTHONPATH="tests:$PYTHONPATH" py "${T_DIAG:-150}" diag_replay.txt scripts/gpu_diag.py replay "$INDICES" "${SEQS:-8192,65536}"
}
step_prefill_ops() {
  local ops=(-m experiments.kernels hardware="$HW" model=h200bench kernels.peers=false -m op="${OPS_OPS:-compressed,window,selection}"
             seq="${SEQS:-8192,65536}")
  [ -n "${OLD:-}" ] && run 280 ops_before "$OLD" python3 -- "${ops[@]}"
  run 280 ops "$PWD" python3 -- "${ops[@]}"
}
step_prefill_profile() {
  run 200 profile "$PWD" python3 -- -m experiments.prefill "${H200BENCH[@]}" prefill.dense_flash=false "prefill.peers=[]" \
    prefill.profile=true seq=8192
}
step_prefill_selection() {
  # shellcheck disable=SC2086  # SEL_SWEEP holds several overrides
  run 200 selection "$PWD" python3 -- -m experiments.kernels hardware="$HW" model=h200bench op=selection kernels.peers=false \
    -m seq=8192,65536 ${SEL_SWEEP:-tuning.selection.mode=query,block}
}
step_prefill_groups() {
  run "${T_GROUPS:-420}" groups "$PWD" python3 -- -m experiments.prefill "${H200BENCH[@]}" -m seq="${GROUP_SEQS:-16384,65536}" \
    model.nsa.n_kv_heads=64,32,16,8,4 "${LAYER_ONLY[@]}"
}
step_prefill_tests() { TAIL=15 py "${TEST_S:-400}" prefill_tests.txt -m pytest -q -m gpu tests/test_compile_gpu.py tests/test_decode_gpu.py; }

step_cmp_probe() {
  TAIL=25 py "${PROBE_S:-300}" probe.txt scripts/cmp_cudnn_probe.py --seqs "${PROBE_SEQS:-8192,16384,32768,65536}" \
    --shapes "${PROBE_SHAPES:-64x4x128}"
}
step_cmp_layer() {
  run "${LAYER_S:-280}" layer "$PWD" python3 -- -m experiments.prefill "${H200BENCH[@]}" "${LAYER_ONLY[@]}" \
    -m seq="${SEQS:-8192,65536}" backend.cmp="${CMP:-triton,cudnn}"
}
step_cmp_peers() {
  peers_on_path
  run "${PEERS_S:-540}" peers "$PWD" python3 -- -m experiments.prefill "${H200BENCH[@]}" "prefill.peers=[flash_nsa]" \
    prefill.dense_flash=false prefill.per_branch=false model.timing.warmup=2 model.timing.repeats=8 \
    -m seq="${PEER_SEQS:-8192,16384,32768,65536}" backend.cmp="${CMP:-triton,cudnn}"
}
step_cmp_profile() {
  python3 scripts/ceilings.py
  run "${PROFILE_S:-300}" profile "$PWD" python3 -- -m experiments.prefill "${H200BENCH[@]}" backend.cmp="${CMP:-cudnn}" \
    prefill.dense_flash=false "prefill.peers=[]" prefill.per_branch=false prefill.profile=true seq="${PROFILE_SEQ:-65536}"
}
step_cmp_tests() {
  local xd=(); python3 -c "import xdist" 2>/dev/null && xd=(-n 3 --dist loadgroup)
  # shellcheck disable=SC2086  # TESTS holds several paths
  TAIL=40 py "${TEST_S:-540}" tests.txt -m pytest -q -rfEs -m gpu ${TESTS:-tests/test_kernels_gpu.py} "${xd[@]}" --durations=12
}

step_sel_kernels() {
  local tt tree tag; peers_on_path
  for tt in "${trees[@]}"; do
    tree=${tt%%:*} tag=${tt#*:}
    # shellcheck disable=SC2086  # SWEEP holds several overrides
    run "${KERNELS_S:-480}" "kernels$tag" "$tree" python3 -- -m experiments.kernels hardware="$HW" model=h200bench \
      op="${OP:-selection}" -m seq="${SEQS:-8192,65536}" ${SWEEP:-tuning.selection.warps=1,2,4}
  done
}
step_sel_layer() {
  local tt tree tag; peers_on_path
  for tt in "${trees[@]}"; do
    tree=${tt%%:*} tag=${tt#*:}
    # shellcheck disable=SC2086  # LAYER_SWEEP holds several overrides
    run "${LAYER_S:-540}" "layer$tag" "$tree" python3 -- -m experiments.prefill "${H200BENCH[@]}" "prefill.peers=[flash_nsa]" \
      prefill.dense_flash=false prefill.per_branch=false model.timing.warmup=2 model.timing.repeats=8 \
      backend.cmp="${CMP:-triton}" -m seq="${LAYER_SEQS:-8192,65536}" ${LAYER_SWEEP:-}
  done
}

# lm=small's attention: 8 query heads on 2 key/value heads, d = 64, mean pooling (train=needles32k's model)
SMALL=(model.nsa.dim=512 model.nsa.n_heads=8 model.nsa.n_kv_heads=2 model.nsa.d_k=64 model.nsa.d_v=64 model.nsa.phi=avg)
step_train_attn() {
  local tt tree tag sb
  for tt in "${trees[@]}"; do
    tree=${tt%%:*} tag=${tt#*:}
    for sb in ${SHAPES:-2048:16 8192:4 32768:1}; do
      # shellcheck disable=SC2086  # ATTN_ARGS holds several overrides
      run "${ATTN_S:-200}" "attn$tag" "$tree" python3 -- -m experiments.prefill "${H200BENCH[@]}" "${SMALL[@]}" \
        model.batch="${sb#*:}" seq="${sb%%:*}" "prefill.peers=[]" prefill.profile="${PROFILE:-false}" \
        model.timing.warmup=5 model.timing.repeats=20 ${ATTN_ARGS:-}
    done
  done
}
step_train_shapes() {
  local tt tree tag sb S B N=${TRAIN_STEPS:-60}
  for tt in "${trees[@]}"; do
    tree=${tt%%:*} tag=${tt#*:}
    for sb in ${SHAPES:-2048:16 8192:4 32768:1}; do
      S=${sb%%:*} B=${sb#*:}
      # shellcheck disable=SC2086  # TRAIN_ARGS holds several overrides
      run "${TRAIN_S:-240}" "train$tag" "$tree" python3 -- -m experiments.train hardware="$HW" train=needles32k \
        -m attention=nsa,dense "train.curriculum=[]" data.seq_len="$S" data.gap="$(( S >= 32768 ? 2048 : S / 4 ))" \
        train.batch="$B" train.steps="$N" train.log_every="${LOG_EVERY:-10}" train.eval_batches=0 train.ckpt_every="$N" \
        train.warmup=10 train.time_limit_s=200 ${TRAIN_ARGS:-}
    done
  done
}
step_train_fsdp() {
  local a r tt N=${FSDP_STEPS:-100}
  local args=(hardware="$HW" train=needles32k "train.curriculum=[]" train.steps="$N" train.log_every=10 train.eval_batches=0
              train.ckpt_every="$N" train.warmup=10 train.time_limit_s=240)
  local attn=${ATTN:-nsa,dense}
  for a in ${attn//,/ }; do
    for r in $(seq "${REPEAT:-2}"); do
      # shellcheck disable=SC2086  # TRAIN_ARGS holds several overrides
      run 300 "fsdp_plain" "$PWD" python3 -- -m experiments.train "${args[@]}" attention="$a" ${TRAIN_ARGS:-} \
        hydra.run.dir="/tmp/fsdp/plain_${a}_$r"
      for tt in "${trees[@]}"; do
        # shellcheck disable=SC2086
        run 300 "fsdp_torchrun${tt#*:}" "${tt%%:*}" torchrun --standalone --nproc_per_node 1 -- -m experiments.train \
          "${args[@]}" attention="$a" parallel.dp=1 ${TRAIN_ARGS:-} hydra.run.dir="/tmp/fsdp/torchrun_${a}_$r${tt#*:}"
      done
    done
  done
}
step_train() {
  # shellcheck disable=SC2086  # TRAIN_ARGS holds several overrides
  run "${T_TRAIN:-570}" train "$PWD" python3 -- -m experiments.train hardware="$HW" train="${TRAIN:-needles32k}" \
    -m attention="${ATTN:-nsa,dense}" ${TRAIN_ARGS:-}
}
step_train_jobs() {
  # JOBS: one job a line, "<name> <overrides...>" (experiments.train's; hardware and the store added here), # lines
  # skipped. Each job pinned to one GPU (CUDA_VISIBLE_DEVICES, round robin), all at once, 2 CPU threads each.
  local name args gpu i=0 ngpu
  local JOBS=${JOBS:-scripts/train_jobs/recipe_seeds.txt}
  [ -f "$JOBS" ] || { echo "train-jobs: JOBS=$JOBS is not a file of jobs" >&2; return 2; }
  ngpu=$(nvidia-smi -L | wc -l)
  $PRINT || mkdir -p "$OUT/runs"
  while read -r name args; do
    case "$name" in ''|'#'*) continue;; esac
    gpu=$(( i % (ngpu > 0 ? ngpu : 1) )); i=$(( i + 1 ))
    # shellcheck disable=SC2086  # args holds several overrides
    set -- python3 -m experiments.train hardware="$HW" $args "tracking.uri=sqlite:///$OUT/runs/$name.db" \
      hydra.run.dir="/tmp/runs/$name"
    if $PRINT; then echo "CUDA_VISIBLE_DEVICES=$gpu $*"; continue; fi
    (CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} timeout "${LIMIT_S:-540}" "$@" >"/tmp/runs_$name.log" 2>&1
     echo "$name exit $?" >>"$OUT/exits.txt") &
  done <"$JOBS"
  wait
  # a job that failed before its store opened (a config error) has no row in the table: its exit and last lines
  grep -v " exit 0$" "$OUT/exits.txt" 2>/dev/null | while read -r name _ rc; do
    echo "train-jobs: $name exit $rc:"; tail -n 2 "/tmp/runs_$name.log"
  done
  python3 scripts/train_summary.py "$OUT/runs" --csv "$OUT/summary.csv"
  tar czf "$OUT/train_runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
}
step_train_sweep() {
  local SUMMARY='^# '  # the sweep's summary table
  # shellcheck disable=SC2086  # TRAIN and SWEEP_ARGS hold several overrides
  run "${LIMIT_S:-570}" train_sweep "$PWD" python3 -- -m experiments.train -m hardware="$HW" ${TRAIN:-train=text8k} attention="${ATTN:-nsa,dense}" \
    seed="${SEEDS:-0,1,2,3,4}" hydra/launcher=local_gpus hydra.launcher.jobs_per_gpu="${JOBS_PER_GPU:-3}" ${SWEEP_ARGS:-}
}
step_ablations() {
  # P: the paper's method without the recipe (one projection per branch, phi = MLP, n_sel = 4, free gates); S: the
  # switches the preset used before the recipe (shared K/V, mean pooling, l = 8, gates held 300 steps)
  local - N=${STEPS_N:-1000} T=${T_SWEEP:-560}
  set -f  # [cmp],[sel] are overrides, not globs
  local base=(hardware="$HW" dtype=float32 train=needles_smoke train.steps="$N" train.ckpt_every="$N" train.eval_every=100
              train.time_limit_s="${LIMIT_S:-170}")
  local P=(lm.nsa.shared_kv=false lm.nsa.phi=mlp lm.nsa.n_sel=4 train.gates_open_steps=0 lm.nsa.gate_bias=null
           train.recipe.gate_lr=1 train.recipe.sel_loss=0)
  local S=(lm.nsa.shared_kv=true lm.nsa.phi=avg lm.nsa.l=8 train.gates_open_steps=300 lm.nsa.gate_bias=null
           train.recipe.gate_lr=1 train.recipe.sel_loss=0)
  local -A sweeps=(
    [p_selection]="attention=nsa ${base[*]} ${P[*]} train.ablation.selection=topn,full,oracle"
    [p_branches]="attention=nsa ${base[*]} ${P[*]} train.ablation.branches=[cmp],[sel],[win]"
    [s_selection]="attention=nsa ${base[*]} ${S[*]} train.ablation.selection=topn,full,oracle"
    [p_full_sel]="attention=nsa,dense ${base[*]} ${P[*]} train.ablation.branches=[sel] train.ablation.selection=full"
    [p_switches]="attention=nsa ${base[*]} ${P[*]} lm.nsa.shared_kv=false,true lm.nsa.phi=mlp,avg"
    [p_nsel_gates]="attention=nsa ${base[*]} ${P[*]} lm.nsa.n_sel=8 train.gates_open_steps=0,300"
    [p_seed1]="attention=nsa,dense ${base[*]} ${P[*]} train.ablation.selection=topn,oracle seed=1"
  )
  local name
  for name in ${ABLATIONS:-p_selection p_branches s_selection p_full_sel}; do
    [ -n "${sweeps[$name]:-}" ] || { echo "bench.sh: ABLATIONS: unknown sweep '$name'; one of: ${!sweeps[*]}" >&2; exit 2; }
  done
  for name in ${ABLATIONS:-p_selection p_branches s_selection p_full_sel}; do
    # shellcheck disable=SC2086  # one sweep's overrides, none with spaces
    OMP_NUM_THREADS=2 run "$T" "$name" "$PWD" python3 -- -m experiments.train -m ${sweeps[$name]} &
  done
  wait
}
step_kernels() {
  # shellcheck disable=SC2086  # KERNELS_ARGS holds several overrides
  run "${T_KERNELS:-500}" kernels "$PWD" python3 -- -m experiments.kernels -m hardware="$HW" seq="${SEQS:-8192,16384,32768,65536}" \
    op="${OPS:-selection,compressed,topn,window,gate,layer,decode}" ${KERNELS_ARGS:-}
}
step_parity() {
  run "${T_PARITY:-100}" parity "$PWD" python3 -- -m experiments.parity "${H200BENCH[@]}" -m seq="${PARITY_SEQS:-8192}" parity.batch=1
}
step_validate() {
  # shellcheck disable=SC2086  # VALIDATE_ARGS holds several overrides
  run "${T_VALIDATE:-560}" validate "$PWD" python3 -- -m experiments.validate hardware="$HW" "hydra.run.dir=$OUT/validate" ${VALIDATE_ARGS:-}
}
step_diag() {  # gpu_diag takes its cases from the test suite: tests/ on the path
  local part
  for part in sel compile varlen; do PYTHONPATH="tests:$PYTHONPATH" py "${T_DIAG:-150}" "diag_$part.txt" scripts/gpu_diag.py $part; done
}

NGPU=${NGPU:-2}
CP=(hardware="$HW" model=h200bench backend=triton model.timing.warmup=2 model.timing.repeats=5)
step_hf_generate() {
  python3 -c "import transformers, sys; from packaging.version import Version as V; v = transformers.__version__; print('transformers', v); sys.exit(not V('5.17') <= V(v) < V('6'))" \
    || { echo "hf-generate: needs transformers >=5.17,<6, the [hf] extra (the wheelhouse's --hf: python scripts/wheelhouse.py --dest .whl --hf)"; return; }
  run "${T_GEN:-360}" generate "$PWD" python3 -- -m experiments.generate hardware="$HW" backend=triton generate.check_tokens=false \
    generate.new_tokens="${GEN_TOKENS:-64}" -m seq="${GEN_SEQS:-8192,16384,32768,65536}" attention=nsa,dense
  [ -n "${GEN_DECODES:-}" ] && run "${T_GEN:-360}" generate "$PWD" python3 -- -m experiments.generate hardware="$HW" backend=triton \
    generate.check_tokens=false generate.new_tokens="${GEN_TOKENS:-64}" -m seq="${GEN_SEQS:-8192,16384,32768,65536}" attention=nsa \
    generate.decode="$GEN_DECODES"
  run "${T_CHECK:-300}" generate_check "$PWD" python3 -- -m experiments.generate hardware="$HW" backend=triton attention=nsa \
    seq=256 generate.new_tokens=32
  $PRINT || grep -h "token check\|\] equal: " "$OUT/log.txt" | tail -n 2
  py 200 hf_tests.txt -m pytest -q -m gpu tests/test_hf_gpu.py
}
step_cp_parity() {
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  run 240 parity "$PWD" torchrun --standalone --nproc_per_node "$NGPU" -- -m experiments.parity parallel.cp="$NGPU" "${CP[@]}" \
    parity.batch=1 seq="${PARITY_SEQ:-131072}"
  grep -hE "cp_max_rel_err|cp_.*_rel_l2_err" "$OUT/log.txt" 2>/dev/null | tail -n 12
}
step_cp_prefill() {
  local S
  for S in ${CP_SEQS:-131072 262144 524288}; do
    run "${CP_TIMEOUT:-200}" cp "$PWD" torchrun --standalone --nproc_per_node "$NGPU" -- -m experiments.prefill \
      parallel.cp="$NGPU" "${CP[@]}" seq="$S"
  done
}
step_cp_one() {
  local S
  for S in ${ONE_SEQS:-131072 262144 524288}; do
    CUDA_VISIBLE_DEVICES=0 run 240 one "$PWD" python3 -- -m experiments.prefill "${CP[@]}" prefill.per_branch=false \
      prefill.dense_flash=false "prefill.peers=[]" seq="$S"
  done
}
step_cp_slurm() {
  install_wheels .debs/wheels/*.whl
  if $CLUSTER unpack .debs /tmp/slurm >/dev/null && $CLUSTER up --prefix /tmp/slurm --no-tracking --dir /tmp/cl; then
    # shellcheck disable=SC1091
    [ -f /tmp/cl/slurm.env ] && . /tmp/cl/slurm.env
    run 420 slurm "$PWD" python3 -- -m experiments.prefill -m hydra/launcher=per_gpu "${H200BENCH[@]}" \
      seq="${SLURM_SEQS:-8192,16384,32768,65536}"
    grep -h "jobs ran on\|at once" "$OUT/log.txt" 2>/dev/null | tail -n 2
    sacct -X --format=JobID,State,Elapsed,AllocTRES%40 | tail -n 6
  fi
  $CLUSTER down --dir /tmp/cl
  # shellcheck disable=SC2046
  tar czf "$OUT/slurm_logs.tgz" -C /tmp/cl slurm/log $(cd /tmp/cl 2>/dev/null && ls mariadb/*.log munge/private/*.log 2>/dev/null)
}

for s in "$@"; do
  echo "== step $s"
  "step_${s//-/_}"
done
$PRINT || tar czf "$OUT/runs.tgz" --exclude="*.pt" outputs multirun 2>/dev/null  # no checkpoints
exit 0
