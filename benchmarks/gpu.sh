#!/usr/bin/env bash
# Every GPU measurement of benchmarks/RESULTS.md, and the GPU checks of the fixes that make the fast path
# safe, in three stages of at most 10 minutes each (25 in all on one H100), each one device command.
# Each benchmark appends its rows, with device and versions, to benchmarks/RESULTS.md; run from the
# checkout. On the lent machine (../shared/device/README.md): export PYTHONPATH=$PWD:/tmp/site and
# HEADSEARCH_DATA (cifar10/ with at least test.npz and one train shard, spa-eng/spa.txt).
#
#   bash benchmarks/gpu.sh checks    # ~5 min (estimate): the CUDA-only tests (capture failure, one pool, cuda:N, MPS),
#                                    #   the bare step vs the trainer in each step mode
#   bash benchmarks/gpu.sh bench     # ~8 min (estimate): headsearch bench for the ViT (modes, K processes +- MPS,
#                                    #   cohorts) and for tiny translation
#   bash benchmarks/gpu.sh search    # ~10 min (estimate): search throughput with the plan, the fair time alone vs 8
#                                    #   workers, the cohort of 8 vs 8 processes on the fast path
#   bash benchmarks/gpu.sh all       # the three, one after another (for a machine without the 10-minute limit)
#   bash benchmarks/gpu.sh --dry-run STAGE   # print the commands only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
STAGE=${1:-}

run() {  # a command, with its wall time; stops the stage at the first failure
  echo "+ $*"
  if [[ $DRY == 1 ]]; then return 0; fi
  local start=$SECONDS
  timeout "${LIMIT:-590}" "$@"
  echo "  ($((SECONDS - start)) s)"
}

checks() {
  # The fixes' GPU checks: each says why it is skipped where it cannot run (e.g. two GPUs needed).
  run $PY -m pytest -q -rs tests/test_gpu_safety.py tests/test_mps.py tests/test_fastpath.py
  run $PY benchmarks/train_step.py --compile
  run $PY benchmarks/trainer_step.py
}

bench() {
  run $PY benchmarks/ways.py
  run $PY benchmarks/ways.py --task translation-en-es --preset tiny
}

search() {
  run $PY benchmarks/search_throughput.py --ks 4,8
  run $PY benchmarks/time_objective.py
  run $PY benchmarks/cohort.py --ks 8 --solo-compile auto
}

case "$STAGE" in
  checks) checks ;;
  bench) bench ;;
  search) search ;;
  all) checks; bench; search ;;
  *) echo "usage: bash benchmarks/gpu.sh [--dry-run] checks|bench|search|all" >&2; exit 2 ;;
esac
