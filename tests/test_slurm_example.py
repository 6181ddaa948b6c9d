"""examples/slurm: the per-task command of the Slurm job array (task.sh), run three times at once on this machine as
three nodes run it, against one PostgreSQL study on a new, empty database. The budget is exact, each node trains in its own process, and no
architecture is trained twice."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_search import FreshDatabase, _check_budget_filled_once

SLURM = Path(__file__).resolve().parents[1] / "examples" / "slurm"


def node_env(pg_url: str, study: str, cifar_dir: Path, tmp_path: Path) -> dict[str, str]:
    """What search.sbatch exports, plus a CPU-sized search (HEADSEARCH_ARGS)."""
    bin_dir = str(Path(sys.executable).parent)  # the headsearch console script of this environment
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OPTUNA_STORAGE": pg_url,
            "HEADSEARCH_DATA": str(cifar_dir.parent), "HEADSEARCH_STUDY": study, "HEADSEARCH_TRIALS": "4",
            "HEADSEARCH_RUN_ROOT": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1", "COLUMNS": "200",
            "HEADSEARCH_ARGS": "--preset tiny --epochs 1 --device cpu --pruner none --set arch.patch_size=8"
                               " --set data.train_limit=256 --set data.val_size=64 --set data.test_limit=64"}


@pytest.mark.processes
def test_the_sbatch_script_runs_the_task_script_for_every_array_task():
    sbatch = (SLURM / "search.sbatch").read_text()
    assert "#SBATCH --array=" in sbatch and "srun bash examples/slurm/task.sh" in sbatch
    checked = subprocess.run(["bash", "-n", str(SLURM / "search.sbatch")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def slurm_stand_ins(tmp_path: Path, srun: str) -> dict:
    """The environment of a batch script run under stand-ins in tmp_path/bin: `srun` runs the bash lines `srun`,
    `scontrol` records what it was asked in tmp_path/scontrol.txt; job 4242."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{srun}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"$*\" >> {tmp_path / 'scontrol.txt'}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


@pytest.mark.processes
@pytest.mark.parametrize("task_exit, requeued", [(143, True), (0, False), (1, False)])
def test_a_task_stopped_by_sigterm_is_requeued(tmp_path, task_exit, requeued):
    """The sbatch script under stand-ins for `srun` (the task's exit code: 143 is headsearch stopped by the time
    limit's early SIGTERM, or by preemption) and `scontrol` (what it was asked, recorded): a task stopped by SIGTERM
    goes back to the queue, where the same command resumes the study; one that ended otherwise does not."""
    sbatch = (SLURM / "search.sbatch").read_text()
    assert "#SBATCH --signal=TERM@" in sbatch and "#SBATCH --requeue" in sbatch
    env = slurm_stand_ins(tmp_path, srun=f"exit {task_exit}")
    proc = subprocess.run(["bash", str(SLURM / "search.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == task_exit, proc.stderr
    asked = (tmp_path / "scontrol.txt").read_text().splitlines() if (tmp_path / "scontrol.txt").exists() else []
    assert asked == (["requeue 4242"] if requeued else [])


@pytest.mark.processes
@pytest.mark.slow
def test_the_batch_shell_signalled_too_still_requeues(tmp_path):
    """Preemption (or the time limit itself) sends SIGTERM to the batch shell as well as to headsearch: the shell
    waits for `srun` (here a stand-in that exits 143 a moment later, as headsearch does) and requeues the task."""
    env = slurm_stand_ins(tmp_path, srun=f"touch {tmp_path / 'started'}\nsleep 2\nexit 143")
    proc = subprocess.Popen(["bash", str(SLURM / "search.sbatch")], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert (tmp_path / "scontrol.txt").read_text().splitlines() == ["requeue 4242"]


@pytest.mark.processes
@pytest.mark.slow
def test_three_nodes_starting_together_on_a_fresh_database_fill_the_budget_exactly(pg_url, cifar_dir, tmp_path):
    """The array's first submission: three tasks start at once on a new, empty database (Optuna creates its tables
    on first use, under headsearch's schema lock). Every task exits 0 and the study holds exactly --trials."""
    with FreshDatabase(pg_url) as url:
        study = "slurm-fresh"
        env = node_env(url, study, cifar_dir, tmp_path)
        nodes = [subprocess.Popen(["bash", str(SLURM / "task.sh")], cwd=tmp_path, env={**env, "SLURM_ARRAY_TASK_ID": str(i)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
        outputs = [node.communicate(timeout=300) for node in nodes]
        for node, (out, err) in zip(nodes, outputs):
            assert node.returncode == 0, err[-3000:]
            assert f"study {study}: " in out  # each node prints the study's summary
        trials = _check_budget_filled_once(url, study, 4).trials
        # Each node trained in its own process (task.sh execs headsearch: the node's pid is the trainer's).
        pids = {int(t.user_attrs["worker"].rsplit(":", 1)[1]) for t in trials}
        assert pids <= {node.pid for node in nodes}
        architectures = [tuple(sorted(t.params.items())) for t in trials]
        assert len(set(architectures)) == 4, architectures


@pytest.mark.processes
def test_the_task_script_names_what_is_missing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OPTUNA_STORAGE", "HEADSEARCH_DATA")}
    proc = subprocess.run(["bash", str(SLURM / "task.sh")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "set OPTUNA_STORAGE to a PostgreSQL URL" in proc.stderr
