"""A log a cluster user can read: when stderr is not a terminal (a Slurm job's log, `nohup`, a pipe), `run`,
`compare` and `table` print one plain line per finished trial and a status line every HEADSEARCH_STATUS_EVERY
seconds instead of Rich's live table, and their results are never wrapped at 80 columns.

The commands run for real, in a subprocess with stdout and stderr piped, on the planted-token task of
test_custom_task.py (found by its `module:attr` reference: it trains in a fraction of a second).
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from rich.console import Console
from test_custom_task import SPACE

from headsearch.errors import HeadsearchError
from headsearch.search.report import pruned_text

TESTS = Path(__file__).resolve().parent
TASK_REF = "test_custom_task:TASK"
LONG = "a-study-whose-name-alone-is-wider-than-the-eighty-columns-rich-assumes-when-it-sees-no-terminal"
TRIAL_LINE = re.compile(r"^trial (\d+) (complete|pruned|rejected|failed|duplicate): ")


def piped(args: list[str], cwd: Path, cache: Path, every: str = "0.3") -> subprocess.CompletedProcess:
    """`headsearch ARGS` with stdout and stderr piped (neither a terminal) and no COLUMNS set."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "FORCE_TERMINAL")}
    env.update(HEADSEARCH_CACHE=str(cache), OMP_NUM_THREADS="1", HEADSEARCH_STATUS_EVERY=every,
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "headsearch", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def check_log(stderr: str) -> list[str]:
    """Plain lines only (no live table left behind): the plan, a line per trial, status lines, the last one
    `done after`. Returns the trial lines."""
    lines = stderr.splitlines()
    assert lines[0].startswith("plan: ")
    body = [x for x in lines if not x.startswith("warning: ")]  # held third-party warnings, after a success
    kinds = {x.split(" ", 1)[0] for x in body}
    assert kinds <= {"plan:", "trial", "status", "done", "written:"}, body
    assert any(x.startswith("status after ") for x in body), stderr  # HEADSEARCH_STATUS_EVERY=0.3: at least one
    (done,) = [x for x in body if x.startswith("done after ")]
    assert body.index(done) > max(i for i, x in enumerate(body) if x.startswith("trial "))
    return [x for x in body if TRIAL_LINE.match(x)]


def load(storage: str, name: str) -> optuna.Study:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.load_study(study_name=name, storage=storage)


@pytest.mark.processes
def test_a_piped_run_logs_each_finished_trial_once_a_status_line_and_an_unwrapped_summary(tmp_path, tokenizer_cache):
    space = tmp_path / "planted.yaml"
    space.write_text(SPACE)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    # asha from epoch 1 keeping the top half: some of the 6 trials are pruned (and the small space gives duplicates)
    proc = piped(["run", "--task", TASK_REF, "--space", str(space), "--trials", "6", "--preset", "tiny", "--epochs", "3",
                  "--device", "cpu", "--storage", storage, "--study", LONG, "--run-root", str(tmp_path / "runs"),
                  "--pruner", "asha", "--pruner-min-epochs", "1", "--pruner-reduction-factor", "2"], tmp_path, tokenizer_cache)
    trial_lines = check_log(proc.stderr)

    study = load(storage, LONG)
    finished = [t for t in study.trials if t.state not in (TrialState.RUNNING, TrialState.WAITING)]
    assert sorted(int(TRIAL_LINE.match(x).group(1)) for x in trial_lines) == [t.number for t in finished]  # each once
    by_number = {int(TRIAL_LINE.match(x).group(1)): x for x in trial_lines}
    states = set()
    for t in finished:
        line = by_number[t.number]
        state = TRIAL_LINE.match(line).group(2)
        states.add(state)
        assert t.user_attrs["arch"] in line
        if state == "complete":
            assert t.state == TrialState.COMPLETE
            assert f"  accuracy {t.values[0]:.4g}  time {t.values[1]:.4g}  (" in line
        elif state == "pruned":
            assert t.state == TrialState.PRUNED
            assert pruned_text(t.user_attrs["pruned"], "maximize") in line  # rule, epoch, value and threshold
        elif state == "duplicate":
            assert f"proposed trial {t.user_attrs['duplicate_of']}'s architecture again" in line
    assert {"complete", "pruned"} <= states, proc.stderr
    assert trial_lines[-1].endswith("6/6 finished)")

    out = proc.stdout.splitlines()  # the summary: whole lines, however long
    complete = sum(t.state == TrialState.COMPLETE for t in finished)
    assert any(x.startswith(f"study {LONG}: {complete} complete, ") for x in out), proc.stdout
    assert f"next: headsearch report --study {LONG} --storage {storage}" in out, proc.stdout


@pytest.mark.processes
def test_a_piped_compare_logs_each_run_by_config_and_seed_and_prints_whole_tables(tmp_path, tokenizer_cache):
    long_config = "a-config-named-so-that-its-row-of-the-comparison-is-wider-than-eighty-columns"
    (tmp_path / "a.yaml").write_text("enc_heads: [1, 1]\n")
    (tmp_path / f"{long_config}.yaml").write_text("enc_heads: [4, 2]\nskip: output\n")
    storage = f"sqlite:///{tmp_path / 'c.db'}"
    proc = piped(["compare", "a.yaml", f"{long_config}.yaml", "--task", TASK_REF, "--seeds", "2", "--preset", "tiny",
                  "--device", "cpu", "--storage", storage, "--study", LONG, "--run-root", str(tmp_path / "runs")],
                 tmp_path, tokenizer_cache)
    trial_lines = check_log(proc.stderr)
    study = load(storage, LONG)
    assert len(trial_lines) == 4 == len(study.trials)
    for t, line in zip(sorted(study.trials, key=lambda t: t.number), trial_lines):
        name = ["a", long_config][t.params["config"]]
        assert line.startswith(f"trial {t.number} complete: {name} seed {t.params['seed']}  accuracy {t.values[0]:.4g}  ")

    out = proc.stdout.splitlines()
    assert any(f"{LONG}: 2 seeds per config (mean ± std)" in x for x in out), proc.stdout  # the title, whole
    assert any("paired differences b - a over seeds (95% bootstrap interval, paired t-test)" in x for x in out)
    (row,) = [x for x in out if x.startswith(f"│ {long_config} ")]  # its row, whole: name, runs and every mean ± std
    assert row.count("±") >= 3 and row.split()[3] == "2", row


@pytest.mark.processes
def test_a_piped_table_logs_each_run_and_prints_the_whole_table(tmp_path, tokenizer_cache):
    space = tmp_path / "planted.yaml"
    space.write_text(SPACE)
    proc = piped(["table", "--task", TASK_REF, "--space", str(space), "--sample", "2", "--seeds", "2", "--preset", "tiny",
                  "--device", "cpu", "--storage", f"sqlite:///{tmp_path / 't.db'}", "--study", LONG,
                  "--run-root", str(tmp_path / "runs"), "--out", str(tmp_path / "table.json")], tmp_path, tokenizer_cache)
    trial_lines = check_log(proc.stderr)
    assert len(trial_lines) == 4
    assert all(re.match(r"trial \d complete: \S+ skip=\w+ fusion=\w+ seed [01]  accuracy ", x) for x in trial_lines)
    out = proc.stdout.splitlines()
    assert any("2 of 30 architectures, 2 epochs, seeds per architecture as shown" in x
               and x.strip().startswith(f"{TASK_REF} x ") for x in out), proc.stdout


# -- the poll of worker processes, and the status line, in this process --------------------------------------


def _study():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(directions=["maximize", "minimize"], study_name="polled")
        study.set_metric_names(["accuracy", "time"])
    study.set_user_attr("headsearch", {"objectives": [{"name": "accuracy", "direction": "maximize"},
                                                      {"name": "time", "direction": "minimize"}]})
    return study


def _finish(study, arch: str, **how):
    t = study.ask()
    t.set_user_attr("arch", arch)
    for k, v in how.pop("attrs", {}).items():
        t.set_user_attr(k, v)
    for epoch, value in how.pop("curve", {}).items():
        study._storage.set_trial_intermediate_value(t._trial_id, epoch, value)
    study.tell(t, **how)
    return t


def test_trials_that_worker_processes_finish_are_read_from_the_study_and_each_printed_once(monkeypatch):
    """With several workers the display hears of no trial: `run_search` polls it (`refresh`) and it reads the study."""
    from headsearch.cli.progress import SearchProgress

    monkeypatch.setenv("HEADSEARCH_STATUS_EVERY", "3600")
    study = _study()
    _finish(study, "2-2 skip=none fusion=none", values=[0.5, 2.0])  # a resumed study's trial: not printed again
    buf = io.StringIO()
    with SearchProgress(study, 5, console=Console(file=buf, force_terminal=False, width=40)) as display:
        _finish(study, "4-4 skip=output fusion=add", values=[0.8125, 1.25])
        running = study.ask()
        running.set_user_attr("arch", "1-1 skip=scores fusion=none")
        display.refresh()
        display.refresh()
        pruned = {"prune": True, "rule": "pareto", "epoch": 3, "value": 0.25, "threshold": 0.5, "n_compared": 4}
        _finish(study, "8-4 skip=none fusion=add", state=TrialState.PRUNED, attrs={"pruned": pruned}, curve={1: 0.2, 2: 0.25})
        _finish(study, "2-1 skip=none fusion=none", state=TrialState.FAIL,
                attrs={"fail_reason": "diverged at epoch 2", "worker": "node17:4242"})  # another node's trial
        display.refresh()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "resuming study polled: 1 of 5 trials finished already"
    assert lines[1].startswith("trial 1 complete: 4-4 skip=output fusion=add  accuracy 0.8125  time 1.25  (")
    assert lines[1].endswith("s; 2/5 finished)")  # one line on a 40-column console: never wrapped
    assert lines[2].startswith("trial 3 pruned: 8-4 skip=none fusion=add  pareto rule at epoch 3: 0.25 < 0.5 (4 trials compared)  (")
    assert lines[3].startswith("trial 4 failed: 2-1 skip=none fusion=none  diverged at epoch 2  (")
    assert lines[3].endswith("s on node17; 3/5 finished)")
    assert lines[4].startswith("done after ")
    assert lines[4].endswith(": 3/5 finished (2 complete, 1 pruned, 0 rejected, 1 failed), 1 running"
                             " (trial 2 1-1 skip=scores fusion=none in epoch 1); best so far: accuracy 0.8125  time 1.25")
    assert len(lines) == 5


def test_the_status_line_comes_every_interval(monkeypatch):
    from headsearch.cli.progress import TrialLog

    now = [100.0]
    study = _study()
    buf = io.StringIO()
    log = TrialLog(study, 3, Console(file=buf, force_terminal=False), every=120, clock=lambda: now[0])
    log.start()
    log.poll()
    now[0] += 119
    log.poll()
    assert buf.getvalue() == ""
    now[0] += 1
    _finish(study, "2-2 skip=none fusion=none", values=[0.5, 2.0])
    log.poll()
    now[0] += 60
    log.poll()
    now[0] += 3600
    log.poll()
    lines = buf.getvalue().splitlines()
    assert [x.split(":")[0] for x in lines] == ["trial 0 complete", "status after 2m00s", "status after 1h03m"]


def test_the_status_interval_is_two_minutes_unless_the_environment_says_otherwise(monkeypatch):
    from headsearch.cli.progress import STATUS_EVERY, status_every

    monkeypatch.delenv("HEADSEARCH_STATUS_EVERY", raising=False)
    assert status_every() == STATUS_EVERY == 120
    monkeypatch.setenv("HEADSEARCH_STATUS_EVERY", "0.5")
    assert status_every() == 0.5
    for bad in ("soon", "0", "-3", "inf", "nan"):
        monkeypatch.setenv("HEADSEARCH_STATUS_EVERY", bad)
        with pytest.raises(HeadsearchError, match="HEADSEARCH_STATUS_EVERY"):
            status_every()


def test_a_terminal_keeps_the_live_table():
    from headsearch.cli.progress import SearchProgress

    study = _study()
    buf = io.StringIO()
    with SearchProgress(study, 3, console=Console(file=buf, force_terminal=True, width=120)) as display:
        _finish(study, "4-4 skip=output fusion=add", values=[0.8125, 1.25])
        display.on_trial_end(0, "COMPLETE")
    assert display.plain is None
    assert "1/3 finished: 1 complete" in buf.getvalue() and "status after" not in buf.getvalue()
