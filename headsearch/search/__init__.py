"""Architecture search over attention heads with Optuna.

- `runner`: the trial loop (`Search`: sample, train, tell; the budget under its lock; an architecture
  trained once per study, a repeat told FAIL as `duplicate_of`; `TrialPruning`); `settings`:
  `SearchSettings` and its checks; `study`: samplers, opening or resuming the study; `workers`: worker
  processes and their GPUs.
- `objectives`: what a search optimises (the one table of objectives); `pruning`: the learning-curve
  rules, their table and which trials they compare with; `space`: search spaces; `storage`: Optuna
  storages, heartbeats and the budget lock.
- Reading a study: `report`, `export`, `plots`, `snapshot`, and `artifacts` (files attached to a study).
"""
