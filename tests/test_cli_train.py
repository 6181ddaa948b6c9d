"""`headsearch` as a user runs it: help, `tasks`, one-line errors for bad input, and small real runs.

Most commands go through Typer's CliRunner (in-process, stdout and stderr kept apart); the help and
one bad input also run as real subprocesses, `python -m headsearch ...`.
"""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

WIDE = {"COLUMNS": "240"}  # Rich wraps its tables at 80 columns when the output is not a terminal


def python_m_headsearch(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headsearch", *map(str, args)], capture_output=True, text=True,
                          timeout=120, **kwargs)


def final_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


def config_of(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


# ----------------------------------------------------------------------------------- help and tasks


def test_help_and_tasks_exit_0(cli):
    result = cli(["--help"])
    assert result.exit_code == 0, result.output
    assert "train" in result.stdout and "tasks" in result.stdout

    result = cli(["tasks"])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") >= 4}
    assert {"vit-cifar10", "translation-en-es"} <= set(rows)
    for metric in ("accuracy ↑", "loss ↓"):
        assert metric in rows["vit-cifar10"]
    for metric in ("bleu ↑", "cer ↓", "wer ↓", "loss ↓"):
        assert metric in rows["translation-en-es"]
    assert "tiny" in rows["vit-cifar10"] and "tiny" in rows["translation-en-es"]


def test_train_help_lists_its_options(cli):
    result = cli(["train", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--task", "--config", "--preset", "--epochs", "--seed", "--data-dir", "--data-file", "--out"):
        assert option in result.stdout


@pytest.mark.processes
def test_help_in_a_subprocess_does_not_import_torch():
    """`--help` stays quick because it imports none of the heavy libraries: that is what is checked, not its wall
    time, which a loaded machine (CI beside other jobs) stretches past any fixed bound (1.64 s against 1.5 once)."""
    proc = python_m_headsearch("--help")
    assert proc.returncode == 0, proc.stderr
    assert "train" in proc.stdout

    # The same, in a fresh interpreter that reports which modules the help pulled in.
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from headsearch.cli.main import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'numpy', 'optuna', 'datasets', 'tokenizers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ bad input


def _unknown_task(d, cifar, write_yaml):
    return ["--task", "nope"], "unknown task 'nope'"


def _unknown_preset(d, cifar, write_yaml):
    return ["--task", "vit-cifar10", "--preset", "huge", "--data-dir", cifar], "no preset 'huge'"


def _missing_config(d, cifar, write_yaml):
    return ["--task", "vit-cifar10", "--config", d / "nowhere.yaml", "--data-dir", cifar], "does not exist"


def _malformed_config(d, cifar, write_yaml):
    (d / "bad.yaml").write_text("arch: {d_model: 48\ntrain: [1, 2\n")
    return ["--task", "vit-cifar10", "--config", d / "bad.yaml", "--data-dir", cifar], "not valid YAML"


def _heads_do_not_divide(d, cifar, write_yaml):
    write_yaml(d / "heads.yaml", {"d_model": 48, "enc_heads": [4, 5, 4, 4]})
    return ["--task", "vit-cifar10", "--config", d / "heads.yaml", "--data-dir", cifar], "does not divide d_model"


def _heads_do_not_divide_full_config(d, cifar, write_yaml):
    write_yaml(d / "run.yaml", {"task": "vit-cifar10", "arch": {"d_model": 48, "enc_heads": [4, 4, 5, 4]}})
    return ["--task", "vit-cifar10", "--config", d / "run.yaml", "--data-dir", cifar], "enc_heads[2] = 5 does not divide d_model"


def _unknown_arch_key(d, cifar, write_yaml):
    write_yaml(d / "arch.yaml", {"d_model": 48, "num_heads": 4})
    return ["--task", "vit-cifar10", "--config", d / "arch.yaml", "--data-dir", cifar], "unknown arch key(s) num_heads"


def _bogus_skip(d, cifar, write_yaml):
    write_yaml(d / "skip.yaml", {"skip": "bogus"})
    return ["--task", "vit-cifar10", "--config", d / "skip.yaml", "--data-dir", cifar], "skip = 'bogus' is not known"


def _unknown_compile_mode(d, cifar, write_yaml):
    return ["--task", "vit-cifar10", "--data-dir", cifar, "--compile", "fast"], "compile = 'fast' is not known"


def _missing_data_dir(d, cifar, write_yaml):
    return ["--task", "vit-cifar10", "--data-dir", d / "no-such-dir"], "does not exist"


def _empty_data_dir(d, cifar, write_yaml):
    (d / "empty").mkdir()
    return ["--task", "vit-cifar10", "--data-dir", d / "empty"], "train_*.npz + test.npz"


def _data_file_for_vit(d, cifar, write_yaml):
    return ["--task", "vit-cifar10", "--data-file", cifar / "test.npz"], "--data-dir, not --data-file"


def _data_dir_for_translation(d, cifar, write_yaml):
    return ["--task", "translation-en-es", "--data-dir", cifar], "--data-file, not --data-dir"


def _out_not_empty(d, cifar, write_yaml):
    (d / "run").mkdir()
    (d / "run" / "keep.txt").write_text("mine\n")
    return ["--task", "vit-cifar10", "--data-dir", cifar], "already exists and is not empty"


def _out_under_a_file(d, cifar, write_yaml):
    (d / "a-file").write_text("not a folder\n")
    return ["--task", "vit-cifar10", "--data-dir", cifar, "--out", d / "a-file" / "run"], "which is a file: choose another --out"


_EARLY = [_unknown_task, _unknown_preset, _missing_config, _malformed_config, _heads_do_not_divide,
          _heads_do_not_divide_full_config, _unknown_arch_key, _bogus_skip, _unknown_compile_mode]
_IN_TRAIN_RUN = [_missing_data_dir, _empty_data_dir, _data_file_for_vit, _data_dir_for_translation, _out_not_empty,
                 _out_under_a_file]
BAD_INPUTS = [pytest.param(c, id=c.__name__.strip("_")) for c in _EARLY + _IN_TRAIN_RUN]
BAD_INPUTS_ONE_LINE = BAD_INPUTS


@pytest.fixture
def run_bad_input(tmp_path, cifar_dir, monkeypatch, cli, write_yaml):
    """`run_bad_input(case)`: run `headsearch train` on a bad input from inside tmp_path; return
    (result, expected text, files before, work folder)."""

    def run(case):
        work = tmp_path / "work"
        work.mkdir()
        monkeypatch.chdir(work)
        args, expected = case(work, cifar_dir, write_yaml)
        if "--out" not in args:
            args += ["--out", work / "run"]
        before = sorted(p.relative_to(work) for p in work.rglob("*"))
        return cli(["train", *args]), expected, before, work

    return run


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_with_one_error_line_and_no_run_directory(case, run_bad_input, cli):
    result, expected, before, work = run_bad_input(case)
    cli.error_line(result, expected)  # exit 2, not an uncaught exception, one "error: " line on stderr
    assert result.stdout == ""
    # Nothing was created: no run directory (neither --out nor a default runs/...), no stray files.
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before


@pytest.mark.parametrize("case", BAD_INPUTS_ONE_LINE)
def test_bad_input_stderr_is_exactly_the_error_line(case, run_bad_input):
    result, expected, _, _ = run_bad_input(case)
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1, repr(result.stderr)
    assert result.stderr.startswith("error: ")


def test_empty_data_dir_error_names_the_expected_files(run_bad_input):
    result, _, _, _ = run_bad_input(_empty_data_dir)
    message = result.stderr.strip()
    assert "empty" in message  # the folder it looked in
    assert "train_*.npz" in message and "test.npz" in message
    assert "cifar-10-batches-py" in message and "data_batch_1" in message and "batches.meta" in message


@pytest.mark.processes
def test_bad_input_in_a_real_subprocess(tmp_path, write_yaml):
    config = write_yaml(tmp_path / "heads.yaml", {"d_model": 48, "enc_heads": [4, 5, 4, 4]})
    proc = python_m_headsearch("train", "--task", "vit-cifar10", "--config", config, "--out", tmp_path / "run",
                               cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: enc_heads[1] = 5 does not divide d_model = 48")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.yaml"]


def test_a_wrongly_typed_value_is_a_one_line_error(tmp_path, monkeypatch, cli, write_yaml):
    monkeypatch.chdir(tmp_path)
    config = write_yaml(tmp_path / "run.yaml", {"task": "vit-cifar10", "arch": {}, "train": {"epochs": "ten"}})
    result = cli(["train", "--task", "vit-cifar10", "--config", config, "--out", tmp_path / "run"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: ") and "epochs" in result.stderr


def test_an_exponent_learning_rate_is_read_as_a_number(tmp_path):
    from headsearch.tasks import resolve_config

    config = tmp_path / "run.yaml"
    config.write_text("task: vit-cifar10\narch: {}\ntrain: {lr: 1e-3}\n")
    assert resolve_config("vit-cifar10", config=config).train.lr == pytest.approx(1e-3)


# ----------------------------------------------------------------------- acceptance: halving heads

HALVING = [64, 32, 16, 8, 4, 2]


def translation_config(skip: str, fusion: str) -> dict:
    return {
        "task": "translation-en-es",
        "seed": 0,
        "arch": {"d_model": 64, "d_ff": 128, "enc_layers": 6, "enc_heads": HALVING, "dec_layers": 1, "dec_heads": [4],
                 "skip": skip, "fusion": fusion},
        "train": {"epochs": 1, "max_steps_per_epoch": 1, "batch_size": 16},
        "data": {"train_limit": 200, "val_size": 4, "test_size": 4, "max_len": 12, "vocab_size": 300},
    }


@pytest.mark.parametrize("skip, fusion", list(itertools.product(("none", "output", "scores"), ("none", "hadamard", "add"))))
def test_halving_heads_train_through_the_cli_for_every_skip_and_fusion(skip, fusion, tmp_path, spa_file, cache_env, cli, write_yaml):
    config = write_yaml(tmp_path / "run.yaml", translation_config(skip, fusion))
    out = tmp_path / "run"
    result = cli(["train", "--task", "translation-en-es", "--config", config, "--data-file", spa_file, "--out", out,
                     "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    final = final_of(out)
    assert final["status"] == "completed"
    assert final["steps"] == 1 and final["epochs_run"] == 1
    assert {"bleu", "cer", "wer"} <= set(final["test_metrics"])
    arch = config_of(out)["arch"]
    assert (arch["enc_heads"], arch["skip"], arch["fusion"]) == (HALVING, skip, fusion)
    assert f"run directory: {out}" in result.stdout


@pytest.mark.slow
def test_halving_heads_vit_with_score_skip_and_additive_fusion_through_the_cli(tmp_path, cifar_dir, cli, write_yaml):
    config = write_yaml(tmp_path / "run.yaml", {
        "task": "vit-cifar10",
        "seed": 0,
        "arch": {"d_model": 64, "d_ff": 128, "enc_heads": HALVING, "skip": "scores", "fusion": "add"},
        "train": {"epochs": 1, "max_steps_per_epoch": 1, "batch_size": 16},
        "data": {"train_limit": 64, "val_size": 32, "test_limit": 32},
    })
    out = tmp_path / "run"
    result = cli(["train", "--task", "vit-cifar10", "--config", config, "--data-dir", cifar_dir, "--out", out,
                     "--device", "cpu"])
    assert result.exit_code == 0, result.output
    final = final_of(out)
    assert final["status"] == "completed" and final["steps"] == 1
    assert 0.0 <= final["test_metrics"]["accuracy"] <= 1.0
    arch = config_of(out)["arch"]
    assert (arch["enc_layers"], arch["enc_heads"], arch["skip"], arch["fusion"]) == (6, HALVING, "scores", "add")
    assert {"config.yaml", "command.txt", "env.json", "metrics.jsonl", "final.json", "model.safetensors",
            "split.json"} == {p.name for p in out.iterdir()}


@pytest.mark.processes
def test_a_real_training_subprocess_records_its_command(tmp_path, spa_file, tokenizer_cache, write_yaml):
    config = write_yaml(tmp_path / "run.yaml", translation_config("scores", "add"))
    out = tmp_path / "run"
    env = {**os.environ, "HEADSEARCH_CACHE": str(tokenizer_cache), **WIDE}
    proc = python_m_headsearch("train", "--task", "translation-en-es", "--config", config, "--data-file", spa_file,
                               "--out", out, "--device", "cpu", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert final_of(out)["status"] == "completed"
    assert f"run directory: {out}" in proc.stdout
    command = (out / "command.txt").read_text()
    assert "train --task translation-en-es --config" in command and f"--out {out}" in command


def test_divergence_through_the_cli_exits_1_with_one_error_line(tmp_path, spa_file, cache_env, cli, write_yaml):
    cfg = translation_config("none", "none")
    cfg["train"].update(lr=1e6, max_steps_per_epoch=4)
    config = write_yaml(tmp_path / "run.yaml", cfg)
    out = tmp_path / "run"
    result = cli(["train", "--task", "translation-en-es", "--config", config, "--data-file", spa_file, "--out", out,
                     "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "training diverged" in lines[0] and "at step" in lines[0]
    assert "Traceback" not in result.output
    assert final_of(out)["status"] == "diverged"


# ------------------------------------------------------------------------- architecture-only config

SMOKE = {  # a translation preset small enough to train in a second
    "arch": {"d_model": 64, "enc_layers": 2, "enc_heads": 4, "dec_layers": 1, "dec_heads": 4, "d_ff": 128},
    "train": {"epochs": 5, "batch_size": 16, "max_steps_per_epoch": 1},
    "data": {"train_limit": 200, "val_size": 4, "test_size": 4, "max_len": 12, "vocab_size": 300},
}


def test_an_architecture_only_config_with_flag_overrides(tmp_path, spa_file, cache_env, monkeypatch, cli, write_yaml):
    from headsearch.tasks import get_task

    monkeypatch.setitem(get_task("translation-en-es").presets, "smoke", SMOKE)
    config = write_yaml(tmp_path / "arch.yaml", {"enc_heads": [8, 4, 2, 1], "skip": "output"})
    out = tmp_path / "run"
    result = cli(["train", "--task", "translation-en-es", "--preset", "smoke", "--config", config,
                     "--data-file", spa_file, "--out", out, "--epochs", "2", "--seed", "7", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    saved = config_of(out)
    assert saved["task"] == "translation-en-es"
    assert saved["seed"] == 7
    assert saved["train"]["epochs"] == 2
    assert saved["arch"]["enc_heads"] == [8, 4, 2, 1] and saved["arch"]["enc_layers"] == 4
    assert saved["arch"]["skip"] == "output"
    assert saved["arch"]["d_model"] == 64 and saved["arch"]["dec_heads"] == [4]  # the rest from the preset
    assert saved["data"]["train_limit"] == 200
    final = final_of(out)
    assert final["status"] == "completed" and final["epochs_run"] == 2
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert json.loads((out / "split.json").read_text())["seed"] == 7


def test_track_diversity_measures_the_heads_each_epoch(tmp_path, spa_file, cache_env, cli, write_yaml):
    config = write_yaml(tmp_path / "run.yaml", {**translation_config("none", "none"),
                                                "train": {"epochs": 2, "max_steps_per_epoch": 1, "batch_size": 16}})
    out = tmp_path / "run"
    result = cli(["train", "--task", "translation-en-es", "--config", config, "--data-file", spa_file, "--out", out,
                  "--device", "cpu", "--track-diversity", "4"])
    assert result.exit_code == 0, result.output
    assert config_of(out)["train"]["diversity_samples"] == 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["diversity"] and all(v is None or isinstance(v, float) for v in r["diversity"].values())
    final = final_of(out)
    assert final["best_diversity"] == records[final["best_epoch"] - 1]["diversity"]

    plain = tmp_path / "plain"  # without the flag, nothing is measured
    result = cli(["train", "--task", "translation-en-es", "--config", config, "--data-file", spa_file, "--out", plain,
                  "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert all(json.loads(line)["diversity"] == {} for line in (plain / "metrics.jsonl").read_text().splitlines())
