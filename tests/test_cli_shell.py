"""The CLI as a shell over headsearch.api: the commands call the api (one wiring), exceptions become exits in
one place (`cli.common.exits`), and the help groups options in panels with no `<bool>` on flags."""
from __future__ import annotations

import json

import pytest

from headsearch import api
from headsearch.errors import HeadsearchError

PANELS = ("Search", "Pruning", "Storage and workers", "Training", "Tracking")


def test_run_help_groups_its_options_in_panels_and_flags_show_no_metavar(cli):
    result = cli(["run", "--help"])
    assert result.exit_code == 0, result.output
    titles = [line.split("─ ", 1)[1].split(" ─")[0] for line in result.stdout.splitlines() if line.startswith("╭─ ")]
    assert titles == ["Options", *PANELS]
    assert "<bool>" not in result.stdout and "list[" not in result.stdout
    for command in ([], ["report"], ["analyze"], ["export"], ["train"], ["compare"], ["table"], ["bench"]):
        shown = cli([*command, "--help"])
        assert shown.exit_code == 0 and "<bool>" not in shown.stdout, (command, shown.stdout)
    assert "--ablation" in cli(["analyze", "--help"]).stdout and "--pruning-audit" in cli(["report", "--help"]).stdout


def _raise(*args, **kwargs):
    raise HeadsearchError("the api says no")


@pytest.mark.parametrize("argv, function", [
    (["train", "--task", "vit-cifar10"], "train"),
    (["run", "--task", "vit-cifar10"], "search_study"),
    (["compare", "a.yaml", "b.yaml", "--task", "vit-cifar10"], "compare"),
    (["report", "--robust", "2"], "robust"),
    (["table", "--task", "vit-cifar10", "--out", "t.json"], "table"),
])
def test_the_commands_call_the_api_and_its_errors_are_one_line(argv, function, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(api, function, _raise)
    cli.error_line(cli([*argv, "--storage", f"sqlite:///{tmp_path / 'h.db'}"] if argv[0] != "train" else argv),
                   "the api says no")
    assert list(tmp_path.iterdir()) == []


def test_exits_turns_each_exception_into_its_exit(capsys):
    import typer

    from headsearch.cli.common import exits

    def code_of(error: BaseException, **texts) -> int:
        @exits(**texts)
        def command():
            raise error

        with pytest.raises(typer.Exit) as stopped:
            command()
        return stopped.value.exit_code

    assert code_of(HeadsearchError("bad")) == 2
    assert capsys.readouterr().err == "error: bad\n"
    assert code_of(api.SearchFailed("worker 0 failed", 1)) == 1
    assert capsys.readouterr().err == "error: worker 0 failed\n"
    assert code_of(KeyboardInterrupt(), interrupted="kept") == 130
    assert capsys.readouterr().err == "error: interrupted: kept\n"
    assert code_of(OSError(28, "No space left on device"), kept="runs are kept") == 1
    assert capsys.readouterr().err == "error: No space left on device: runs are kept\n"
    with pytest.raises(KeyboardInterrupt):  # no `interrupted`: Ctrl-C goes on as Python raises it
        exits()(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))()
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        exits(kept="x")(lambda: 1 / 0)()


TINY = {"task": "vit-cifar10", "seed": 0, "arch": {"d_model": 32, "d_ff": 64, "enc_layers": 2, "enc_heads": [2, 2]},
        "train": {"epochs": 2, "max_steps_per_epoch": 1, "batch_size": 16},
        "data": {"train_limit": 64, "val_size": 32, "test_limit": 32}}


@pytest.mark.slow
def test_api_train_and_the_cli_train_the_same_run(cli, tmp_path, cifar_dir, write_yaml, one_thread):
    """The same config through `headsearch train` and `api.train`: the same metrics, diversity tracked in both."""
    config = write_yaml(tmp_path / "run.yaml", TINY)
    by_cli = tmp_path / "cli"
    result = cli(["train", "--task", "vit-cifar10", "--config", config, "--data-dir", cifar_dir, "--out", by_cli,
                  "--device", "cpu", "--track-diversity", "8", "--set", "train.lr=2e-3"])
    assert result.exit_code == 0, result.output
    run = api.train("vit-cifar10", str(config), data_dir=cifar_dir, out=tmp_path / "api", device="cpu",
                    track_diversity=8, sets={"train": {"lr": 2e-3}})
    assert run.config.train.diversity_samples == 8 and run.config.train.lr == 2e-3

    def records(d):
        return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]

    for a, b in zip(records(by_cli), records(run.run_dir), strict=True):
        assert a["diversity"] and a["diversity"] == b["diversity"]  # tracked through the api too
        assert {k: v for k, v in a.items() if "metric" in k or k == "train_loss"} == \
               {k: v for k, v in b.items() if "metric" in k or k == "train_loss"}
    final = json.loads((by_cli / "final.json").read_text())
    assert final["test_metrics"] == run.result.test_metrics


def test_a_config_that_asks_for_diversity_is_tracked_by_api_train(tmp_path, cifar_dir, write_yaml, one_thread):
    """The drift the CLI's shell closed: api.train recorded `train.diversity_samples` and tracked nothing."""
    config = write_yaml(tmp_path / "run.yaml", {**TINY, "train": {**TINY["train"], "epochs": 1, "diversity_samples": 4}})
    run = api.train("vit-cifar10", config, data_dir=cifar_dir, out=tmp_path / "run", device="cpu")
    (record,) = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["diversity"]
