"""Cohorts (headsearch.models.cohort, headsearch.training.cohort): K runs trained as one stacked model, each
slot exactly as it trains alone."""
from __future__ import annotations

import json

import pytest
import torch

from headsearch.config import ArchConfig
from headsearch.errors import ConfigError
from headsearch.models import variants
from headsearch.models.cohort import StackedViT, soft_width, stack_refusal
from headsearch.models.vit import ViT
from headsearch.tasks import DataSource, apply_overrides, get_task, resolve_config
from headsearch.training import train_bound
from headsearch.training.cohort import Cohort, cohort_key
from headsearch.training.runtime import resolve_device
from headsearch.training.trainer import Callback

VIT = get_task("vit-cifar10")
# Mixed: schedules, every skip, every fusion (and the scores skip's running mean).
MIXED = [
    dict(enc_heads=[4, 4, 4, 4]),
    dict(enc_heads=[8, 4, 2, 1], skip="scores"),
    dict(enc_heads=[1, 2, 4, 8], skip="output", fusion="hadamard"),
    dict(enc_heads=[2, 2, 16, 16], skip="scores", skip_mean=True, fusion="add"),
]
E = 5  # steps an epoch: enough for per-step losses to drift apart if a slot computed anything else
SMALL = {"seed": 0, "train": {"epochs": 2, "max_steps_per_epoch": E, "batch_size": 32, "lr": 3e-3, "weight_decay": 0.05,
                              "warmup_epochs": 0.5, "schedule": "cosine", "grad_clip": 1.0},
         "data": {"train_limit": 640, "val_size": 200, "test_limit": 200, "augment": ["resized_crop", "flip"]}}


def config(arch: dict, overrides: dict = SMALL, **train):
    """The tiny ViT on 8x8 patches (17 tokens, not 65: the soft branch costs T^2 and nothing here depends on
    the patch), with `arch` and `train` on top."""
    o = json.loads(json.dumps(overrides))
    o["train"].update(train)
    return apply_overrides(VIT, resolve_config(VIT), {**o, "arch": {"patch_size": 8, **arch}})


# ------------------------------------------------------------------------------ the stacked model


def solo_and_stacked(archs: list[ArchConfig], soft_columns: int) -> tuple[list[ViT], StackedViT]:
    """A solo float64 ViT per arch (seeded by its index) and a cohort holding copies of them."""
    models = []
    for i, a in enumerate(archs):
        torch.manual_seed(i)
        models.append(ViT(a).double())
    return models, StackedViT.from_models(models, soft_columns=soft_columns).double()


def assert_each_slot_computes_what_its_solo_model_computes(models: list[ViT], stacked: StackedViT) -> None:
    """Slot k's logits and every parameter's gradient equal solo model k's (float64, to rounding)."""
    x = torch.randn(len(models), 3, 3, 32, 32, dtype=torch.float64)
    out = stacked(x)
    out.square().sum().backward()
    for k, m in enumerate(models):
        torch.testing.assert_close(out[k], m(x[k]), rtol=1e-12, atol=1e-12)
        m(x[k]).square().sum().backward()
        for name, p in m.named_parameters():
            g = stacked.params[name.replace(".", "__")].grad[k]
            if ".soft." in name:  # stored as rows (h·d_k or h) x columns
                flat = p.grad.reshape(-1, p.grad.shape[-1])
                g, ref = g[: flat.shape[0], : flat.shape[1]], flat
            else:
                ref = p.grad
            torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12, msg=f"slot {k} {name}")


def test_each_slot_computes_what_its_solo_model_computes_forward_and_backward():
    archs = [ArchConfig(**a) for a in MIXED] + [ArchConfig(enc_heads=4, skip="scores"), ArchConfig(enc_heads=4, fusion="add"),
                                                 ArchConfig(**MIXED[0])]
    models, stacked = solo_and_stacked(archs, soft_columns=48)
    # Both ways of taking a group's slots: a view of a run of slots, and a gather (slots 0 and 6 split alike).
    groups = [g for layer in stacked.groups for g in layer]
    assert any(g.index is None and len(g.slots) < len(archs) for g in groups)
    assert any(g.slots == (0, 6) and g.index is not None for g in groups)
    assert_each_slot_computes_what_its_solo_model_computes(models, stacked)


# Every fusion x every skip of the models' tables, and the running mean where the skip carries scores: a
# variant added to the tables is checked here without a list to extend.
VARIANTS = [(fusion, name, mean) for fusion, f in variants.FUSIONS.items() for name, skip in variants.SKIPS.items()
            for mean in ((False, True) if skip.carries_scores else (False,)) if f.stacks and skip.stacks]
# The rows the batched core does not implement: refused in one line that names them, and such a trial trains alone.
UNSTACKED = [("skip", n) for n, v in variants.SKIPS.items() if not v.stacks] + [
    ("fusion", n) for n, v in variants.FUSIONS.items() if not v.stacks]
TINY = dict(d_model=16, enc_layers=2, d_ff=32, patch_size=8)  # 17 tokens: a few ms a model


@pytest.mark.parametrize("fusion,skip,skip_mean", VARIANTS)
def test_every_fusion_and_skip_computes_in_a_cohort_what_it_computes_alone(fusion, skip, skip_mean):
    """The variant with falling and with rising head counts (the scores skip maps between them), beside a
    plain slot, so its group is not the whole layer."""
    variant = dict(skip=skip, skip_mean=skip_mean, fusion=fusion)
    archs = [ArchConfig(**TINY, enc_heads=[4, 2], **variant), ArchConfig(**TINY, enc_heads=[2, 4], **variant),
             ArchConfig(**TINY, enc_heads=[4, 4])]
    models, stacked = solo_and_stacked(archs, soft_columns=16)
    assert_each_slot_computes_what_its_solo_model_computes(models, stacked)


@pytest.mark.parametrize("field,name", UNSTACKED)
def test_a_variant_the_cohort_does_not_implement_is_refused_in_one_line_and_trains_alone(field, name):
    arch = ArchConfig(**TINY, enc_heads=[4, 2], **{field: name})
    why = stack_refusal(arch)
    assert why == f"{field} {name!r} is not in the cohort's batched core (models/cohort.py)"
    with pytest.raises(ValueError, match="is not in the cohort's batched core"):
        StackedViT([ArchConfig(**TINY, enc_heads=[4, 2]), arch], soft_columns=16)


@pytest.mark.parametrize("field,name,known", [("fusion", "concat", variants.FUSIONS), ("skip", "ladder", variants.SKIPS)],
                         ids=["fusion", "skip"])
def test_an_unknown_fusion_or_skip_is_refused_when_a_cohort_is_built_or_refilled(field, name, known):
    good, bad = ArchConfig(**TINY, enc_heads=2), ArchConfig(**TINY, enc_heads=2)
    object.__setattr__(bad, field, name)  # past ArchConfig's check: a name config.py lists and the tables lack
    expected = f"{field} = {name!r} is not known"
    with pytest.raises(ConfigError, match=expected) as built:
        StackedViT([good, bad], soft_columns=16)  # the second slot: the first also builds the template ViT
    stacked = StackedViT([good, good], soft_columns=16)
    refill = ViT(good)
    refill.cfg = bad
    with pytest.raises(ConfigError, match=expected) as refilled:
        stacked.load_slot(1, refill)
    assert stacked.archs[1] == good  # refused before the slot changed
    for e in (built, refilled):
        assert "\n" not in str(e.value) and ", ".join(known) in str(e.value)


def test_a_slot_round_trips_to_a_solo_state_dict_and_a_refill_replaces_it():
    a, b = ArchConfig(enc_heads=[8, 4, 2, 1], skip="output", fusion="hadamard"), ArchConfig(enc_heads=2, skip="scores")
    torch.manual_seed(0)
    ma, mb = ViT(a), ViT(b)
    stacked = StackedViT.from_models([ma, ma], soft_columns=48)
    state = stacked.slot_state(1)
    assert state.keys() == ma.state_dict().keys()
    for name, value in ma.state_dict().items():
        assert torch.equal(state[name], value), name
    stacked.load_slot(1, mb)
    assert stacked.archs[1] == b and stacked.slot_state(1).keys() == mb.state_dict().keys()
    x = torch.randn(2, 2, 3, 32, 32)
    out = stacked(x)
    torch.testing.assert_close(out[0], ma(x[0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1], mb(x[1]), rtol=1e-5, atol=1e-6)
    # Refilled without fusion, slot 1's soft weights start at zero: nothing of the previous trial is left.
    assert stacked.params["encoder__blocks__1__attn__soft__w_key"][1].abs().sum() == 0


def test_what_cannot_stack_says_why():
    assert stack_refusal(ArchConfig()) is None
    assert "head count" in stack_refusal(ArchConfig(head_dim=16))
    assert "dropout" in stack_refusal(ArchConfig(dropout=0.1))
    assert soft_width(ArchConfig(enc_heads=[4, 2, 2, 1]), 1) == 48 and soft_width(ArchConfig(soft_dim=8), 1) == 8
    with pytest.raises(ValueError, match="soft-branch columns"):
        StackedViT.from_models([ViT(ArchConfig(fusion="add"))], soft_columns=None)


def test_the_cohort_key_ignores_only_what_a_slot_keeps_for_itself():
    base = config(MIXED[0])
    assert cohort_key(base) == cohort_key(config(MIXED[3], lr=1e-2))
    assert cohort_key(base) != cohort_key(config(MIXED[0], batch_size=64))
    assert cohort_key(base) != cohort_key(config({**MIXED[0], "d_ff": 96}))


# ------------------------------------------------------------------------------ equality with solo training


class StepLosses(Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_step(self, info):
        self.losses.append(info.loss)


def solo(cfg, bound, run_dir):
    steps = StepLosses()
    from headsearch.training.trainer import fit

    from headsearch.training.rundir import create_run_dir

    create_run_dir(run_dir, cfg.to_yaml(), None)
    result = fit(VIT, bound.rebind(cfg), device=torch.device("cpu"), run_dir=run_dir, callbacks=[steps], log_seconds=0)
    return result, steps.losses


@pytest.mark.slow
def test_a_cohort_of_four_mixed_slots_trains_each_as_alone(cifar_dir, tmp_path, one_thread):
    """Per-step losses over 2 epochs of E steps within 1e-4 relative in float32, and the same metrics,
    for schedules, skips and fusions mixed, with per-slot learning rates."""
    cfgs = [config(a, lr=lr) for a, lr in zip(MIXED, (3e-3, 1e-3, 3e-3, 2e-3))]
    bound = VIT.setup(cfgs[0], DataSource(cifar_dir), torch.device("cpu"))
    cohort = Cohort(VIT, 4, torch.device("cpu"), soft_columns=48, keep_step_losses=True)
    for i, cfg in enumerate(cfgs):
        cohort.add(cfg, bound.rebind(cfg), tmp_path / f"cohort-{i}")
    ends = cohort.train_epoch()
    assert ends == [] and cohort.occupied == [0, 1, 2, 3]
    ends = cohort.train_epoch()
    assert sorted(e.slot for e in ends) == [0, 1, 2, 3] and cohort.free == [0, 1, 2, 3]
    stacked_losses = torch.stack(cohort.step_losses)  # (2E, 4)
    assert stacked_losses.shape == (2 * E, 4)
    for end in ends:
        k, cfg = end.slot, cfgs[end.slot]
        ref, losses = solo(cfg, bound, tmp_path / f"solo-{k}")
        torch.testing.assert_close(stacked_losses[:, k].double(), torch.tensor(losses, dtype=torch.float64),
                                   rtol=1e-4, atol=0, msg=f"slot {k}")
        got = end.result
        assert got.status == "completed" and got.error is None and got.epochs_run == 2 and got.steps == 2 * E
        assert got.params == ref.params and got.best_epoch == ref.best_epoch
        assert abs(got.best_metrics["accuracy"] - ref.best_metrics["accuracy"]) <= 0.01
        assert abs(got.test_metrics["accuracy"] - ref.test_metrics["accuracy"]) <= 0.01
        # The run directory holds what a solo run's holds.
        run_dir = tmp_path / f"cohort-{k}"
        for name in ("config.yaml", "model.safetensors", "metrics.jsonl", "final.json", "split.json"):
            assert (run_dir / name).exists(), name
        assert (run_dir / "config.yaml").read_text() == (tmp_path / f"solo-{k}" / "config.yaml").read_text()


class PruneAt(Callback):
    """Stops its run after `epoch`, as the search's pruner does (raising optuna.TrialPruned)."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_epoch_end(self, record):
        import optuna

        if record.epoch == self.epoch:
            raise optuna.TrialPruned(f"pruned at epoch {record.epoch}")


@pytest.mark.slow
def test_a_pruned_slot_is_refilled_and_the_newcomer_trains_from_its_own_epoch_one(cifar_dir, tmp_path, one_thread):
    """Slot 0 is pruned after epoch 1; a new run takes it and trains its epoch 1 beside slot 1's epoch 2. The
    newcomer's losses are its solo run's, and slot 1 never noticed."""
    import optuna

    cfg_a, cfg_b, cfg_c = config(MIXED[0]), config(MIXED[1]), config(MIXED[3], lr=2e-3)
    bound = VIT.setup(cfg_a, DataSource(cifar_dir), torch.device("cpu"))
    cohort = Cohort(VIT, 2, torch.device("cpu"), soft_columns=48, keep_step_losses=True)
    cohort.add(cfg_a, bound.rebind(cfg_a), callbacks=[PruneAt(1)], tag="a")
    cohort.add(cfg_b, bound.rebind(cfg_b), tag="b")
    (end,) = cohort.train_epoch()
    assert (end.slot, end.tag, end.result.status, end.result.epochs_run) == (0, "a", "stopped", 1)
    assert isinstance(end.error, optuna.TrialPruned) and cohort.free == [0]
    assert cohort.add(cfg_c, bound.rebind(cfg_c), tag="c") == 0
    (end,) = cohort.train_epoch()
    assert (end.tag, end.result.status, end.result.epochs_run) == ("b", "completed", 2)
    losses = torch.stack(cohort.step_losses)  # (2E, 2)
    _, solo_b = solo(cfg_b, bound, tmp_path / "b")
    _, solo_c = solo(cfg_c, bound, tmp_path / "c")
    torch.testing.assert_close(losses[:, 1].double(), torch.tensor(solo_b, dtype=torch.float64), rtol=1e-4, atol=0)
    torch.testing.assert_close(losses[E:, 0].double(), torch.tensor(solo_c[:E], dtype=torch.float64), rtol=1e-4, atol=0)
    # The newcomer finishes alone in the cohort: an empty slot takes no part in anything.
    (end,) = cohort.train_epoch()
    assert (end.tag, end.result.status) == ("c", "completed")
    torch.testing.assert_close(losses.new_tensor([float(s[0]) for s in cohort.step_losses[2 * E:]]).double(),
                               torch.tensor(solo_c[E:], dtype=torch.float64), rtol=1e-4, atol=0)


@pytest.mark.slow
def test_a_slots_time_is_its_architectures_alone_not_the_cohorts(cifar_dir, tmp_path, one_thread):
    """A known speed is taken as is (nobody paused); an unknown one is measured by a solo copy under the exclusive
    hold. Either way time = best epoch x that figure, whatever else trains in the cohort."""
    from tests.test_fairtime import RecordingShare
    from headsearch.training.clock import AloneClock

    cfg_a, cfg_b = config(MIXED[0]), config(MIXED[2])
    bound = VIT.setup(cfg_a, DataSource(cifar_dir), torch.device("cpu"))
    share = RecordingShare()
    cohort = Cohort(VIT, 2, torch.device("cpu"), soft_columns=48, share=share)
    cohort.add(cfg_a, bound.rebind(cfg_a), clock=AloneClock(share, known=1.5, alone_threads=1))
    assert share.holds == []
    cohort.add(cfg_b, bound.rebind(cfg_b), clock=AloneClock(share, known=None, alone_threads=1))
    assert "exclusive" in share.holds
    share.holds.clear()
    cohort.train_epoch()
    ends = cohort.train_epoch()
    assert share.holds == ["shared", "shared"]  # each cohort epoch: one shared hold
    a, b = sorted(ends, key=lambda e: e.slot)
    assert a.result.epoch_seconds_alone == 1.5 and a.result.best_seconds_alone == a.result.best_epoch * 1.5
    assert 0 < b.result.epoch_seconds_alone < 60
    assert b.result.best_seconds_alone == pytest.approx(b.result.best_epoch * b.result.epoch_seconds_alone)
    # The raw seconds are the cohort's epochs', the same for both runs.
    assert a.result.train_seconds == b.result.train_seconds


class InterruptAt(Callback):
    def on_epoch_end(self, record):
        raise KeyboardInterrupt


def test_an_interrupted_epoch_keeps_what_ended_before_it_and_ends_the_rest_as_interrupted(cifar_dir, one_thread):
    import optuna

    cfg_a, cfg_b = config(MIXED[0]), config(MIXED[1])
    bound = VIT.setup(cfg_a, DataSource(cifar_dir), torch.device("cpu"))
    cohort = Cohort(VIT, 2, torch.device("cpu"), soft_columns=48)
    cohort.add(cfg_a, bound.rebind(cfg_a), callbacks=[PruneAt(1)], tag="a")
    cohort.add(cfg_b, bound.rebind(cfg_b), callbacks=[InterruptAt()], tag="b")
    with pytest.raises(KeyboardInterrupt):
        cohort.train_epoch()
    a, b = cohort.interrupt()
    assert (a.tag, a.result.status, type(a.error)) == ("a", "stopped", optuna.TrialPruned)
    assert (b.tag, b.result.status, b.result.epochs_run) == ("b", "interrupted", 1)
    assert cohort.occupied == [] and cohort.interrupt() == []
