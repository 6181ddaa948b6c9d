"""The search's fair `time`: an architecture's training seconds as if it had the device to itself.

Several trials share a device when `--trials-per-gpu` (or the plan) runs K workers on it; a trial's own
seconds then grow with K and with what the others train. The `time` objective is therefore

    time = best epoch x epoch_seconds_alone(architecture)

where `epoch_seconds_alone` is one epoch's training seconds (evaluation excluded) measured with every
other worker of the device paused: the trial's first epoch runs under the device's exclusive lock,
which the other workers respect at their epoch boundaries (`headsearch.training.devicelock`,
`headsearch.training.clock.AloneClock`). It is measured once per architecture and device: a later
trial with the same `alone_key` reuses the stored value instead of pausing the others again. The raw
seconds (`best_train_seconds`, as measured in the crowd) are recorded beside it. docs/design.md §7.4.

Each worker process holds one `Seat` (built by `plan.worker_seat` in a worker, by `Search` otherwise): its
device, its hold on the device's lock and a lone process's threads, which every fair clock of the worker uses.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any

from headsearch.machine.measured import bench_key, cpu_name, key_inputs

# Training fields that change how long an epoch takes (the learning rate and the like do not).
SPEED_FIELDS = ("batch_size", "amp", "compile", "channels_last", "grad_clip", "optimizer", "max_steps_per_epoch")


def device_model(device: Any) -> str:
    """What the speed depends on: the GPU's model, or the CPU's (its architecture and cores)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).name
    return cpu_name()


def alone_key(cfg: Any, device: Any, threads: int | None = None, step_mode: str | None = None) -> str:
    """Equal for runs whose epochs take equally long alone on this kind of device: the task, architecture,
    data options and the training fields of SPEED_FIELDS, the device model (and CPU threads), torch's version,
    and the step mode that ran (`StepMode.describe()`): `train.compile: auto` names no mode, and a run
    that fell back to eager steps must not lend its time to runs whose compiled steps are faster."""
    import torch

    what = {**key_inputs(device_model(device), torch.__version__, cfg, SPEED_FIELDS), "threads": threads}
    if step_mode is not None:
        what["train"]["compile"] = step_mode
    return bench_key(what)


def known_epoch_seconds(study: Any, key: str) -> float | None:
    """The epoch seconds alone an earlier trial of the study measured for `key`, if any (the first one)."""
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if a.get("alone_key") == key and a.get("epoch_seconds_alone") is not None:
            return float(a["epoch_seconds_alone"])
    return None


class Seat:
    """One worker's place on `device`: its hold on the device's lock (`share`, the `DeviceShare` every headsearch
    worker of this machine uses for it: shared to train, exclusive to time alone) and the threads a process alone
    on this machine uses (`alone_threads`: what the fair time measures with on a CPU, where a worker among
    several runs with fewer)."""

    def __init__(self, device: Any, alone_threads: int | None = None):
        self.device = device
        if alone_threads is not None:  # a worker's, counted before its share of the threads was set
            self.alone_threads = alone_threads

    @cached_property
    def alone_threads(self) -> int:
        """This process's threads, when no worker counted them (it runs alone), read when first needed."""
        import torch

        return torch.get_num_threads()

    @cached_property
    def share(self):
        """The device's lock, by GPU UUID (the same GPU has the same key whatever CUDA_VISIBLE_DEVICES numbers
        it), opened when first needed."""
        import torch

        from headsearch.training.devicelock import DeviceShare, default_lock_dir, device_key

        gpu = str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else None
        return DeviceShare(default_lock_dir(), device_key(gpu))

    def step_mode(self, cfg: Any, task: Any) -> str:
        """How `cfg`'s steps mean to run here (`fastpath.resolve_mode`, described): the fair clock's mode before
        the trainer prepares them (a fallback may change it)."""
        from headsearch.training.fastpath import resolve_mode

        return resolve_mode(cfg.train, task, self.device).describe()

    def alone_key(self, cfg: Any, step_mode: str) -> str:
        """`alone_key` of `cfg` run in `step_mode` on this seat (a CPU's key names a lone process's threads)."""
        return alone_key(cfg, self.device, self.alone_threads if self.device.type == "cpu" else None, step_mode)

    def clock(self, study: Any, cfg: Any, intended: str, note_key=None):
        """A fair clock (`training.clock.AloneClock`) for `cfg` on this seat (a trial's, or a cost measurement's) that
        knows the epoch seconds alone an earlier trial of `study` measured in the step mode that runs: the one
        `intended` (`step_mode`), then the one its steps were prepared in (then nobody is paused again).
        `note_key(alone_key)` hears each mode's key as it is looked up."""
        from headsearch.training.clock import AloneClock

        def recall(step_mode: str) -> float | None:
            key = self.alone_key(cfg, step_mode)
            if note_key is not None:
                note_key(key)
            return known_epoch_seconds(study, key)

        return AloneClock(self.share, known=recall(intended), alone_threads=self.alone_threads, recall=recall)
