"""The search's plan (headsearch.machine.plan): worker processes, trials per GPU from the model's size
and the device, the step mode and MPS; CPU behaviour unchanged. GPUs are described, not needed: the
rule reads a `GpuInfo` and CUDA_VISIBLE_DEVICES names."""
from __future__ import annotations

import subprocess
import sys

import pytest

from headsearch.errors import ConfigError
from headsearch.machine.mps import MpsStatus
from headsearch.machine.plan import FILL_FLOPS_PER_SM, GpuInfo, Plan, plan_search, trials_per_gpu_for
from headsearch.search.runner import Search, SearchSettings

H100 = GpuInfo("NVIDIA H100 80GB HBM3", 132, 80 * 2**30)
SEED_STEP = 13_760_741_376  # FLOPs of one seed-ViT step at batch 256 (tests/test_size.py counts them)
SEED_TRAINING_BYTES = 348_000_000


def vit_search(**settings) -> Search:
    return Search(SearchSettings(task="vit-cifar10", device="auto", **settings))


def plan_of(search: Search, **machine) -> Plan:
    """`search`'s plan on the machine `machine` describes (`plan_search`'s visible, gpu, cpu_cores, measurement)."""
    return plan_search(search.plan_inputs(), **machine)


def test_the_rule_fills_an_h100_with_eight_seed_vits():
    # 8 x 13.76 GFLOP over 132 multiprocessors: the calibration point (issue 12's measurements).
    assert FILL_FLOPS_PER_SM * 132 == pytest.approx(8 * 13.76e9)
    k, why = trials_per_gpu_for(SEED_STEP, SEED_TRAINING_BYTES, H100, cpu_cores=16, trials=50)
    assert k == 8 and why == "auto: a step is 13.8 GFLOP, 8 fill a NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("flops, bytes_, cores, trials, expected, capped_by", [
    (4 * SEED_STEP, SEED_TRAINING_BYTES, 16, 50, 2, None),  # 4x the work a step: a quarter of the trials
    (560e9, 2.7 * 2**30, 16, 50, 1, None),  # a ViT-Tiny-sized model fills the GPU alone
    (SEED_STEP / 100, SEED_TRAINING_BYTES, 64, 50, 16, "the maximum"),  # 800 would fill it: 16 at most
    (SEED_STEP, 20 * 2**30, 16, 50, 3, "memory"),  # 0.8 x 80 GiB holds 3 of these
    (SEED_STEP, SEED_TRAINING_BYTES, 4, 50, 4, "CPU cores"),  # one host thread drives each worker
    (SEED_STEP, SEED_TRAINING_BYTES, 16, 3, 3, "trials"),  # no more workers than trials
])
def test_the_rule_and_its_caps(flops, bytes_, cores, trials, expected, capped_by):
    k, why = trials_per_gpu_for(int(flops), int(bytes_), H100, cpu_cores=cores, trials=trials)
    assert k == expected
    assert (f"capped by {capped_by}" in why) if capped_by else ("capped" not in why)


def test_a_smaller_gpu_takes_fewer():
    small = GpuInfo("a 33-SM GPU", 33, 16 * 2**30)
    assert trials_per_gpu_for(SEED_STEP, SEED_TRAINING_BYTES, small, 16, 50)[0] == 2


def test_without_a_flops_estimate_one_trial_per_gpu():
    assert trials_per_gpu_for(None, 0, H100, 16, 50) == (1, "auto: no FLOPs estimate for this task")


def test_on_a_gpu_machine_without_a_measurement_the_rule_runs_processes_with_graphs_and_mps():
    """Without `headsearch bench` on this machine the plan is the way measured fastest on a GPU so far: K
    processes with CUDA graphs and MPS. Cohorts, never measured on a GPU, are not the default even where the
    task stacks (the ViT), and the line says that the count comes from the rule."""
    plan = plan_of(vit_search(), visible=["0"], gpu=H100, cpu_cores=16, measurement=None)
    assert plan.devices == ("0",) * 8 and plan.per_gpu == 8 and plan.mps and plan.cohort == 1
    assert plan.step_mode == "reduce-overhead: compiled blocks (default), whole step in a CUDA graph"
    started = MpsStatus("started", "started by headsearch")
    assert plan.describe(started) == ("8 trials per GPU on 1 GPU (auto: a step is 13.8 GFLOP, 8 fill a NVIDIA H100 80GB HBM3);"
                                      " steps: reduce-overhead: compiled blocks (default), whole step in a CUDA graph; "
                                      + started.describe() + " (rule: headsearch bench measures this machine)")
    two = plan_of(vit_search(), visible=["2", "3"], gpu=H100, cpu_cores=16, measurement=None)
    assert two.devices == ("2", "3") * 8 and two.per_gpu == 8 and two.cohort == 1
    assert plan_of(vit_search(cohort=1), visible=["0"], gpu=H100, cpu_cores=16, measurement=None) == plan
    # Processes: one host thread drives each, so the cores cap them.
    assert plan_of(vit_search(), visible=["0"], gpu=H100, cpu_cores=2, measurement=None).per_gpu == 2


def test_an_explicit_cohort_anywhere_and_where_it_cannot_be():
    cpu = plan_of(vit_search(cohort=4), visible=[])
    assert (cpu.devices, cpu.cohort, cpu.why) == ((None,), 4, "--cohort")
    assert cpu.describe() == "cohorts of 4 trials (one stacked model) in 1 worker on the CPU (--cohort); steps: stacked, eager"
    gpu = plan_of(vit_search(cohort=4, trials_per_gpu=2), visible=["0"], gpu=H100, cpu_cores=16)
    assert (gpu.devices, gpu.cohort, gpu.per_gpu, gpu.mps) == (("0", "0"), 4, 8, True)
    with pytest.raises(ConfigError, match="--cohort 4: task translation-en-es trains its trials one at a time"):
        plan_of(Search(SearchSettings(task="translation-en-es", cohort=4)), visible=[])
    with pytest.raises(ConfigError, match="--cohort 0"):
        Search(SearchSettings(task="vit-cifar10", cohort=0))


def test_flags_override_the_rule_on_a_gpu_machine():
    k3 = plan_of(vit_search(trials_per_gpu=3), visible=["0", "1"], gpu=H100, cpu_cores=16)
    assert (k3.devices, k3.per_gpu, k3.why, k3.mps) == (("0", "1", "0", "1", "0", "1"), 3, "--trials-per-gpu", True)
    one = plan_of(vit_search(trials_per_gpu=1), visible=["0"], gpu=H100, cpu_cores=16)
    assert one.devices == ("0",) and not one.mps  # one process a GPU: no MPS
    w = plan_of(vit_search(workers=3), visible=["0", "1"], gpu=H100, cpu_cores=16)
    assert (w.devices, w.per_gpu, w.why) == (("0", "1", "0"), 2, "--workers")
    eager = plan_of(vit_search(compile="off"), visible=["0"], gpu=H100, cpu_cores=16)
    assert eager.step_mode == "off: eager"


def test_the_cpu_plan_is_unchanged():
    assert plan_of(vit_search(), visible=[], measurement=None) == Plan((None,), None, "default: one worker", "off: eager",
                                                                          mps=False, basis="rule: headsearch bench measures this machine")
    for settings, n, why in (({"workers": 3}, 3, "--workers"), ({"trials_per_gpu": 2}, 2, "--trials-per-gpu")):
        plan = plan_of(vit_search(**settings), visible=[])
        assert plan == Plan((None,) * n, None, why, "off: eager", mps=False, cohort=1)
    assert plan_of(vit_search(workers=3), visible=[]).describe() == "3 workers on the CPU (--workers); steps: off: eager"
    # --device cpu ignores the GPUs there are.
    assert Search(SearchSettings(task="vit-cifar10", device="cpu")).machine_plan().devices == (None,)


@pytest.mark.processes
def test_a_search_says_its_plan_in_one_line(tmp_path, cifar_dir):
    space = tmp_path / "space.yaml"
    space.write_text("schedule: {families: [uniform], heads: [2]}\nskip: [none]\nfusion: [none]\n"
                     "fixed: {train: {epochs: 1, max_steps_per_epoch: 1, batch_size: 32},"
                     " data: {train_limit: 64, val_size: 32, test_limit: 32}}\n")
    proc = subprocess.run([sys.executable, "-m", "headsearch", "run", "--task", "vit-cifar10", "--space", str(space),
                           "--trials", "1", "--data-dir", str(cifar_dir), "--storage", f"sqlite:///{tmp_path / 'p.db'}",
                           "--run-root", str(tmp_path / "runs"), "--device", "cpu"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("plan:")] == [
        "plan: 1 worker on the CPU (default: one worker); steps: off: eager (rule: headsearch bench measures this machine)"]


def test_translation_counts_an_average_step_on_its_data_not_max_len(tmp_path, spa_file, tiny_translation, cache_env):
    """Translation's step cost depends on its sentences: the rule reads the FLOPs of an average step on the
    data (each training pair at its CUDA bucket's length), far below a step of max_len-token sentences."""
    import numpy as np
    import yaml

    from headsearch.models.size import seq2seq_step_flops
    from headsearch.tasks import get_task
    from headsearch.tasks.translation_data import BucketBatcher

    # Each pair's padded length under a ladder, by hand: needs (longest side + 1) 3, 9 and 13 -> 8, 12, 16.
    batcher = BucketBatcher([[5] * 2, [5] * 8, [5] * 12], [[6], [6] * 3, [6] * 5], 2)
    assert batcher.padded_lengths((8, 12, 16)).tolist() == [8, 12, 16]
    assert batcher.padded_lengths(None).tolist() == [3, 9, 13]

    fixed = {**tiny_translation, "data": {**tiny_translation["data"], "max_len": 48}}
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"schedule": {"families": ["uniform"], "heads": [2]}, "skip": ["none"],
                                     "fusion": ["none"], "fixed": fixed}))
    search = Search(SearchSettings(task="translation-en-es", space=str(space), data_file=str(spa_file), device="auto"))
    task, cfg = get_task("translation-en-es"), search.base
    average = search.step_footprint()
    lengths = search.data.cpu_data(search.base).batcher.padded_lengths(cfg.data.bucket_lengths("cuda"))
    by_hand = np.mean([seq2seq_step_flops(cfg.arch, cfg.train.batch_size, int(n), int(n), cfg.data.vocab_size) for n in lengths])
    assert average.step_flops == round(by_hand)
    bound = task.footprint(cfg)
    assert average.step_flops < bound.step_flops / 2 and average.training_bytes == bound.training_bytes
    gpu = GpuInfo("a 4-SM GPU", 4, 80 * 2**30)
    plan = plan_of(search, visible=["0"], gpu=gpu, cpu_cores=16, measurement=None)
    assert plan.per_gpu == trials_per_gpu_for(average.step_flops, average.training_bytes, gpu, 16, 50)[0]
    assert plan.per_gpu > trials_per_gpu_for(bound.step_flops, bound.training_bytes, gpu, 16, 50)[0]


def test_translation_counts_the_graph_pool_of_each_captured_shape(tmp_path, spa_file, tiny_translation, cache_env,
                                                                  monkeypatch):
    """With CUDA graphs each captured batch shape keeps its activations in a private pool: translation captures
    one shape per bucket length its data uses and the partial batch, so a process holds those activations, not
    one batch's. The rule's memory cap counts them (by hand here); a shared pool (opt-in) counts one batch."""
    import numpy as np
    import yaml

    from headsearch.models.size import OPTIMIZER_BYTES_PER_PARAM, seq2seq_footprint
    from headsearch.machine.plan import MEMORY_FRACTION

    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"schedule": {"families": ["uniform"], "heads": [2]}, "skip": ["none"],
                                     "fusion": ["none"], "fixed": tiny_translation}))
    search = Search(SearchSettings(task="translation-en-es", space=str(space), data_file=str(spa_file), device="auto"))
    cfg, fp = search.base, search.step_footprint()
    lengths = np.unique(search.data.cpu_data(search.base).batcher.padded_lengths(cfg.data.bucket_lengths("cuda")))
    act = [seq2seq_footprint(cfg.arch, cfg.train.batch_size, cfg.data.vocab_size, cfg.data.vocab_size, int(n)).activation_bytes
           for n in lengths]
    assert len(lengths) >= 2 and fp.captured_activation_bytes == sum(act) + act[-1]
    assert fp.captured_training_bytes == fp.params * OPTIMIZER_BYTES_PER_PARAM + sum(act) + act[-1] > fp.training_bytes
    # A GPU whose memory holds 8 processes by one batch each, but fewer by their graph pools.
    memory = int(8.5 * fp.training_bytes / MEMORY_FRACTION)
    gpu = GpuInfo("a small GPU", 1000, memory)
    plan = plan_of(search, visible=["0"], gpu=gpu, cpu_cores=16, measurement=None)
    assert plan.per_gpu == int(MEMORY_FRACTION * memory // fp.captured_training_bytes) < 8
    monkeypatch.setenv("HEADSEARCH_SHARED_GRAPH_POOL", "1")
    assert plan_of(search, visible=["0"], gpu=gpu, cpu_cores=16, measurement=None).per_gpu == 8
