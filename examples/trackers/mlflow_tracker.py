"""An MLflow tracker for headsearch searches: one MLflow run per trained trial, with its objectives as metrics
and its architecture choices as params.

    pip install optuna-integration mlflow        # or mlflow-skinny
    export MLFLOW_TRACKING_URI=sqlite:///mlflow.db
    PYTHONPATH=examples/trackers headsearch run --task vit-cifar10 --workers 2 --callback mlflow_tracker:track

`--callback` takes any Optuna callback `(study, FrozenTrial)`; this one wraps optuna-integration's
MLflowCallback (deprecated in optuna-integration 4.9, to be removed in 6.0: OptunaHub's callbacks take over;
docs/python-and-trackers.md shows both ways). The wrapper adds what a search with several worker processes
needs:
- the MLflow store is opened when this module is imported, and `headsearch run` imports it before it starts
  its workers, so the workers never race to create MLflow's tables;
- the experiment (named after the study) is created by whichever worker gets there first; the others use it;
- the metrics take the study's objective names (accuracy, time, ...), not value_0, value_1.
"""
from __future__ import annotations

import os

import mlflow
from mlflow.exceptions import MlflowException
from optuna_integration.mlflow import MLflowCallback

TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
mlflow.set_tracking_uri(TRACKING_URI)
mlflow.MlflowClient()  # opens (and on first use creates) the store, in the process that imports this module first


def experiment_id(name: str) -> str:
    """The MLflow experiment `name`, created if no worker has created it yet."""
    for _ in range(5):
        if (found := mlflow.get_experiment_by_name(name)) is not None:
            return found.experiment_id
        try:
            return mlflow.create_experiment(name)
        except MlflowException:  # another worker created it between the lookup and the create
            continue
    raise RuntimeError(f"cannot create or find the MLflow experiment {name!r} at {TRACKING_URI}")


class MLflowTracker:
    """An Optuna callback: builds optuna-integration's MLflowCallback for the study on its first call."""

    def __init__(self) -> None:
        self._callback: MLflowCallback | None = None

    def __call__(self, study, trial) -> None:
        if self._callback is None:
            self._callback = MLflowCallback(tracking_uri=TRACKING_URI, metric_name=study.metric_names or "value",
                                            create_experiment=False,
                                            mlflow_kwargs={"experiment_id": experiment_id(study.study_name)})
        self._callback(study, trial)


track = MLflowTracker()
