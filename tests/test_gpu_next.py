"""`bash benchmarks/gpu.sh next` (the second GPU run, issue 41) and its summary, on the CPU: the plan fits the
device's 470 s and drops steps in the stated order; summary.py reads a real CPU slice (two 3-trial searches:
the defaults and the opt-in switches) and prints every figure; its arithmetic by hand."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = ROOT / "benchmarks" / "gpu_quick" / "summary.py"


def load_summary():
    spec = importlib.util.spec_from_file_location("gpu_summary", SUMMARY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(**env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/gpu.sh", "--dry-run", "next"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "HEADSEARCH_DATA": "/data", **env})


def planned(out: str) -> dict[str, int]:
    """{step: cap} of the steps a dry run plans, in order."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^\+ \[(\w), at most (\d+) s", out, re.M)}


def total(out: str) -> int:
    return int(re.search(r"^at most (\d+) s in all", out, re.M)[1])


@pytest.mark.processes
def test_the_next_run_fits_470_seconds_with_the_slice_never_dropped():
    out = dry_run()
    assert out.returncode == 0, out.stderr
    steps = planned(out.stdout)
    assert list(steps) == ["A", "B", "D", "C"]  # E and F run only if time is left
    assert "(dropped: E runs only if time is left)" in out.stdout and "(dropped: F" in out.stdout
    assert total(out.stdout) <= 470 and total(out.stdout) == sum(steps.values()) + 30  # S0 and the summaries: 30 s
    assert "--no-cohorts" not in out.stdout  # D measures the cohort of 8 against 8 processes + MPS
    b = next(line for line in out.stdout.splitlines() if line.startswith("+ [B,"))
    c = next(line for line in out.stdout.splitlines() if line.startswith("+ [C,"))
    assert "--trials 24 --epochs 30" in b and "--enqueue examples/vit-classic.yaml" in b
    assert "--sampler" not in b and "--pruner" not in b and "--trials-per-gpu" not in b  # every default
    assert c.split("env HEADSEARCH_SHARED_GRAPH_POOL=1 ")[1].replace("c.db", "b.db").replace(
        "c-runs", "b-runs") == b.split("] ")[1]  # C is B with the opt-in graph pool, in its own study
    assert "(dropped: G runs only if time is left)" in out.stdout  # the pause checkpoint's cost, when time is left
    g = next(line for line in dry_run(NEXT_STEPS="G").stdout.splitlines() if line.startswith("+ [G,"))
    assert g.endswith("benchmarks/pause_cost.py --quick") and "at most 60 s" in g  # with the resumed run's check
    assert "(dropped: M runs only if time is left)" in out.stdout  # each attention kind against the classic one
    m = next(line for line in dry_run(NEXT_STEPS="M").stdout.splitlines() if line.startswith("+ [M,"))
    assert m.endswith("benchmarks/train_step.py --quick") and "at most 90 s" in m
    again = dry_run(C_ENV="HEADSEARCH_UNHELD_WARM_UP=0").stdout  # C as the held warm-ups of before
    assert re.search(r"^\+ \[C, .*\] env HEADSEARCH_UNHELD_WARM_UP=0 \S+ -m headsearch run ", again, re.M)
    caches = {line.split("cache ")[1].split("]")[0] for line in out.stdout.splitlines() if line.startswith(("+ [A", "+ [B", "+ [C"))}
    assert len(caches) == 3  # B's and C's warm-ups start cold, apart from A's


@pytest.mark.processes
def test_short_of_time_the_next_run_drops_f_e_the_cohort_c_then_a():
    steps = planned(dry_run(NEXT_TOTAL="340").stdout)  # A 40 + B 135 + D 100 + 30 = 305: C and the cohort go
    assert list(steps) == ["A", "B", "D"] and steps["D"] == 100
    assert "--no-cohorts" in dry_run(NEXT_TOTAL="340").stdout
    out = dry_run(NEXT_TOTAL="300").stdout
    assert list(planned(out)) == ["B", "D"]  # then A; B is never dropped
    assert "(dropped: A runs only if time is left)" in out
    again = dry_run(NEXT_STEPS="E C")
    assert list(planned(again.stdout)) == ["C", "E"] and total(again.stdout) == 135 + 45 + 30  # a rerun of some
    bad = dry_run(NEXT_STEPS="B X")
    assert bad.returncode == 2 and "NEXT_STEPS: unknown step X" in bad.stderr


def test_the_slice_figures_by_hand():
    s = load_summary()

    def trained(n, start, end, state="COMPLETE", alone=1.0, warm=10.0, epochs=3, rate=1000.0, pruned=None):
        rows = [{"epoch": e + 1, "train_seconds": 2.0 * (e + 1), "wall_seconds": 2.5 * (e + 1), "samples_per_s": rate}
                for e in range(epochs)]
        attrs = {"epoch_seconds_alone": alone, "compile_seconds": warm, **({"pruned": pruned} if pruned else {})}
        return s.Trained(n, f"arch{n}", state, start, end, None, attrs, rows, {}, {"train": 100, "val": 50})

    trials = [trained(0, 0, 10, alone=2.0, warm=20.0), trained(1, 1, 8, warm=30.0),
              trained(2, 8, 12, state="PRUNED", epochs=1, pruned={"epoch": 1}, warm=4.0), trained(3, 10, 14, warm=6.0)]
    assert s.concurrency(trials) == 2  # [0, 10] with [1, 8], then with [8, 12]; [10, 14] with [8, 12]
    assert s.mix_factor(trials, trials[0]) == pytest.approx((2 + 1 + 1 + 1) / 4 / 2)
    assert s.first_wave(trials, 2) == 2000.0  # the first two's rates summed; 600 samples in 10 s printed beside
    assert s.warm_ups(trials, 2) == ([20.0, 30.0], [4.0, 6.0])
    assert s.fair_time(trials[0], 55.0) == pytest.approx(2.0 / (100 / 55.0) - 1)  # 100 images at 55/s: 1.818 s
    assert trials[0].validation_per_epoch == pytest.approx(0.5) and trials[2].samples == 100
    # (1,000 epochs x 45,000 / 100,000 = 450 s + 360 + 800 / 8 + 200) / 3,600
    assert s.project_hours(1000, 100_000, 360, 800, 200, 8) == pytest.approx(1110 / 3600)
    hours = s.projection(trials, 2, 2000.0, [20.0, 30.0], [4.0, 6.0], share=0.5, archs=39)
    epochs = 0.5 * 39 * 400
    validation = 0.5 * 5000 / 50 * epochs / 2  # 0.5 s per epoch for 50 images, scaled to 5,000
    warm_ups = 20 + 30 + 5.0 * 37
    tail = 0.5 * 400 * 45_000 / (2000 / 2)
    assert hours == pytest.approx((epochs * 45_000 / 2000 + validation + warm_ups / 2 + tail) / 3600)


def test_the_slice_figures_from_the_study_alone_and_bench_rate_by_hand(tmp_path):
    """Where only the studies came back (no run directories), a trial's figures come from its attributes; D's
    fastest way of K > 1 processes is the projection's measured rate."""
    s = load_summary()
    attrs = {"samples_per_s": 8000.0, "train_seconds": 2.5, "compile_seconds": 4.0, "epochs_run": 30,
             "config": {"data": {"val_size": 1000}}}
    t = s.Trained(0, "arch0", "COMPLETE", 0.0, 12.0, None, attrs)
    assert t.rate == 8000.0 and t.samples == 20_000  # 8,000/s for 2.5 s
    assert t.validation_per_epoch == pytest.approx((12.0 - 4.0 - 2.5) / 30) and t.val_images == 1000
    assert s.Trained(1, "a", "PRUNED", 0.0, 1.0, None, {"compile_seconds": 3.0}).validation_per_epoch is None
    assert s.bench_rate(str(tmp_path)) is None  # D did not run
    (tmp_path / "D.log").write_text("bench: vit-cifar10\n  1 process, reduce-overhead: 148,735 samples/s\n"
                                    "  8 processes, reduce-overhead: 148,104 samples/s\n"
                                    "  8 processes, reduce-overhead + MPS: 210,561 samples/s\nerror: interrupted\n")
    assert s.bench_rate(str(tmp_path)) == (8, 210_561.0)  # one process's faster-looking line is no aggregate


@pytest.mark.processes
def test_summary_reads_a_cpu_slice_and_prints_every_figure(tmp_path, cifar_dir, capsys):
    """A real slice on the CPU, as `next` runs it on a GPU with smaller sizes: B and C each search 3 trials, the
    seed first (C with the opt-in graph pool), then summary.py prints each figure, checked against the studies
    it read."""
    s = load_summary()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    small = ["--preset", "tiny", "--data-dir", str(cifar_dir), "--set", "data.train_limit=256", "--set", "data.val_size=128",
             "--set", "data.test_limit=256"]
    hs = [sys.executable, "-m", "headsearch"]
    for name, switches in (("b", {}), ("c", {"HEADSEARCH_SHARED_GRAPH_POOL": "1"})):
        subprocess.run(hs + ["run", "--task", "vit-cifar10", *small, "--trials", "3", "--epochs", "2", "--enqueue",
                             "examples/vit-classic.yaml", "--storage", f"sqlite:///{tmp_path}/{name}.db",
                             "--run-root", str(tmp_path / f"{name}-runs")],
                       check=True, env={**env, **switches}, cwd=ROOT, capture_output=True, timeout=300)
    # A: the seed's own run as the canary's run directory (on a GPU, `headsearch train` of the same config)
    shutil.copytree(tmp_path / "b-runs" / "vit-cifar10-deep-head-tiny" / "trial-00000", tmp_path / "a-seed")
    s.slice_(str(tmp_path))  # as `summary.py slice OUT` prints it
    text = capsys.readouterr().out
    b = s.load_slice(str(tmp_path / "b.db"))
    assert [t.number for t in b] == [0, 1, 2] and b[0].arch == "4-4-4-4 skip=none fusion=none"  # the seed first
    assert "B: 3 trained trials (3 complete), at most 1 at once" in text
    a_rate = s._json(str(tmp_path / "a-seed" / "final.json"))["samples_per_s"]
    off = b[0].attrs["epoch_seconds_alone"] / (256 / a_rate) - 1
    assert re.search(rf"^fair time: the seed .* {re.escape(f'{off:+.1%}')} \((PASS|FAIL) within 10%\)$", text, re.M)
    mix = sum(t.attrs["epoch_seconds_alone"] for t in b) / 3 / b[0].attrs["epoch_seconds_alone"]
    assert f"= {mix:.2f}x" in text
    assert f"first wave: 1 trials at once, 512 samples in {b[0].wall:.1f} s" in text
    assert re.search(r"^warm-ups: cold \(the first 1\) median [\d.]+ s, max [\d.]+ s \(n=1\); warm \(later\) median", text, re.M)
    assert "pruning: 0 of 3 trained trials pruned (none); 6 epochs trained of 6 without pruning" in text
    c = s.load_slice(str(tmp_path / "c.db"))
    both = {t.arch for t in b} & {t.arch for t in c}
    assert f"C against B: {len(both)} architectures in both; time alone C/B median" in text and both
    assert all(f"   C/B {arch}: time alone" in text for arch in both)
    hours = float(re.search(r"PROJECTED ([\d.]+) h = \(", text)[1])
    assert hours > 0 and "of 39 x 400: the share the simulator's 1-worker replays of the 16-epoch table train" in text
    s.canary(str(tmp_path))
    assert f"A / the first GPU run: {a_rate:,.0f} / 147,016 samples/s" in capsys.readouterr().out
    missing = subprocess.run([sys.executable, str(SUMMARY), "slice", str(tmp_path / "none")], capture_output=True,
                             text=True, timeout=60)  # the script itself, on a step that left nothing
    assert missing.returncode == 0 and missing.stdout.startswith("B: NO RESULT")
