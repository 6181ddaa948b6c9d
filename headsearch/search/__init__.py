"""Architecture search over attention heads with Optuna.

- `runner`: the trial loop (`Search`: sample, train, tell; the budget lock; reuse of finished twins;
  `TrialPruning`); `settings`: `SearchSettings` and its checks; `study`: samplers, opening or resuming
  the study; `workers`: worker processes and their GPUs.
- `objectives`: what a search optimises (the one table of objectives); `pruning`: the learning-curve
  rules and which trials they compare with; `space`: search spaces; `storage`: Optuna storages,
  heartbeats and the budget lock.
- Reading a study: `report`, `export`, `plots`, `snapshot`, and `artifacts` (files attached to a study).
"""
