"""ArchConfig/TrainConfig/RunConfig validation and YAML round trips."""
from pathlib import Path

import pytest
import yaml

from headsearch.config import ArchConfig, RunConfig, TrainConfig, load_yaml, parse_yaml
from headsearch.errors import ConfigError
from headsearch.tasks import apply_overrides, get_task, flag_overrides, resolve_config

# make test-oldest runs this module on the floor: PyYAML.
pytestmark = pytest.mark.floor


def test_defaults_are_the_ham_papers_vit():
    a = ArchConfig()
    assert (a.d_model, a.enc_layers, a.enc_heads, a.d_ff, a.activation, a.patch_size) == (48, 4, (4, 4, 4, 4), 192, "gelu", 4)
    assert a.head_width(4) == 12 and a.attn_dim(4) == 48


def test_deep_head_schedule_and_widths():
    a = ArchConfig(d_model=512, enc_layers=6, enc_heads=[64, 32, 16, 8, 4, 2], dec_layers=6, dec_heads=8)
    assert [a.head_width(h) for h in a.enc_heads] == [8, 16, 32, 64, 128, 256]
    assert {a.attn_dim(h) for h in a.enc_heads} == {512}  # the same weights shape whatever the schedule
    fixed = ArchConfig(d_model=48, enc_heads=[4, 2, 2, 1], head_dim=16)
    assert [fixed.attn_dim(h) for h in fixed.enc_heads] == [64, 32, 32, 16]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(enc_heads=[4, 4, 4]), "enc_heads lists 3 head counts but enc_layers is 4"),
        (dict(enc_heads=[4, 5, 4, 4]), r"enc_heads\[1\] = 5 does not divide d_model = 48"),
        (dict(enc_heads=[4, 0, 4, 4]), "at least one head"),
        (dict(skip="residual"), "skip = 'residual' is not known: use one of none, output, scores"),
        (dict(fusion="multiply"), "fusion = 'multiply' is not known: use one of none, hadamard, add"),
        (dict(enc_heads=[8, 6, 4, 2], skip="scores"), "one count must divide the other"),
        (dict(enc_heads=[4, 2, 2, 1], head_dim=16, skip="output"), "skip 'output' adds merged head outputs"),
        (dict(dropout=1.0), r"dropout = 1.0 must be in \[0, 1\)"),
        (dict(head_dim=0), "head_dim"),
        (dict(enc_heads="4,x"), "is not a list of head counts"),
        (dict(dec_layers=2, dec_heads=[8]), "dec_heads lists 1 head counts but dec_layers is 2"),
    ],
)
def test_invalid_arch_configs_say_what_to_change(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ArchConfig(**kwargs)


def test_fixed_head_dim_allows_counts_that_do_not_divide_d_model():
    a = ArchConfig(d_model=48, enc_heads=[5, 5, 5, 5], head_dim=8)
    assert a.attn_dim(5) == 40


def test_heads_accept_int_list_and_comma_string():
    assert ArchConfig(enc_heads=2).enc_heads == (2, 2, 2, 2)
    assert ArchConfig(enc_heads="8,4,2,1").enc_heads == (8, 4, 2, 1)


def test_from_dict_infers_layers_and_rejects_unknown_keys():
    base = ArchConfig()
    a = ArchConfig.from_dict({"d_model": 512, "enc_heads": [64, 32, 16, 8, 4, 2]}, base=base)
    assert a.enc_layers == 6 and a.d_ff == base.d_ff
    assert ArchConfig.from_dict({"enc_layers": 6}, base=base).enc_heads == (4,) * 6  # uniform stays uniform
    with pytest.raises(ConfigError, match="unknown arch key"):
        ArchConfig.from_dict({"n_heads": 4})


def test_arch_round_trips_through_yaml():
    a = ArchConfig(d_model=64, enc_layers=3, enc_heads=[8, 4, 2], dec_layers=2, dec_heads=4, skip="scores",
                   skip_mean=True, fusion="hadamard", soft_dim=6, soft_score="key", head_dim="split")
    assert ArchConfig.from_dict(yaml.safe_load(yaml.safe_dump(a.to_dict()))) == a


def test_train_config_validation():
    with pytest.raises(ConfigError, match="optimizer = 'sgd' is not known"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="lr = 0"):
        TrainConfig(lr=0)
    with pytest.raises(ConfigError, match="unknown train key"):
        TrainConfig.from_dict({"learning_rate": 1.0})


@pytest.mark.parametrize("given, mode", [
    (True, "default"), (False, "off"), (None, "off"),  # configs from before compile took a mode
    ("auto", "auto"), ("off", "off"), ("graphs", "graphs"), ("default", "default"), ("reduce-overhead", "reduce-overhead"),
    ("max-autotune", "max-autotune"),
])
def test_compile_takes_a_mode_or_an_old_boolean(given, mode):
    assert TrainConfig(compile=given).compile == mode
    assert TrainConfig.from_dict({"compile": given}, base=TrainConfig()).compile == mode


def test_compile_defaults_to_auto_and_rejects_an_unknown_mode_in_one_line():
    assert TrainConfig().compile == "auto"  # the fastest the device allows (eager on the CPU)
    with pytest.raises(ConfigError) as e:
        TrainConfig(compile="fast")
    assert str(e.value) == "compile = 'fast' is not known: use one of auto, off, graphs, default, reduce-overhead, max-autotune"


def test_old_yaml_booleans_and_new_modes_round_trip():
    assert TrainConfig.from_dict(parse_yaml("compile: true\n")).compile == "default"
    assert TrainConfig.from_dict(parse_yaml("compile: false\n")).compile == "off"
    t = TrainConfig(compile="reduce-overhead", channels_last="on")
    assert TrainConfig.from_dict(parse_yaml(yaml.safe_dump(t.to_dict()))) == t
    cfg = resolve_config("vit-cifar10", overrides=flag_overrides(compile="max-autotune"))
    assert cfg.train.compile == "max-autotune"
    assert "compile: max-autotune" in cfg.to_yaml()


def test_channels_last_is_on_for_cuda_only_when_auto():
    assert TrainConfig().channels_last == "auto"
    assert TrainConfig().uses_channels_last("cuda") and not TrainConfig().uses_channels_last("cpu")
    assert TrainConfig(channels_last="on").uses_channels_last("cpu")
    assert not TrainConfig(channels_last="off").uses_channels_last("cuda")
    with pytest.raises(ConfigError, match="channels_last = 'yes' is not known: use one of auto, on, off"):
        TrainConfig(channels_last="yes")


def test_run_config_round_trips_through_a_file(tmp_path):
    cfg = resolve_config("vit-cifar10", preset="tiny", overrides=flag_overrides(epochs=3, seed=7))
    assert cfg.train.epochs == 3 and cfg.seed == 7 and cfg.data.train_limit == 20000
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert resolve_config("vit-cifar10", config=path) == cfg
    assert isinstance(cfg, RunConfig)


def test_seed_defaults_per_task():
    vit = resolve_config("vit-cifar10")
    assert (vit.train.lr, vit.train.weight_decay, vit.train.batch_size, vit.train.epochs) == (1e-2, 1e-2, 256, 400)
    tr = resolve_config("translation-en-es")
    assert (tr.arch.d_model, tr.arch.enc_layers, tr.arch.dec_layers, tr.arch.d_ff) == (512, 6, 6, 2048)
    assert (tr.train.lr, tr.train.eps, tr.train.label_smoothing, tr.train.batch_size) == (1e-4, 1e-9, 0.1, 32)
    assert tr.data.max_len == 350 and tr.data.min_frequency == 2


def test_overrides_reject_wrong_task_and_unknown_sections():
    task = get_task("vit-cifar10")
    with pytest.raises(ConfigError, match="pass --task translation-en-es"):
        apply_overrides(task, resolve_config(task), {"task": "translation-en-es", "arch": {}})
    with pytest.raises(ConfigError, match="unknown config section"):
        apply_overrides(task, resolve_config(task), {"model": {}})
    with pytest.raises(ConfigError, match="unknown data option"):
        apply_overrides(task, resolve_config(task), {"data": {"max_len": 3}})
    with pytest.raises(ConfigError, match="no preset 'huge'"):
        resolve_config(task, preset="huge")


def test_load_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("arch: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(scalar)


# -- typed data options and RunConfig ---------------------------------------------------------------


@pytest.mark.parametrize("task, data, message", [
    ("vit-cifar10", {"val_size": -1}, r"data.val_size = -1 must be in \[0, 50000\)"),
    ("vit-cifar10", {"train_limit": 0}, "data.train_limit = 0 must be between 1 and 45000"),
    ("vit-cifar10", {"val_size": 10000, "train_limit": 45000}, "must be between 1 and 40000"),
    ("vit-cifar10", {"test_limit": 20000}, "data.test_limit = 20000 must be between 1 and 10000"),
    ("vit-cifar10", {"augment": "flip"}, "data.augment = 'flip' must be a list"),
    ("vit-cifar10", {"augment": ["flip", "rotate"]}, r"unknown augmentation\(s\) \['rotate'\]"),
    ("vit-cifar10", {"eval_batch_size": 0}, "data.eval_batch_size = 0 must be at least 1"),
    ("vit-cifar10", {"train_limit": "many"}, "train_limit = 'many' must be an integer"),
    ("translation-en-es", {"val_size": 1.5}, r"data.val_size = 1.5 must be a whole number of pairs \(>= 0\) or a fraction"),
    ("translation-en-es", {"test_size": "x"}, "data.test_size = 'x' must be a count of pairs or a fraction"),
    ("translation-en-es", {"max_len": 3}, "data.max_len = 3 is too short"),
    ("translation-en-es", {"vocab_size": 4}, "must exceed the 4 special tokens"),
    ("translation-en-es", {"min_frequency": 0}, "data.min_frequency = 0 must be at least 1"),
    ("translation-en-es", {"train_limit": -5}, "data.train_limit = -5 must be at least 1"),
])
def test_data_options_are_checked_when_the_config_is_resolved(task, data, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(task, overrides={"data": data})


def test_data_options_are_typed_and_round_trip():
    cfg = resolve_config("translation-en-es", overrides={"data": {"val_size": 0.1, "test_size": 300.0, "train_limit": "2000"}})
    assert (cfg.data.val_size, cfg.data.test_size, cfg.data.train_limit) == (0.1, 300, 2000)
    assert isinstance(cfg.data.test_size, int) and isinstance(cfg.data.train_limit, int)
    vit = resolve_config("vit-cifar10", overrides={"data": {"augment": ["pad_crop"]}})
    assert vit.data.augment == ("pad_crop",) and vit.to_dict()["data"]["augment"] == ["pad_crop"]
    for cfg in (cfg, vit):
        assert resolve_config(cfg.task, config=parse_yaml(cfg.to_yaml())) == cfg


def test_run_config_checks_its_own_fields():
    with pytest.raises(ConfigError, match="seed = -1 must be a non-negative integer"):
        RunConfig(task="vit-cifar10", seed=-1)
    with pytest.raises(ConfigError, match="seed = True must be a non-negative integer"):
        RunConfig(task="vit-cifar10", seed=True)
    with pytest.raises(ConfigError, match="task = '' must be a task name"):
        RunConfig(task="")
    with pytest.raises(ConfigError, match="arch = 3 must be a mapping"):
        RunConfig(task="vit-cifar10", arch=3)
    with pytest.raises(ConfigError, match="data = 3 must be a mapping"):
        RunConfig(task="vit-cifar10", data=3)
    assert RunConfig(task="vit-cifar10", arch={"d_model": 64}).arch.d_model == 64  # a mapping becomes the dataclass


def test_resolution_order_is_defaults_preset_search_config_flags(tmp_path):
    plain = resolve_config("vit-cifar10", preset="tiny")
    search = resolve_config("vit-cifar10", preset="tiny", search=True)
    assert (plain.train.epochs, plain.data.train_limit) == (6, 20000)
    assert (search.train.epochs, search.data.train_limit, search.data.augment) == (4, 6000, ("flip",))
    path = tmp_path / "c.yaml"
    path.write_text("task: vit-cifar10\narch: {}\ntrain: {epochs: 9}\n")
    assert resolve_config("vit-cifar10", preset="tiny", config=path).train.epochs == 9
    flagged = resolve_config("vit-cifar10", preset="tiny", config=path, overrides=flag_overrides(epochs=2, seed=3, compile=None))
    assert (flagged.train.epochs, flagged.seed, flagged.train.compile) == (2, 3, "auto")
    assert flag_overrides(epochs=None, seed=None) == {}


@pytest.mark.parametrize("train, message", [
    ({"eps": -1e-8}, "eps = -1e-08 must be positive"),
    ({"eps": 0}, "eps = 0.0 must be positive"),
    ({"betas": [0.9, 1.0]}, r"betas = \[0.9, 1.0\] must both be in \[0, 1\)"),
    ({"betas": [-0.1, 0.9]}, r"must both be in \[0, 1\)"),
    ({"weight_decay": float("nan")}, "weight_decay = nan must be a finite number"),
    ({"lr": float("inf")}, "lr = inf must be a finite number"),
    ({"lr": "inf"}, "lr = inf must be a finite number"),
    ({"min_lr_ratio": -0.1}, r"min_lr_ratio = -0.1 must be in \[0, 1\]"),
    ({"min_lr_ratio": 1.5}, r"min_lr_ratio = 1.5 must be in \[0, 1\]"),
    ({"grad_clip": float("inf")}, "grad_clip = inf must be a finite number"),
])
def test_optimizer_and_schedule_values_out_of_range_are_refused(train, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(train)


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "is a folder, not a file"),
    (lambda p: p.write_bytes(b"\xff\xfe\x00binary\x80"), "is not UTF-8 text"),
])
def test_config_files_that_are_not_text_files_get_their_own_line(tmp_path, make, message):
    path = tmp_path / "c.yaml"
    make(path)
    with pytest.raises(ConfigError, match=message):
        load_yaml(path)
    from headsearch.search.space import load_space

    with pytest.raises(ConfigError, match=message):
        load_space(str(path))


def test_an_unreadable_file_is_said_to_be_unreadable(tmp_path, monkeypatch):
    """Permission denied, whoever runs the tests: as root chmod 000 does not stop reading (test_fuzz.py
    covers the real chmod as any other user), so the check is shown the answer a user would get."""
    import os

    from headsearch.config import path_problem

    path = tmp_path / "c.yaml"
    path.write_text("d_model: 48\n")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == path else real_access(p, mode, **kw))
    assert path_problem(path, "file") == "is not readable (permission denied)"
    with pytest.raises(ConfigError, match="c.yaml is not readable \\(permission denied\\)"):
        load_yaml(path)
    monkeypatch.undo()

    def denied(self, *args, **kwargs):  # readable by its mode bits, refused when opened (an ACL, a FUSE mount)
        raise PermissionError(13, "Permission denied", str(self))

    from headsearch.analysis.run import load_run
    from headsearch.errors import HeadsearchError

    run = tmp_path / "run"  # an unreadable checkpoint is said to be unreadable, not "truncated or corrupt"
    run.mkdir()
    (run / "config.yaml").write_text("task: vit-cifar10\n")
    (run / "model.safetensors").write_bytes(b"\0" * 16)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p).name == "model.safetensors" else real_access(p, mode, **kw))
    with pytest.raises(HeadsearchError, match="model.safetensors is not readable \\(permission denied\\)"):
        load_run(run, None, "cpu")
    monkeypatch.undo()

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigError, match="is not readable \\(permission denied\\): fix its permissions"):
        load_yaml(path)


@pytest.mark.parametrize("device, message", [
    ("foo", "--device 'foo' is not a device"),
    ("meta", "headsearch trains on cpu or cuda"),
])
def test_unknown_devices_are_bad_input(device, message):
    from headsearch.training import check_device

    with pytest.raises(ConfigError, match=message):
        check_device(device)
    check_device("cpu")
    check_device("auto")


def test_cuda_on_a_machine_without_it_is_bad_input():
    import torch

    from headsearch.training import check_device

    if torch.cuda.is_available():  # a GPU machine: the device exists, and an index past the last does not
        with pytest.raises(ConfigError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ConfigError, match="--device cuda: this machine has no CUDA GPU"):
            check_device("cuda")
