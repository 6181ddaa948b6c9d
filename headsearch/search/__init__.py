"""Architecture search over attention heads with Optuna.

- `runner`: `Search`, the definition (task, space, objectives, base config, sampler, pruner, study), made
  of small units: `architectures` (what the space holds), `scheduler` (the next trial under the budget lock;
  an architecture trained once per study, a repeat told FAIL as `duplicate_of`), `trial_life` and
  `trial_pruning` (a trial begun, judged each epoch, told), `record` (a trial's user attributes and what
  counts), `backends` and `loop` (one loop over one slot, a cohort or the simulator's table); `settings`:
  `SearchSettings` and its checks; `study`: samplers, opening or resuming the study; `workers`: worker
  processes and their GPUs.
- `objectives`: what a search optimises (the one table of objectives); `pruning`: the learning-curve
  rules, their table and which trials they compare with; `space`: search spaces; `storage`: Optuna
  storages, heartbeats and the budget lock.
- Reading a study: `report`, `export`, `plots`, `snapshot`, and `artifacts` (files attached to a study).
"""
