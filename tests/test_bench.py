"""`headsearch bench` (headsearch.machine.bench) and the plan `headsearch run` makes from what it saved
(headsearch.machine.measured, headsearch.machine.plan).

The plan tests describe a GPU (`GpuInfo`) and hand the plan a measurement; the bench itself runs for
real on this CPU: its processes, its verification of a cohort slot against the same trial alone, its
saved file, and the next `run`'s plan line.
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys

import pytest

from headsearch.machine.bench import combine
from headsearch.machine.measured import COHORT, PROCESSES, Measurement, Way, WayResult, load_measurement
from headsearch.machine.plan import GpuInfo, Plan, plan_search
from headsearch.search.runner import Search, SearchSettings

H100 = GpuInfo("NVIDIA H100 80GB HBM3", 132, 80 * 2**30)


def vit_search(**settings) -> Search:
    return Search(SearchSettings(task="vit-cifar10", device="auto", **settings))


def plan_of(search: Search, **machine) -> Plan:
    """`search`'s plan on the machine `machine` describes (`plan_search`'s visible, gpu, cpu_cores, measurement)."""
    return plan_search(search.plan_inputs(), **machine)


def measured(*results: WayResult, date: str = "2026-11-25") -> Measurement:
    return Measurement("k", date, H100.name, "2.11.0", "vit-cifar10", tuple(results))


GRAPHS_K4_MPS = WayResult(Way(PROCESSES, 4, "reduce-overhead", mps=True), True, None, 160_000.0, 40_000.0, 40.0)
GRAPHS_K8 = WayResult(Way(PROCESSES, 8, "reduce-overhead"), True, None, 150_000.0, 18_750.0, 40.0)
COHORT_8 = WayResult(Way(COHORT, 8, "off"), True, None, 120_000.0, 15_000.0, 3.0)
BROKEN_FAST = WayResult(Way(PROCESSES, 8, "graphs", mps=True), False, "CaptureMismatch: the captured step gave loss 2.1")


def test_the_plan_runs_the_fastest_verified_way_and_says_it_was_measured():
    m = measured(GRAPHS_K8, GRAPHS_K4_MPS, COHORT_8, BROKEN_FAST)
    assert m.choice() is GRAPHS_K4_MPS  # the unverified way is never chosen, however fast
    plan = plan_of(vit_search(), visible=["0"], gpu=H100, cpu_cores=16, measurement=m)
    assert plan.devices == ("0",) * 4 and plan.per_gpu == 4 and plan.mps and plan.cohort == 1
    assert plan.compile == "reduce-overhead"
    assert plan.describe() == ("4 trials per GPU on 1 GPU (4 processes, reduce-overhead + MPS: 160,000 samples/s);"
                               " steps: reduce-overhead: compiled blocks (default), whole step in a CUDA graph"
                               " (measured by headsearch bench on 2026-11-25)")


def test_a_cohort_is_planned_only_where_it_was_measured_fastest():
    faster = WayResult(Way(COHORT, 8, "off"), True, None, 200_000.0, 25_000.0, 3.0)
    plan = plan_of(vit_search(), visible=["0"], gpu=H100, cpu_cores=16, measurement=measured(GRAPHS_K4_MPS, faster))
    assert (plan.devices, plan.cohort, plan.mps) == (("0",), 8, False)
    assert plan.describe().endswith("steps: stacked, eager (measured by headsearch bench on 2026-11-25)")
    # --cohort 1: the fastest way that is not a cohort.
    no_cohort = plan_of(vit_search(cohort=1), visible=["0"], gpu=H100, cpu_cores=16, measurement=measured(GRAPHS_K4_MPS, faster))
    assert no_cohort.cohort == 1 and no_cohort.per_gpu == 4
    # A task that does not stack never gets one (the measurement would not have one either).
    translation = Search(SearchSettings(task="translation-en-es", device="auto"))
    assert plan_of(translation, visible=["0"], gpu=H100, cpu_cores=16, measurement=measured(faster, GRAPHS_K8)).cohort == 1


def test_flags_and_the_budget_win_over_the_measurement():
    m = measured(GRAPHS_K4_MPS)
    assert plan_of(vit_search(trials_per_gpu=2), visible=["0"], gpu=H100, cpu_cores=16, measurement=m).per_gpu == 2
    assert plan_of(vit_search(trials=3), visible=["0"], gpu=H100, cpu_cores=16, measurement=m).devices == ("0",) * 3
    # --compile keeps its mode: the measurement chooses the count, not the user's step mode.
    eager = plan_of(vit_search(compile="off"), visible=["0"], gpu=H100, cpu_cores=16, measurement=m)
    assert eager.compile is None and eager.step_mode == "off: eager"


def test_a_search_runs_its_trials_in_the_step_mode_the_measurement_chose():
    search = vit_search()
    eager_wins = WayResult(Way(PROCESSES, 4, "off"), True, None, 90_000.0, 22_500.0, 0.0)
    search.use_plan(plan_of(search, visible=["0"], gpu=H100, cpu_cores=16, measurement=measured(eager_wins)))
    assert search.base.train.compile == "off"
    told = vit_search(compile="graphs")
    told.use_plan(plan_of(told, visible=["0"], gpu=H100, cpu_cores=16, measurement=measured(eager_wins)))
    assert told.base.train.compile == "graphs"


def test_a_measurement_with_nothing_verified_leaves_the_rule():
    plan = plan_of(vit_search(), visible=["0"], gpu=H100, cpu_cores=16, measurement=measured(BROKEN_FAST))
    assert plan.basis == "rule: headsearch bench measures this machine" and plan.per_gpu == 8


def test_a_way_whose_process_failed_or_mismatched_is_not_verified():
    way = Way(PROCESSES, 2, "graphs")
    ok = {"samples": 1000, "trials": 1, "start": 0.0, "end": 2.0, "compile_seconds": 1.5}
    both = combine(way, [ok, {**ok, "start": 0.5, "end": 2.5, "samples": 500}])
    # 1,500 samples between the first start (0.0) and the last end (2.5); per trial: the mean of 500/s and 250/s.
    assert both.verified and both.samples_per_s == 600.0 and both.per_trial == 375.0 and both.compile_seconds == 1.5
    assert combine(way, [ok, {"mismatch": "graphs failed (CaptureMismatch: ...)"}]) == WayResult(
        way, False, "graphs failed (CaptureMismatch: ...)")
    assert not combine(way, [{"error": "RuntimeError: CUDA error"}, ok]).verified
    # The process that failed names the reason, not the one it left waiting at the barrier.
    waiting = {"error": "another process of this way failed before timing began", "secondary": True}
    assert combine(way, [waiting, {"mismatch": "graphs failed (CaptureMismatch)"}]).reason == "graphs failed (CaptureMismatch)"


def test_a_measurement_round_trips_through_its_file(tmp_path, monkeypatch):
    from headsearch.machine.measured import save_measurement

    monkeypatch.setenv("HEADSEARCH_CACHE", str(tmp_path))
    m = measured(GRAPHS_K8, BROKEN_FAST, COHORT_8)
    path = save_measurement(m)
    assert path == tmp_path / "bench" / "k.json"
    assert load_measurement("k") == m and json.loads(path.read_text())["choice"]["way"]["k"] == 8
    path.write_text("{not json")
    assert load_measurement("k") is None  # a damaged file is no measurement: the rule plans


# ------------------------------------------------------------------------------------ on this CPU, for real

SMALL = ("schedule: {families: [uniform], heads: [2, 4]}\nskip: [none]\nfusion: [none]\n"
         "fixed: {arch: {d_model: 32, d_ff: 64, enc_layers: 2}, train: {epochs: 2, batch_size: 32},"
         " data: {train_limit: 512, val_size: 64, test_limit: 64}}\n")


@pytest.mark.processes
@pytest.mark.slow
def test_bench_on_this_cpu_saves_what_the_next_run_plans_from(tmp_path, cifar_dir):
    """`headsearch bench` measures the CPU's ways (workers x threads, cohorts, a cohort slot verified
    against the same trial alone), saves them, and the next `run` of the same search prints the choice
    in its plan line, with the date. Run as a user would: two commands in real processes."""
    space = tmp_path / "space.yaml"
    space.write_text(SMALL)
    env = {**__import__("os").environ, "HEADSEARCH_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    common = ["--task", "vit-cifar10", "--space", str(space), "--data-dir", str(cifar_dir), "--device", "cpu"]
    proc = subprocess.run([sys.executable, "-m", "headsearch", "bench", *common, "--seconds", "1.5", "--ks", "2", "--format", "json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = Measurement.from_dict(json.loads(proc.stdout))
    kinds = {(r.way.kind, r.way.k, r.way.threads) for r in m.results}
    assert kinds == {(PROCESSES, 1, 2), (PROCESSES, 2, 1), (COHORT, 2, 2)}  # --ks 2: cohorts of 2 alone
    assert all(r.verified and r.samples_per_s > 0 for r in m.results), [r.reason for r in m.results if not r.verified]
    assert m.date == datetime.date.today().isoformat() and (tmp_path / "cache" / "bench" / f"{m.key}.json").exists()
    choice = m.choice()
    run = subprocess.run([sys.executable, "-m", "headsearch", "run", *common, "--trials", "1",
                          "--storage", f"sqlite:///{tmp_path / 'b.db'}", "--run-root", str(tmp_path / "runs")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("plan:")]
    assert f"({choice.way.describe()}: {choice.samples_per_s:,.0f} samples/s)" in line
    assert line.endswith(f"(measured by headsearch bench on {m.date})")


@pytest.mark.parametrize("args, says", [
    (["--task", "nope"], "nope"),
    (["--task", "vit-cifar10", "--seconds", "0"], "--seconds 0"),
    (["--task", "vit-cifar10", "--format", "xml"], "--format 'xml'"),
    (["--task", "vit-cifar10", "--data-dir", "/nonexistent/cifar"], "/nonexistent/cifar"),
    (["--task", "vit-cifar10", "--ks", "4,zero"], "--ks '4,zero': give positive whole numbers"),
    (["--task", "vit-cifar10", "--ks", "0"], "--ks '0'"),
    (["--task", "vit-cifar10", "--modes", "fast"], "--modes 'fast': give modes among off, graphs, reduce-overhead"),
])
def test_bench_bad_input_is_one_line_and_exit_2(args, says, tmp_path, monkeypatch, cli):
    monkeypatch.setenv("HEADSEARCH_CACHE", str(tmp_path / "cache"))
    cli.error_line(cli(["bench", *args, "--device", "cpu"]), says)
    assert not (tmp_path / "cache" / "bench").exists()


@pytest.fixture
def small_search(tmp_path, cifar_dir) -> Search:
    space = tmp_path / "space.yaml"
    space.write_text(SMALL)
    return Search(SearchSettings(task="vit-cifar10", space=str(space), data_dir=str(cifar_dir), device="cpu"))


def cohort_job(search: Search, k: int):
    from headsearch.machine.bench import Job, with_compile

    return Job("vit-cifar10", with_compile(search.task, search.base, "off"), search.source, Way(COHORT, k, "off", threads=1), None, 0.2)


@pytest.mark.slow
def test_a_cohort_slot_is_checked_against_the_same_trial_alone(small_search, one_thread):
    """In a bench process: slot 0's first losses equal the same trial's alone (then it is timed); a slot that
    computed something else is reported as a mismatch, with both loss lists, and never timed."""
    import threading

    import torch

    from headsearch.machine import bench

    figures = bench.measure_cohort(cohort_job(small_search, 2), threading.Barrier(1), torch.device("cpu"))
    assert figures["trials"] == 2 and figures["samples"] > 0 and figures["end"] > figures["start"]
    real = bench.solo_losses
    off = lambda *a: [x * 1.01 for x in real(*a)]  # noqa: E731 - a slot 1% away from its solo run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "solo_losses", off)
        broken = threading.Barrier(2)
        mismatch = bench.measure_cohort(cohort_job(small_search, 2), broken, torch.device("cpu"))
    assert "differ from the same trial alone" in mismatch["mismatch"] and broken.broken and "samples" not in mismatch


def test_a_bench_stopped_part_way_keeps_the_ways_it_measured(small_search, tmp_path, monkeypatch):
    """The measurement is saved after each way: a bench interrupted (Ctrl-C, a command's time limit) during its
    second way leaves the first saved, for `run` to plan from; --no-cohorts (cohorts=False) measures none."""
    from headsearch.machine import bench
    from headsearch.machine.measured import bench_key, cpu_name, key_inputs

    monkeypatch.setenv("HEADSEARCH_CACHE", str(tmp_path / "cache"))
    asked = []

    def one_way(jobs):
        asked.append(jobs[0].way)
        if len(asked) == 2:
            raise KeyboardInterrupt
        return WayResult(jobs[0].way, True, None, 1000.0, 1000.0, 0.0)

    monkeypatch.setattr(bench, "run_way", one_way)
    with pytest.raises(KeyboardInterrupt):
        bench.bench(small_search.plan_inputs(), seconds=0.1, cohorts=False)
    import torch

    saved = load_measurement(bench_key(key_inputs(cpu_name(), torch.__version__, small_search.base)))
    assert [r.way for r in saved.results] == asked[:1] and saved.results[0].samples_per_s == 1000.0
    asked.clear()
    monkeypatch.setattr(bench, "run_way", lambda jobs: asked.append(jobs[0].way) or WayResult(jobs[0].way, False, "x"))
    bench.bench(small_search.plan_inputs(), seconds=0.1, cohorts=False, save=False)
    assert asked and all(w.kind == PROCESSES for w in asked)
    with pytest.raises(ValueError, match="unknown step modes"):
        bench.bench(small_search.plan_inputs(), modes=["fast"], save=False)


def test_the_ks_a_gpu_bench_tries_fit_in_its_memory():
    from headsearch.machine.bench import gpu_ks

    assert gpu_ks(348_000_000, H100) == [2, 4, 8]  # the seed ViT: 8 fit many times over
    assert gpu_ks(20 * 2**30, H100) == [2]  # 0.8 x 80 GiB holds 3 of these: K = 4 would not fit
    assert gpu_ks(70 * 2**30, H100) == [1]  # not even two


def test_k_processes_share_the_cores_for_compiling(monkeypatch):
    """A bench way of K processes (like a search's K workers) gives each 1/K of the cores, and as many Inductor
    compile threads, unless the user set those."""
    import os

    from headsearch.machine.plan import share_cores

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert share_cores(8) == 2 and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "2"
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "5")
    assert share_cores(32) == 1 and os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "5"
