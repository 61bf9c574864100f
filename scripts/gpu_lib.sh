# Sourced by scripts/bench.sh (and any GPU-box command list): the wheelhouse install on a GPU host without network (the device
# tool's boxes), `run`, which runs one entry point into $OUT/<db>.db and prints its summary table, and $trees,
# the trees of a before/after (AB=).
# Needs the wheelhouse (python scripts/wheelhouse.py --dest .whl).
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT";; esac
# install_wheels <wheel files>: into /tmp/site, offline (the scripts put it first on PYTHONPATH)
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" \
    || { echo "wheelhouse install failed: $*"; exit 1; }
}
# once per host: a second bench.sh beside the first (steps side by side) finds the stamp and leaves /tmp/site as it is
stamp=$(ls -l .whl | md5sum | cut -d' ' -f1)
if [ "$(cat /tmp/site/.wheelhouse 2>/dev/null)" != "$stamp" ]; then
  install_wheels .whl/*.whl && echo "$stamp" >/tmp/site/.wheelhouse
fi
export PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true  # the box has no network
# The multi-GPU boxes' rule: NVLink multicast stays off (it can take the host's shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HW=${HW:-h100}
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
# run <seconds> <db> <tree> <launcher...> -- args...: `<launcher> args tracking.uri=...` in <tree> (launcher:
# python3, or torchrun with its options); the summary table (SUMMARY: the regex of its first line) printed,
# the whole log appended to $OUT/log.txt.
SUMMARY=${SUMMARY:-'^#  '}
run() {
  local t=$1 db=$2 tree=$3 log launcher=(); shift 3
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done; shift
  log=$(mktemp)
  echo "== [$db] ${launcher[*]} $*"
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$t" "${launcher[@]}" "$@" "tracking.uri=sqlite:///$OUT/$db.db" 2>&1) \
    | grep -v "INFO mlflow" >"$log"
  cat "$log" >>"$OUT/log.txt"
  sed -n "/$SUMMARY/,/^outputs:/p" "$log" | grep -v "^outputs:"
  grep -E "FAILED|Error|exceeds|error:" "$log" | tail -n 3
}
# The trees a before/after runs in: "<dir>:<db suffix>" pairs in $trees. Without AB, this tree alone; with
# AB=<folder> (files under the same relative paths as in the repo), first a copy of this tree with them laid
# over it (/tmp/base, suffix _base), then this tree.
trees=("$PWD:")
if [ -n "${AB:-}" ]; then
  rm -rf /tmp/base && cp -r "$PWD" /tmp/base && cp -r "$AB"/. /tmp/base/ && trees=("/tmp/base:_base" "$PWD:")
  echo "before/after: $(cd "$AB" && find . -type f | tr '\n' ' ')laid over /tmp/base"
fi
