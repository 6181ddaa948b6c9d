#!/usr/bin/env bash
# One Slurm array task (one node): a `headsearch run` on the shared study. Every task runs this same command.
# The study's budget lock (a PostgreSQL advisory lock) lets exactly --trials trials finish, however many
# tasks run and whenever each starts or ends; a task that starts after the budget is spent exits at once.
# A task stopped by SIGTERM (search.sbatch's --signal, preemption) fails its running trials as interrupted and
# exits 143: the next run retries them at once. One killed outright (SIGKILL, a lost node) leaves its trial
# RUNNING; its heartbeat stops and, 3 heartbeats later, any task counting trials fails it and re-enqueues it, so
# it is trained again and counted once.
set -euo pipefail
: "${OPTUNA_STORAGE:?set OPTUNA_STORAGE to a PostgreSQL URL that every node reaches}"
: "${HEADSEARCH_DATA:?set HEADSEARCH_DATA to a folder every node reads (it holds cifar10/)}"

# HEADSEARCH_ARGS: more flags for every task, split on spaces (e.g. "--preset tiny --epochs 20").
# shellcheck disable=SC2086

exec headsearch run \
  --task "${HEADSEARCH_TASK:-vit-cifar10}" \
  --space "${HEADSEARCH_SPACE:-deep-head}" \
  --trials "${HEADSEARCH_TRIALS:-50}" \
  --study "${HEADSEARCH_STUDY:-vit-cifar10-slurm}" \
  --data-dir "$HEADSEARCH_DATA/cifar10" \
  --run-root "${HEADSEARCH_RUN_ROOT:-runs}" \
  --workers "${HEADSEARCH_WORKERS:-1}" \
  ${HEADSEARCH_ARGS:-}
