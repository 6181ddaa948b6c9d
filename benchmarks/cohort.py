"""Benchmark: a cohort (K trials stacked into one model) against K separate processes and one trial alone.

For each K (`--ks`) the same K mixed architectures of the seed-size ViT (d_model 48, 4 layers, d_ff 192;
head schedules, skips and fusions cycled from `ARCHS`) train three ways, side by side in one run:

- cohort: one process holds a `headsearch.training.cohort.Cohort` of K slots, every slot filled. Only
  the stacked training steps are timed: `Cohort.train_steps(steps)` directly (it returns the loss sums, the
  seconds and the samples per slot; the data order, augmentation, forward, backward and StackedAdam of
  every step, synchronised at both ends), after one warm-up call. `train_epoch` would add each slot's
  evaluation and bookkeeping, which is not what this compares. The cohort runs eager (it has no
  compiled mode).
- K processes: K worker processes (multiprocessing, spawn), each training one of the same K
  architectures alone with the trainer's own machinery (`prepare_steps` + `train_epoch`, step mode
  `--solo-compile`, eager by default like the cohort), after the same warm-up, started together behind
  a barrier. Aggregate = their samples / (the last one's end - the first one's start). On a GPU they run
  under MPS when it is there (`--mps`), as a search's workers do.
- K=1 reference: the seed ViT (4-4-4-4) alone, the same trainer steps, in the cohort's process.

Threads: the cohort and the reference get the machine's torch threads (T), each of the K processes
max(1, T // K), so that the three use the same cores. The three alternate round by round (the first
rotates) and each figure is the median of the rounds; ratios are medians of the ratios within rounds.
Everything runs in child processes (the parent starts no CUDA context, so MPS can come and go).
`--profile K` profiles one cohort step of K slots with torch.profiler and prints the top operators.

    python benchmarks/cohort.py --quick        # CPU: K = 1, 2, 4, 8; batch 64, 10 steps a round, 2 rounds (~3 min)
    python benchmarks/cohort.py                # GPU: K = 1, 2, 4, 8, 16; batch 256, 50 steps a round, 5 rounds
    python benchmarks/cohort.py --ks 8 --profile 8 --no-write   # where a cohort step of 8 spends its time

Target on one H100: a cohort of 8 mixed seed-size ViTs at >= 350,000 samples/s aggregate.
"""
from __future__ import annotations

import contextlib
import queue
import statistics
import sys
import time
import traceback

from common import DATA, markdown_table, median, parser, report, resolve_device, spread

# The seed-size ViT with mixed head schedules, skips and fusions; slot i of a cohort of K takes ARCHS[i % 8].
SEED = {"d_model": 48, "enc_layers": 4, "d_ff": 192}
ARCHS = [
    ("4-4-4-4", {"enc_heads": [4, 4, 4, 4]}),
    ("8-4-2-1 scores", {"enc_heads": [8, 4, 2, 1], "skip": "scores"}),
    ("1-2-4-8 output hadamard", {"enc_heads": [1, 2, 4, 8], "skip": "output", "fusion": "hadamard"}),
    ("2-2-16-16 scores(mean) add", {"enc_heads": [2, 2, 16, 16], "skip": "scores", "skip_mean": True, "fusion": "add"}),
    ("16-8-4-2 output", {"enc_heads": [16, 8, 4, 2], "skip": "output"}),
    ("4-4-4-4 add", {"enc_heads": [4, 4, 4, 4], "fusion": "add"}),
    ("2-4-8-16 scores", {"enc_heads": [2, 4, 8, 16], "skip": "scores"}),
    ("8-8-8-8 output", {"enc_heads": [8, 8, 8, 8], "skip": "output"}),
]
SOFT_COLUMNS = 48  # soft_width of the 1-head layers: every fusion of the list fits
TARGET_K, TARGET = 8, 350_000  # samples/s, one H100
WAIT_S = 1800  # the longest the parent waits for one answer of a worker


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ks", default=None, help="cohort sizes, comma list (default 1,2,4,8 quick; 1,2,4,8,16 full)")
    p.add_argument("--batch", type=int, default=None, help="batch per slot and per process (default 64 quick, 256 full)")
    p.add_argument("--steps", type=int, default=None, help="training steps a round (default 10 quick, 50 full)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 2 quick, 5 full)")
    p.add_argument("--solo-compile", default="off",
                   help="step mode of the K processes and the reference (default off: eager, as the cohort; auto: the trainer's default)")
    p.add_argument("--mps", choices=("auto", "on", "off"), default="auto", help="MPS for the K processes on a GPU (auto: on)")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="profile one cohort step of K slots (K must be in --ks)")
    args = p.parse_args()

    import torch

    device = resolve_device(args.device)  # no CUDA context in this process: only the workers make one
    cuda = device.type == "cuda"
    ks = [int(k) for k in (args.ks or ("1,2,4,8" if args.quick else "1,2,4,8,16")).split(",") if k]
    batch = args.batch or (64 if args.quick else 256)
    steps = args.steps or (10 if args.quick else 50)
    rounds = args.rounds or (2 if args.quick else 5)
    warm_steps = 3 if cuda else 1
    threads = torch.get_num_threads()
    # Every slot and process draws full batches: at least steps x batch training images (quick: a slice).
    train_limit = max(batch * steps, 2048) if args.quick else None

    def over(arch: dict, compile_mode: str) -> dict:
        return {"arch": {**SEED, **arch},
                "train": {"batch_size": batch, "max_steps_per_epoch": steps, "epochs": 400, "warmup_epochs": 1,
                          "schedule": "cosine", "compile": compile_mode},
                "data": {"train_limit": train_limit, "val_size": 1000, "test_limit": 200}}

    from headsearch.machine.mps import managed_mps

    ctx = __import__("multiprocessing").get_context("spawn")
    pool = Pool(ctx, DATA / "cifar10", str(device), ks)
    rows, notes_extra, solo_mode, mps_state, profile_text = [], [], "?", "no GPU", None
    try:
        # The cohort's process starts (and makes its CUDA context) before MPS: it alternates with the
        # processes, it does not share the device with them, and stays out of their MPS server.
        main_w = pool.start(1)[0]
        pool.call([main_w], "solo", over(ARCHS[0][1], args.solo_compile), threads, warm_steps)
        with managed_mps(cuda and args.mps != "off") as mps, contextlib.ExitStack() as stop:
            stop.callback(pool.kill)  # the workers go before the MPS daemon does
            if cuda:
                mps_state = mps.describe()
                print(mps_state, flush=True)
                if args.mps == "on" and not mps.active:
                    sys.exit(f"--mps on, but {mps_state}")
            for k in ks:
                archs = [ARCHS[i % len(ARCHS)] for i in range(k)]
                solo_threads = max(1, threads // k)
                print(f"K={k}: {', '.join(a[0] for a in archs)}", flush=True)
                workers = pool.start(k + 1)[1:]  # workers 1..K train alone
                modes = pool.call(workers, "solo", each=[(over(a, args.solo_compile), solo_threads, warm_steps) for _, a in archs])
                solo_mode = next(iter(modes.values()))[0]
                pool.call([main_w], "cohort", [over(a, "off") for _, a in archs], threads, warm_steps)
                rates = {"cohort": [], "processes": [], "solo": []}
                cases = list(rates)
                for r in range(rounds):
                    for case in cases[r % 3:] + cases[: r % 3]:
                        if case == "cohort":
                            n, s = pool.call([main_w], "cohort_round", steps)[main_w]
                        elif case == "solo":
                            n, s = pool.call([main_w], "solo_round", steps, None)[main_w]
                        else:
                            got = pool.call(workers, "solo_round", steps, k).values()
                            n = sum(g[0] for g in got)
                            s = max(g[2] for g in got) - min(g[1] for g in got)
                        rates[case].append(n / s)
                    print(f"  round {r + 1}: " + ", ".join(f"{c} {v[-1]:,.0f}" for c, v in rates.items()) + " samples/s", flush=True)
                if args.profile == k:
                    profile_text, top = pool.call([main_w], "profile", min(steps, 3))[main_w]
                    notes_extra.append(f"profile of {min(steps, 3)} cohort step(s), K={k} (torch.profiler, self time): {top}")
                pool.call(workers, "drop", False)
                pool.call([main_w], "drop", True)  # the K=1 reference stays, warm, for the next K
                ratio = lambda a, b: statistics.median(x / y for x, y in zip(rates[a], rates[b]))  # noqa: E731
                rows.append([k, median(rates["cohort"]), median(rates["processes"]), f"{ratio('cohort', 'processes'):.2f}",
                             median(rates["solo"]), f"{ratio('cohort', 'solo'):.2f}", f"{ratio('processes', 'solo'):.2f}",
                             spread(rates["cohort"]), spread(rates["processes"])])
            pool.stop()
    finally:
        pool.kill()

    if profile_text:
        print(f"\nprofile (K={args.profile}):\n{profile_text}")
    table = markdown_table(["K", "cohort samples/s", "K processes samples/s", "cohort / processes", "K=1 samples/s",
                            "cohort / K=1", "processes / K=1", "± cohort", "± processes"], rows)
    labels = ", ".join(f"{i}: {name}" for i, (name, _) in enumerate(ARCHS))
    notes = [f"seed-size ViT (d_model 48, 4 layers, d_ff 192), slot/process i of K takes architecture i mod {len(ARCHS)}"
             f" ({labels}); soft_columns {SOFT_COLUMNS}; batch {batch} per slot and per process; real CIFAR-10"
             f" ({'a ' + format(train_limit, ',') + '-image slice' if train_limit else 'the training images there'}),"
             " augmented on the device",
             f"a round: {steps} training steps of each; {rounds} rounds, cohort / processes / K=1 alternating (the first"
             f" rotates), after {warm_steps} warm-up step(s) each; medians, ratios = medians of the ratios within rounds;"
             " ± = half the range of the rounds",
             "cohort: one process, a Cohort of K slots (all filled), eager, timed with Cohort.train_steps (the stacked steps:"
             " data, augmentation, forward, backward, StackedAdam; no evaluation)",
             f"K processes: K spawned workers, each one architecture alone (the trainer's prepare_steps + train_epoch,"
             f" step mode {solo_mode}), started behind a barrier; aggregate = all their samples / (last end - first start)",
             f"K=1: the seed ViT (4-4-4-4) alone, step mode {solo_mode}, in the cohort's process",
             f"threads: the cohort and K=1 get the machine's {threads} torch threads, each of the K processes max(1, {threads} // K)"]
    if cuda:
        notes.append(f"processes on the GPU: {mps_state}")
        row = next((r for r in rows if r[0] == TARGET_K), None)
        if row is not None:
            notes.append(f"target: a cohort of {TARGET_K} >= {TARGET:,} samples/s on one H100: {row[1]:,.0f}"
                         f" ({'met' if row[1] >= TARGET else 'missed'}; device {torch.cuda.get_device_name(device)})")
    else:
        notes.append("CPU: the fused (HAM) architectures cost several times a plain one eager, so they dominate a mixed"
                     " cohort's step here and the processes' slowest member; the GPU rows are the point of this benchmark")
    report("Cohort vs K processes", table, device, args, notes + notes_extra)


class Pool:
    """Worker processes of this benchmark, started when first needed; worker 0 holds the cohort and the
    K=1 reference, workers 1..K the K processes. One queue of answers; a worker that fails or dies ends the run."""

    def __init__(self, ctx, data_dir, device: str, ks: list[int]):
        self.ctx, self.data_dir, self.device = ctx, str(data_dir), device
        self.barriers = {k: ctx.Barrier(k) for k in ks}  # made before any worker starts: spawn passes them on
        self.answers = ctx.Queue()
        self.procs, self.commands = [], []

    def start(self, n: int) -> list[int]:
        while len(self.procs) < n:
            i = len(self.procs)
            commands = self.ctx.Queue()
            proc = self.ctx.Process(target=serve, args=(i, self.data_dir, self.device, self.barriers, commands, self.answers),
                                    name=f"cohort-bench-{i}", daemon=True)
            proc.start()
            self.procs.append(proc)
            self.commands.append(commands)
        return list(range(n))

    def call(self, workers: list[int], op: str, *args, each: list[tuple] | None = None) -> dict:
        """Send `op` to every worker (with `args`, or its own tuple of `each`) and wait for all their answers."""
        for j, w in enumerate(workers):
            self.commands[w].put((op, *(each[j] if each is not None else args)))
        got: dict[int, object] = {}
        deadline = time.monotonic() + WAIT_S
        while len(got) < len(workers):
            try:
                w, what, value = self.answers.get(timeout=2)
            except queue.Empty:
                dead = [w for w in workers if w not in got and not self.procs[w].is_alive()]
                if dead or time.monotonic() > deadline:
                    sys.exit(f"worker(s) {dead or 'all'} {'died' if dead else 'did not answer'} during {op}")
                continue
            if what == "error":
                sys.exit(f"worker {w} failed during {op}:\n{value}")
            got[w] = value
        return got

    def stop(self) -> None:
        for c in self.commands:
            c.put(None)
        for proc in self.procs:
            proc.join(timeout=60)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)


def serve(index: int, data_dir: str, device_name: str, barriers: dict, commands, answers) -> None:
    """A worker: answers its commands in order, (index, op, result), until None."""
    try:
        state = Worker(data_dir, device_name, barriers)
        while (cmd := commands.get()) is not None:
            op, *args = cmd
            answers.put((index, op, getattr(state, op)(*args)))
    except BaseException:
        for b in barriers.values():
            b.abort()  # nobody waits forever for this worker
        answers.put((index, "error", traceback.format_exc()))


class Worker:
    def __init__(self, data_dir: str, device_name: str, barriers: dict):
        import torch

        from headsearch.tasks import get_task

        self.torch = torch
        self.task = get_task("vit-cifar10")
        self.data_dir, self.device, self.barriers = data_dir, torch.device(device_name), barriers
        self.bound = None  # the data, loaded once (every config here shares the data options)
        self.solo_state = self.cohort_obj = None
        self.epoch = 0

    def _bind(self, over: dict):
        from headsearch.tasks import DataSource, apply_overrides, resolve_config

        cfg = apply_overrides(self.task, resolve_config(self.task), over)
        if self.bound is None:
            self.bound = self.task.setup(cfg, DataSource(data_dir=self.data_dir), self.device)
        return cfg, self.bound.rebind(cfg)

    def solo(self, over: dict, threads: int, warm_steps: int) -> tuple[str, float]:
        """Build one architecture's trainer steps (as `fit` does) and warm them up: (step mode, warm-up seconds)."""
        from headsearch.training.prepare import prepare_steps
        from headsearch.training.runtime import seed_everything, steps_per_epoch

        self.torch.set_num_threads(threads)
        cfg, bound = self._bind(over)
        seed_everything(cfg.seed)
        model = bound.build_model().to(self.device)
        spe = steps_per_epoch(bound, cfg.train)
        steps, seconds, note = prepare_steps(self.task, cfg.train, bound, model, self.device, spe)
        self.solo_state = (cfg, bound, model, steps)
        started = time.perf_counter()
        self._solo_epoch(warm_steps)
        return steps.mode.describe() + (f" ({note})" if note else ""), seconds + time.perf_counter() - started

    def _solo_epoch(self, n_steps: int) -> tuple[int, float]:
        from headsearch.training.trainer import train_epoch

        cfg, bound, model, steps = self.solo_state
        model.train()
        self.epoch += 1
        return train_epoch(steps, bound, self.epoch, cfg.train.epochs, n_steps, self.device)

    def solo_round(self, n_steps: int, k: int | None):
        """One timed round alone: (samples, seconds); with k, behind the K processes' barrier: (samples, start, end)."""
        if k is None:
            return self._solo_epoch(n_steps)
        self.barriers[k].wait(timeout=WAIT_S)
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        n, _ = self._solo_epoch(n_steps)  # synchronised with the device at the end
        return n, start, time.monotonic()

    def cohort(self, overs: list[dict], threads: int, warm_steps: int) -> float:
        """A Cohort of len(overs) slots, every slot filled, warmed up with one `train_steps` call: its seconds."""
        from headsearch.training.cohort import Cohort

        self.torch.set_num_threads(threads)
        self.cohort_obj = Cohort(self.task, len(overs), self.device, soft_columns=SOFT_COLUMNS)
        for o in overs:
            cfg, bound = self._bind(o)
            self.cohort_obj.add(cfg, bound)
        return self.cohort_obj.train_steps(warm_steps)[1]

    def cohort_round(self, n_steps: int) -> tuple[int, float]:
        """One timed round of the cohort: (samples of every slot, seconds)."""
        _, seconds, per_slot = self.cohort_obj.train_steps(n_steps)
        return per_slot * len(self.cohort_obj.occupied), seconds

    def profile(self, n_steps: int) -> tuple[str, str]:
        """torch.profiler over `n_steps` cohort steps: (the top-20 table, the top 6 by self time in one line)."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            self.cohort_obj.train_steps(n_steps)
        events = prof.key_averages()
        attr = "self_device_time_total" if cuda else "self_cpu_time_total"
        if cuda and not hasattr(events[0], attr):
            attr = "self_cuda_time_total"
        table = events.table(sort_by=attr, row_limit=20)
        total = sum(getattr(e, attr) for e in events) or 1.0
        top = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:6]
        line = ", ".join(f"{e.key} {100 * getattr(e, attr) / total:.0f}% ({e.count // n_steps}/step)" for e in top)
        return table, f"{'device' if cuda else 'CPU'} {total / 1000 / n_steps:.0f} ms a step; {line}"

    def drop(self, keep_solo: bool) -> None:
        """Free this K's models (the next K builds its own); `keep_solo`: keep the trainer steps (the K=1 reference)."""
        self.cohort_obj = None
        if not keep_solo:
            self.solo_state = None
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
