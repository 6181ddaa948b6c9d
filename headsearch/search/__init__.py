"""Architecture search: search spaces, Optuna storages, learning-curve pruning."""
