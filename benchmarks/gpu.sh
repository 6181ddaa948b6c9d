#!/usr/bin/env bash
# What to run on a GPU machine, in stages of one device command each. Run from the checkout.
#
#   bash benchmarks/gpu.sh prepare   # HERE, not on the GPU machine: .gpu-data/ (one CIFAR-10 shard, 2,000 test
#                                    #   images, spa.txt) and .whl/ (Optuna and what the GPU image lacks), ~50 MiB,
#                                    #   and the line to start the device command with
#   bash benchmarks/gpu.sh quick     # FIRST on a new GPU machine: at most 8 minutes (440 s), says whether the
#                                    #   defaults are right and fast there (benchmarks/README.md: each line)
#   bash benchmarks/gpu.sh next      # the second GPU run (issue 41), at most 470 s: a slice of the headline job
#                                    #   with every default (B) and with the opt-in graph pool (C; C_ENV="..." for others), bench (D), a
#                                    #   canary (A), the pause checkpoint's cost and a resumed run (G), a skip=scores start (H), eager translation (E), HAM B (F),
#                                    #   each attention kind's step against the classic one (M); NEXT_STEPS="C E" reruns some
#   bash benchmarks/gpu.sh checks    # ~5 min (estimate): the CUDA-only tests (capture failure, one pool, cuda:N, MPS),
#                                    #   the bare step vs the trainer in each step mode
#   bash benchmarks/gpu.sh bench     # ~8 min (estimate): headsearch bench for the ViT (modes, K processes +- MPS,
#                                    #   cohorts) and for tiny translation
#   bash benchmarks/gpu.sh search    # ~10 min (estimate): search throughput with the plan, the fair time alone vs 8
#                                    #   workers, the cohort of 8 vs 8 processes on the fast path
#   bash benchmarks/gpu.sh all       # checks, bench, search, one after another (a machine without the 10-minute limit)
#   bash benchmarks/gpu.sh --dry-run STAGE   # print the commands only
#
# On the lent machine (../shared/device/README.md): start with the line `prepare` printed, then
# export HEADSEARCH_DATA (default .gpu-data: cifar10/ with test.npz and one train shard, spa-eng/spa.txt).
# quick writes its logs and run directories to $OUT (a fresh folder when unset); QUICK_STEPS="S4 S5"
# runs only those steps. The longer stages append their rows, with device and versions, to RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
STAGE=${1:-}
DATA=${HEADSEARCH_DATA:-$PWD/.gpu-data}
Q=benchmarks/gpu_quick

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

prepare() {  # here: the quick check's data slice and the wheels the GPU image lacks
  [[ $DRY == 1 ]] && { echo "+ copy train_0.npz, 2,000 test images, spa.txt into .gpu-data/; bash ../shared/device/wheels.sh"; return 0; }
  local src=${HEADSEARCH_SOURCE:-../shared/data}  # a folder with cifar10/ (train_0.npz, test.npz) and spa-eng/spa.txt
  grep -qx "/.gpu-data/" .git/info/exclude 2>/dev/null || echo "/.gpu-data/" >> .git/info/exclude
  mkdir -p .gpu-data/cifar10 .gpu-data/spa-eng
  cp "$src/cifar10/train_0.npz" .gpu-data/cifar10/ && cp "$src/spa-eng/spa.txt" .gpu-data/spa-eng/
  $PY - "$src/cifar10/test.npz" <<'P'
import sys, numpy as np
z = np.load(sys.argv[1]); m = len(z["x"])
np.savez(".gpu-data/cifar10/test.npz", **{k: (z[k][:2000] if z[k].ndim and len(z[k]) == m else z[k]) for k in z.files})
P
  if [[ -f ../shared/device/wheels.sh ]]; then bash ../shared/device/wheels.sh  # a machine that reaches no index
  else echo "the GPU machine needs headsearch's dependencies (pip install -e . there, or optuna beside its torch)"; fi
  echo "carry [\".whl\", \".gpu-data\"], then: bash benchmarks/gpu.sh quick (timeout_s 480) or next (timeout_s 540)"
}

QUICK_END=0
step() {  # step NAME CAP CMD...: at most CAP s and never past the quick check's end; a failure never stops the rest
  local name=$1 cap=$2; shift 2
  if [[ -n "${QUICK_STEPS:-}" && " $QUICK_STEPS " != *" ${name%%-*} "* ]]; then return 0; fi
  if [[ $DRY == 1 ]]; then echo "+ [$name, at most $cap s] $*"; return 0; fi
  local t=$((QUICK_END - SECONDS - 12)); ((t > cap)) && t=$cap
  if ((t < 25)); then echo "== $name: SKIPPED, no time left"; return 0; fi
  capped "$name" "$t" "$@"
}
capped() {  # capped NAME SECONDS CMD...: CMD stopped (Ctrl-C, then kill) after SECONDS, its log in $OUT/NAME.log
  local name=$1 t=$2; shift 2
  echo "== $name (limit $t s)"; local start=$SECONDS rc=0
  timeout -s INT -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "   rc=$rc after $((SECONDS - start)) s"; ((rc)) && tail -n 12 "$OUT/$name.log"; return 0
}
show() {  # show STEP CMD...: a step's summary, if that step ran
  if [[ $DRY == 1 || ( -n "${QUICK_STEPS:-}" && " $QUICK_STEPS " != *" $1 "* ) ]]; then return 0; fi
  shift; timeout 30 "$@" || echo "   (summary failed)"
}

quick() {  # the 8-minute check: steps in order of importance (benchmarks/README.md says what each line means)
  set +e
  QUICK_END=$((SECONDS + 440))
  if [[ $DRY == 1 ]]; then OUT=${OUT:-'$OUT'}; else OUT=${OUT:-$(mktemp -d)}; fi
  export HEADSEARCH_CACHE=${TMPDIR:-/tmp}/headsearch-quick-cache-$$ HEADSEARCH_TEST_DATA=$DATA PYTHONUNBUFFERED=1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  local train="$PY -m headsearch train --task vit-cifar10 --data-dir $DATA/cifar10 --config $Q/vit.yaml"
  if [[ $DRY == 0 ]]; then
    echo "== S0: versions, GPU, MPS; logs in $OUT"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; echo "$(nproc) cores"
    command -v nvidia-cuda-mps-control || echo "no MPS control binary"
    $PY -c "import torch,optuna as o;p=torch.cuda.get_device_properties(0);print('torch',torch.__version__,'CUDA',torch.version.cuda,p.name,p.multi_processor_count,'SMs; optuna',o.__version__)"
  fi
  step S1-vit-auto 110 $train --out "$OUT/vit-auto"
  step S1-vit-off 45 $train --compile off --out "$OUT/vit-off"
  show S1 $PY $Q/summary.py vit "$OUT"
  step S2-pytest 60 $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu_safety.py
  show S2 grep -E "passed|failed|error|SKIPPED" "$OUT/S2-pytest.log"
  step S2-probe 60 env HEADSEARCH_DATA="$DATA" $PY $Q/probe.py
  show S2 grep -v Warning "$OUT/S2-probe.log"
  step S3-run 150 $PY -m headsearch run --task vit-cifar10 --space $Q/space.yaml --data-dir $DATA/cifar10 --trials 8 \
    --epochs 2 --storage "sqlite:///$OUT/h.db" --run-root "$OUT/runs"
  show S3 grep -m1 -E "^plan" "$OUT/S3-run.log"
  show S3 $PY $Q/summary.py search "$OUT"
  show S3 sh -c 'pgrep -a nvidia-cuda-mps || echo "no MPS process left"'
  # S1 measured eager against the default: the bench tries the default mode alone, then 8 processes -+ MPS.
  step S4-bench 110 $PY -m headsearch bench --task vit-cifar10 --space $Q/space.yaml --data-dir $DATA/cifar10 \
    --ks 8 --modes reduce-overhead --no-cohorts --seconds 4
  show S4 grep -vi warn "$OUT/S4-bench.log"
  step S5-translation 130 $PY -m headsearch train --task translation-en-es --preset tiny --epochs 1 \
    --data-file $DATA/spa-eng/spa.txt --out "$OUT/tr-auto"
  show S5 $PY $Q/summary.py translation "$OUT"
  if [[ $DRY == 0 ]]; then
    pgrep -a nvidia-cuda-mps || echo "no MPS process left"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    echo "== done in $SECONDS s"
  else
    echo "at most 440 s in all (S0 and the summaries included): each step stops at its cap and at 428 s"
  fi
}

# -- next: the second GPU run --------------------------------------------------------------------------
NEXT_TOTAL=${NEXT_TOTAL:-470}  # the hard end, in seconds, S0 and the summaries included (lower it when less device time is left)
NEXT_RESERVE=30       # S0 and the summaries
# The steps in the order they run, each with its cap: B (the headline job's slice) is never dropped; when the
# caps exceed the budget, M, F, E, H, G, the cohort way (D with --no-cohorts), C, then A are dropped in that order, and a
# dropped step still runs at the end if the steps before it left time (F and E need 35 s).
NEXT_ORDER="A B D C G H E F M"
declare -A NEXT_CAP=([A]=40 [B]=135 [D]=100 [C]=135 [G]=60 [H]=60 [E]=45 [F]=45 [M]=90)
NEXT_COHORT_S=20      # what D's cohort of 8 adds to its cap
NEXT_MIN=35           # the least a step is started with
NEXT_DROP="M F E H G cohort C A"

next_plan() {  # sets NEXT_RUN (the steps planned, in order), NEXT_LATE (dropped, run if time is left), D_COHORT
  local wanted=${NEXT_STEPS:-$NEXT_ORDER} total=$NEXT_RESERVE s d
  D_COHORT=1; NEXT_RUN=""; NEXT_LATE=""
  for s in $wanted; do [[ -n "${NEXT_CAP[$s]:-}" ]] || { echo "NEXT_STEPS: unknown step $s (the steps: $NEXT_ORDER)" >&2; exit 2; }; done
  for s in $NEXT_ORDER; do [[ " $wanted " == *" $s "* ]] && NEXT_RUN="$NEXT_RUN $s" && total=$((total + NEXT_CAP[$s])); done
  [[ " $NEXT_RUN " == *" D "* ]] && total=$((total + NEXT_COHORT_S))
  for d in $NEXT_DROP; do
    ((total <= NEXT_TOTAL)) && break
    if [[ $d == cohort ]]; then [[ " $NEXT_RUN " == *" D "* ]] && D_COHORT=0 && total=$((total - NEXT_COHORT_S)); continue; fi
    [[ " $NEXT_RUN " == *" $d "* ]] || continue
    NEXT_RUN=$(echo " $NEXT_RUN " | sed "s/ $d / /"); total=$((total - NEXT_CAP[$d]))
  done
  NEXT_RUN=$(echo $NEXT_RUN)
  for s in $NEXT_ORDER; do [[ " $wanted " == *" $s "* && " $NEXT_RUN " != *" $s "* ]] && NEXT_LATE="$NEXT_LATE $s"; done
  NEXT_LATE=$(echo $NEXT_LATE)
  NEXT_PLANNED=$total
}

next_step() {  # next_step NAME CACHE CMD...: at most the step's cap, never past the hard end; a failure never stops the rest
  local name=$1 cache=$2 cap=${NEXT_CAP[$1]}; shift 2
  [[ $name == D && $D_COHORT == 1 ]] && cap=$((cap + NEXT_COHORT_S))
  if [[ $DRY == 1 ]]; then echo "+ [$name, at most $cap s, cache $cache] $*"; return 0; fi
  local t=$((NEXT_END - SECONDS - NEXT_RESERVE / 2)); ((t > cap)) && t=$cap
  if ((t < NEXT_MIN)); then echo "== $name: SKIPPED, $t s left"; return 0; fi
  # Inductor's and Triton's caches named outright: an image that sets either would otherwise share them between steps
  HEADSEARCH_CACHE=$NEXT_CACHES/$cache TORCHINDUCTOR_CACHE_DIR=$NEXT_CACHES/$cache/inductor \
    TRITON_CACHE_DIR=$NEXT_CACHES/$cache/triton capped "$name" "$t" "$@"
}

next_run() {  # one step by name: its command, with its own cold cache where its warm-ups are measured
  local hs="$PY -m headsearch" cifar="--data-dir $DATA/cifar10" quick="--config $Q/vit.yaml"
  # The headline job with every default (its space, sampler, pruner, plan, MPS, holds), on one prepared shard:
  # 24 trials x 30 epochs of 8,960 images (the quick check's 35 batches of 256), the seed architecture first.
  local slice="run --task vit-cifar10 $cifar --trials 24 --epochs 30 --set data.val_size=1000 --set data.train_limit=8960 --enqueue examples/vit-classic.yaml"
  case $1 in
    A) next_step A a $hs train --task vit-cifar10 $cifar $quick --out "$OUT/a-seed" ;;
    B) next_step B b $hs $slice --storage "sqlite:///$OUT/b.db" --run-root "$OUT/b-runs" ;;
    C) next_step C c env ${C_ENV:-HEADSEARCH_SHARED_GRAPH_POOL=1} \
         $hs $slice --storage "sqlite:///$OUT/c.db" --run-root "$OUT/c-runs" ;;
    D) local cohorts=""; [[ $D_COHORT == 1 ]] || cohorts="--no-cohorts"
       next_step D a $hs bench --task vit-cifar10 --space $Q/space.yaml $cifar --ks 8 --modes reduce-overhead \
         --seconds 4 $cohorts ;;
    E) next_step E e $hs train --task translation-en-es --preset tiny --epochs 1 --compile off \
         --data-file $DATA/spa-eng/spa.txt --out "$OUT/e-translation-eager" ;;
    G) next_step G g env HEADSEARCH_DATA="$DATA" $PY benchmarks/pause_cost.py --quick ;;  # with the resumed run's check
    # H: a skip=scores architecture whose head count changes, alone and cold: in the slices of 2026-11-30 such
    # trials took 52-110 s before their third epoch (others 5-20 s for thirty); warm-up or something else?
    H) next_step H h $hs train --task vit-cifar10 $cifar $quick --set "arch.enc_heads=[2,4,8,16]" --set arch.skip=scores \
         --set train.epochs=2 --out "$OUT/h-scores" ;;
    F) next_step F a $hs train --task vit-cifar10 $cifar $quick --set arch.fusion=add --set train.epochs=2 --out "$OUT/f-ham-b" ;;
    # M: each attention kind's training step against the classic one (issue 52's kinds among them), eager
    M) next_step M m env HEADSEARCH_DATA="$DATA" $PY benchmarks/train_step.py --quick ;;
  esac
}

next_show() {  # next_show STEP CMD...: a step's summary, if that step ran
  if [[ $DRY == 1 || ! -f "$OUT/$1.log" ]]; then return 0; fi
  shift; timeout 60 "$@" || echo "   (summary failed)"
}

next() {  # the second GPU run: the headline job's slice with every default, the opt-in ways decided, <= 470 s
  set +e
  NEXT_END=$((SECONDS + NEXT_TOTAL))
  next_plan
  if [[ $DRY == 1 ]]; then OUT=${OUT:-'$OUT'}; NEXT_CACHES='$TMPDIR/headsearch-next'; else OUT=${OUT:-$(mktemp -d)}; NEXT_CACHES=$(mktemp -d); fi
  export HEADSEARCH_TEST_DATA=$DATA PYTHONUNBUFFERED=1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  if [[ $DRY == 0 ]]; then
    echo "== S0: versions, GPU, MPS; logs in $OUT; planned: $NEXT_RUN; if time is left: ${NEXT_LATE:-nothing}"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; echo "$(nproc) cores"
    $PY -c "import torch,optuna as o;p=torch.cuda.get_device_properties(0);print('torch',torch.__version__,'CUDA',torch.version.cuda,p.name,p.multi_processor_count,'SMs; optuna',o.__version__)"
    env | grep -E "^(TORCHINDUCTOR|TRITON)_CACHE_DIR=" || echo "no Inductor or Triton cache folder set by the image"
  fi
  local s
  for s in $NEXT_RUN; do next_run "$s"; done
  for s in $NEXT_LATE; do
    if [[ $DRY == 1 ]]; then echo "   (dropped: $s runs only if time is left)"; continue; fi
    next_run "$s"
  done
  next_show A $PY $Q/summary.py canary "$OUT"
  next_show B $PY $Q/summary.py slice "$OUT"
  next_show D grep -vi warn "$OUT/D.log"
  next_show G grep -vi warn "$OUT/G.log"
  next_show H $PY $Q/summary.py run "H, 2-4-8-16 skip=scores" "$OUT/h-scores"
  next_show E $PY $Q/summary.py run "E, translation --compile off" "$OUT/e-translation-eager"
  next_show F $PY $Q/summary.py run "F, HAM B" "$OUT/f-ham-b"
  next_show M grep -vi warn "$OUT/M.log"
  if [[ $DRY == 0 ]]; then
    pgrep -a nvidia-cuda-mps || echo "no MPS process left"
    rm -rf "$NEXT_CACHES"; echo "== done in $SECONDS s"
  else
    echo "at most $NEXT_PLANNED s in all (the caps of $NEXT_RUN, S0 and the summaries); the hard end is $NEXT_TOTAL s"
  fi
}

case "$STAGE" in
  prepare) prepare ;;
  quick) quick ;;
  next) next ;;
  checks) checks ;;
  bench) bench ;;
  search) search ;;
  all) checks; bench; search ;;
  *) echo "usage: bash benchmarks/gpu.sh [--dry-run] prepare|quick|next|checks|bench|search|all" >&2; exit 2 ;;
esac
