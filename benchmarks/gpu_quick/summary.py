"""benchmarks/gpu.sh quick and next: one short summary per step, from the run directories and studies they wrote.

    python3 benchmarks/gpu_quick/summary.py vit OUT          # quick S1: the default ViT against --compile off
    python3 benchmarks/gpu_quick/summary.py search OUT       # quick S3: every trial of the short default search
    python3 benchmarks/gpu_quick/summary.py translation OUT  # quick S5: tiny translation on the default path
    python3 benchmarks/gpu_quick/summary.py canary OUT       # next A: the seed ViT's defaults against the first GPU run
    python3 benchmarks/gpu_quick/summary.py slice OUT        # next B (and C beside it): the headline job's slice
    python3 benchmarks/gpu_quick/summary.py run NAME DIR     # next E, F: one run directory

`slice` reads OUT/a-seed (A's run directory, if there), OUT/b.db and, if there, OUT/c.db (each one study)
and prints: the fair-time check, the architecture mix factor, the first wave's aggregate samples/s, the
warm-ups cold and warm, what the pruning rule pruned and where, C against B per architecture, and the
headline job's hours projected from B (and from C, when C ran). Where the run directories did not come back
(only the studies did), a trial's rate, samples and validation seconds are read from its study's attributes.
"""
import glob
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass, field


def run_line(name: str, path: str) -> dict | None:
    try:
        f = json.load(open(f"{path}/final.json"))
        epochs = [json.loads(line) for line in open(f"{path}/metrics.jsonl")]
    except OSError as e:
        print(f"{name}: NO RESULT ({e})")
        return None
    print(f"{name}: {f['status']} | {f['step_mode']} | note {f['step_note']} | uncaptured {f['uncaptured_steps']}"
          f" | warm-up {f['compile_seconds']:.1f} s | {f['samples_per_s']:,.0f} samples/s | test {f['test_metrics']}")
    print("   train loss", [round(e["train_loss"], 4) for e in epochs])
    return f


def vit(out: str) -> None:
    auto, off = run_line("default", f"{out}/vit-auto"), run_line("--compile off", f"{out}/vit-off")
    if auto and off:
        print(f"default / off samples/s: {auto['samples_per_s'] / off['samples_per_s']:.2f}x (passes at >= 2.5x,"
              f" with 'compiled blocks' in the mode, note None, uncaptured 0)")


def search(out: str) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{out}/h.db"
    for name in optuna.get_all_study_names(storage):
        trials, samples = optuna.load_study(study_name=name, storage=storage).trials, 0.0
        trained = [t for t in trials if "duplicate_of" not in t.user_attrs]
        for t in trained:
            a = t.user_attrs
            samples += (a.get("samples_per_s") or 0) * (a.get("train_seconds") or 0)
            print(t.number, t.state.name, a.get("arch"), "|", a.get("step_mode"), "| note", a.get("step_note"),
                  "| warm-up", a.get("compile_seconds"), "| alone", a.get("epoch_seconds_alone"), "| samples/s",
                  a.get("samples_per_s"), "|", a.get("fail_reason") or a.get("rejected") or "")
        print(f"{len(trials) - len(trained)} duplicate proposals skipped (not trained)")
        done = [t for t in trained if t.datetime_complete]
        if done:
            wall = (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()
            print(f"aggregate {samples:,.0f} samples / {wall:.0f} s wall = {samples / wall:,.0f} samples/s (warm-ups included)")
    for f in glob.glob(f"{out}/runs/*/workers/*.failed"):
        print("FAILED WORKER", f, open(f).read().strip())


def translation(out: str) -> None:
    run_line("translation", f"{out}/tr-auto")


# -- gpu.sh next ------------------------------------------------------------------------------------

FIRST_GPU_RATE = 147_016  # the seed ViT, defaults, one H200 (RESULTS.md, issue 30): A's reference
FAIR_TOLERANCE = 0.10  # the fair clock's target: the seed's time alone within 10% of its rate alone
HEADLINE = {"trials": 50, "epochs": 400, "train": 45_000, "val": 5_000}  # `headsearch run --task vit-cifar10 --trials 50`
TABLE = os.path.join(os.path.dirname(__file__), "..", "tables", "vit-cifar10-deep-head-tiny16.json")  # for the pruned share


def canary(out: str) -> None:
    f = run_line("A, seed ViT, defaults", f"{out}/a-seed")
    if f:
        print(f"A / the first GPU run: {f['samples_per_s']:,.0f} / {FIRST_GPU_RATE:,} samples/s ="
              f" {f['samples_per_s'] / FIRST_GPU_RATE:.2f} (an H200 with nothing else running: ~1.00)")


@dataclass
class Trained:
    """One trained trial of a slice: its record and its run directory's epochs."""

    number: int
    arch: str
    state: str
    start: float  # seconds since the study's first start
    end: float
    values: list | None
    attrs: dict
    epochs: list = field(default_factory=list)  # metrics.jsonl rows
    final: dict = field(default_factory=dict)  # final.json, if written
    split: dict = field(default_factory=dict)  # split.json: train and val images

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def samples(self) -> int:
        if not self.epochs:  # the study alone: its epochs at its train images (the rate's figure)
            return round(self.attrs.get("samples_per_s", 0) * self.attrs.get("train_seconds", 0))
        return len(self.epochs) * self.split.get("train", 0)

    @property
    def rate(self) -> float | None:  # training samples/s while it ran (the last epoch's cumulative figure)
        return self.epochs[-1].get("samples_per_s") if self.epochs else self.attrs.get("samples_per_s")

    @property
    def warm_up(self) -> float | None:
        return self.attrs.get("compile_seconds", self.final.get("compile_seconds"))

    @property
    def validation_per_epoch(self) -> float | None:  # wall minus training seconds, per epoch: validation and upkeep
        if not self.epochs:  # the study alone: its wall less warm-up and training
            epochs, trained = self.attrs.get("epochs_run"), self.attrs.get("train_seconds")
            if not epochs or trained is None:
                return None
            return max(self.wall - (self.warm_up or 0.0) - trained, 0.0) / epochs
        last = self.epochs[-1]
        return (last["wall_seconds"] - last["train_seconds"]) / len(self.epochs)

    @property
    def val_images(self) -> int | None:
        return self.split.get("val") or (self.attrs.get("config") or {}).get("data", {}).get("val_size")


def _json(path: str, lines: bool = False):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()] if lines else json.load(f)
    except (OSError, ValueError):
        return [] if lines else {}


def load_slice(db: str) -> list[Trained]:
    """The trained trials (complete or pruned, not duplicates) of the one study in `db`, by start."""
    import optuna

    from headsearch.search.record import was_trained

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{db}"
    (name,) = optuna.get_all_study_names(storage)
    trials = [t for t in optuna.load_study(study_name=name, storage=storage).trials if was_trained(t)]
    if not trials:
        return []
    t0 = min(t.datetime_start for t in trials)
    out = []
    for t in sorted(trials, key=lambda t: t.datetime_start):
        run = t.user_attrs.get("run_dir", "")
        out.append(Trained(t.number, t.user_attrs.get("arch", "?"), t.state.name,
                           (t.datetime_start - t0).total_seconds(), (t.datetime_complete - t0).total_seconds(),
                           t.values, dict(t.user_attrs), _json(f"{run}/metrics.jsonl", lines=True),
                           _json(f"{run}/final.json"), _json(f"{run}/split.json")))
    return out


def concurrency(trials: list[Trained]) -> int:
    """The most trials that ran at once: the workers (or cohort slots) the plan gave the slice."""
    events = sorted([(t.start, 1) for t in trials] + [(t.end, -1) for t in trials])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def fair_time(seed: Trained, canary_rate: float | None) -> float | None:
    """The seed's epoch seconds measured alone against what A's rate says one epoch of the same images takes."""
    alone = seed.attrs.get("epoch_seconds_alone")
    if not canary_rate or not alone:
        print("fair time: no figure (needs A's rate and the seed's epoch_seconds_alone)")
        return None
    expected = seed.split.get("train", 0) / canary_rate
    off = alone / expected - 1
    verdict = "PASS" if abs(off) <= FAIR_TOLERANCE else "FAIL"
    print(f"fair time: the seed ({seed.arch}, trial {seed.number}) {alone:.3f} s an epoch alone against"
          f" {expected:.3f} s from A's rate ({seed.split.get('train', 0):,} images / {canary_rate:,.0f}):"
          f" {off:+.1%} ({verdict} within {FAIR_TOLERANCE:.0%})")
    return off


def mix_factor(trials: list[Trained], seed: Trained) -> float | None:
    alone = [t.attrs["epoch_seconds_alone"] for t in trials if t.attrs.get("epoch_seconds_alone")]
    if not alone or not seed.attrs.get("epoch_seconds_alone"):
        print("architecture mix: no figure (no epoch_seconds_alone)")
        return None
    factor = statistics.mean(alone) / seed.attrs["epoch_seconds_alone"]
    print(f"architecture mix: mean epoch seconds alone {statistics.mean(alone):.3f} over {len(alone)} architectures"
          f" / the seed's {seed.attrs['epoch_seconds_alone']:.3f} = {factor:.2f}x")
    return factor


def first_wave(trials: list[Trained], k: int) -> float | None:
    """The first k trials to start: samples trained over their wall (warm-ups in), and their rates summed."""
    wave = trials[:k]
    wall = max(t.end for t in wave) - min(t.start for t in wave)
    samples = sum(t.samples for t in wave)
    summed = sum(t.rate or 0 for t in wave)
    print(f"first wave: {len(wave)} trials at once, {samples:,} samples in {wall:.1f} s = {samples / wall:,.0f}"
          f" samples/s (warm-ups in); their training rates summed: {summed:,.0f} samples/s")
    return summed or None


def warm_ups(trials: list[Trained], k: int) -> tuple[list[float], list[float]]:
    cold = [t.warm_up for t in trials[:k] if t.warm_up is not None]
    warm = [t.warm_up for t in trials[k:] if t.warm_up is not None]

    def say(xs):
        return f"median {statistics.median(xs):.1f} s, max {max(xs):.1f} s (n={len(xs)})" if xs else "none recorded"

    print(f"warm-ups: cold (the first {k}) {say(cold)}; warm (later) {say(warm)}")
    return cold, warm


def pruned(trials: list[Trained]) -> None:
    by_epoch: dict[int, int] = {}
    for t in trials:
        if t.state == "PRUNED":
            p = t.attrs.get("pruned") or {}
            epoch = p.get("epoch", len(t.epochs)) if isinstance(p, dict) else len(t.epochs)
            by_epoch[epoch] = by_epoch.get(epoch, 0) + 1
    where = ", ".join(f"{n} at epoch {e}" for e, n in sorted(by_epoch.items())) or "none"
    epochs = sum(len(t.epochs) for t in trials)
    most = max((len(t.epochs) for t in trials), default=0)
    print(f"pruning: {sum(by_epoch.values())} of {len(trials)} trained trials pruned ({where});"
          f" {epochs} epochs trained of {len(trials) * most} without pruning")


def versus(b: list[Trained], c: list[Trained]) -> None:
    """C (both opt-in switches) against B per architecture: the time objective, the wall, a note C alone has."""
    in_b = {t.arch: t for t in b}
    ratios, walls, notes = [], [], 0
    for t in c:
        other = in_b.get(t.arch)
        if other is None:
            continue
        tb, tc = (other.attrs.get("epoch_seconds_alone"), t.attrs.get("epoch_seconds_alone"))
        note = t.attrs.get("step_note") if t.attrs.get("step_note") and not other.attrs.get("step_note") else None
        notes += note is not None
        if tb and tc:
            ratios.append(tc / tb)
        walls.append(t.wall / other.wall if other.wall else float("nan"))
        print(f"   C/B {t.arch}: time alone {tc} / {tb}; wall {t.wall:.1f} / {other.wall:.1f} s"
              + (f"; C ONLY: {note}" if note else ""))
    if not ratios:
        print("C against B: no architecture trained in both")
        return
    fair = abs(statistics.median(ratios) - 1) <= FAIR_TOLERANCE
    print(f"C against B: {len(ratios)} architectures in both; time alone C/B median {statistics.median(ratios):.3f}"
          f" ({'fair' if fair else 'NOT fair'}: within {FAIR_TOLERANCE:.0%}); wall C/B median {statistics.median(walls):.3f};"
          f" {notes} notes in C only; C's trials {len(c)}, wall {max(t.end for t in c):.0f} s against B's"
          f" {len(b)}, {max(t.end for t in b):.0f} s")


def pruned_share(workers: int = 8, seeds: int = 10, table: str = TABLE) -> tuple[float, int]:
    """The share of epochs the default search trains (of trials x epochs) at `workers`, in the simulator's
    replays of `table` with a budget of the whole space (as the headline job's 50 trials on its 39
    architectures), and that budget."""
    from headsearch.search.simulate import replay, simulation_search

    t = json.load(open(table))
    trials = len(t["architectures"])
    shares = []
    for seed in range(seeds):
        r = replay(simulation_search(t, space=t["space"]["name"], trials=trials, seed=seed), t, workers=workers)
        shares.append(r.epochs / (r.trained * t["epochs"]))
    return statistics.median(shares), trials


def project_hours(epochs: float, rate: float, validation_s: float, warm_ups_s: float, tail_s: float, k: int = 8) -> float:
    """hours = (epochs x 45,000 / aggregate rate + validation + warm-ups / k + tail) / 3,600: every term in
    seconds of the whole job but the warm-ups, summed over the trials and paid k at once (8 on an H200's plan)."""
    return (epochs * HEADLINE["train"] / rate + validation_s + warm_ups_s / k + tail_s) / 3600


def projection(trials: list[Trained], k: int, rate: float | None, cold: list[float], warm: list[float],
               share: float | None = None, archs: int | None = None) -> float | None:
    if not rate or k < 1:
        print("projection: no figure (no aggregate rate)")
        return None
    if share is None:
        share, archs = pruned_share(workers=k)
    trials_run = min(HEADLINE["trials"], archs or HEADLINE["trials"])
    epochs = share * trials_run * HEADLINE["epochs"]
    val = [v for t in trials if (v := t.validation_per_epoch) is not None]
    val_images = trials[0].val_images or 1
    validation = statistics.median(val) * HEADLINE["val"] / val_images * epochs / k if val else 0.0
    per_warm = statistics.median(warm or cold or [0.0])
    warm_total = sum(cold) + per_warm * max(trials_run - len(cold), 0)
    tail = 0.5 * HEADLINE["epochs"] * HEADLINE["train"] / (rate / k)  # the last wave, half empty on average
    hours = project_hours(epochs, rate, validation, warm_total, tail, k)
    print(f"projected headline job (`headsearch run --task vit-cifar10 --trials 50`, {trials_run} architectures):"
          f" PROJECTED {hours:.2f} h = ({epochs:,.0f} epochs [{share:.2f} of {trials_run} x {HEADLINE['epochs']}: the share"
          f" the simulator's {k}-worker replays of the 16-epoch table train] x {HEADLINE['train']:,} / {rate:,.0f}"
          f" samples/s + validation {validation:,.0f} s + warm-ups {warm_total:,.0f} s / {k} + tail {tail:,.0f} s) / 3,600")
    return hours


def bench_rate(out: str) -> tuple[int, float] | None:
    """D's fastest way of K processes (K > 1): (K, its aggregate samples/s), from D.log, if D ran. Summed
    per-trial rates overstate a wave whose trials train in turns between warm-ups and validation; bench's
    figure is K processes training at once."""
    best = None
    for line in open(f"{out}/D.log") if os.path.exists(f"{out}/D.log") else []:
        m = re.match(r"\s+(\d+) processes, [^:]+: ([\d,]+) samples/s", line)
        if m and int(m[1]) > 1 and (best is None or float(m[2].replace(",", "")) > best[1]):
            best = (int(m[1]), float(m[2].replace(",", "")))
    return best


def slice_(out: str, share: float | None = None, archs: int | None = None) -> None:
    b = load_slice(f"{out}/b.db") if os.path.exists(f"{out}/b.db") else []
    if not b:
        print("B: NO RESULT (no trained trial in b.db)")
        return
    a = _json(f"{out}/a-seed/final.json")
    k = concurrency(b)
    print(f"B: {len(b)} trained trials ({sum(t.state == 'COMPLETE' for t in b)} complete), at most {k} at once,"
          f" {max(t.end for t in b):.0f} s from the first start to the last end")
    seed = next((t for t in b if t.number == 0), None)  # trial 0: the seed architecture (A's), enqueued first
    if seed is None:  # another architecture's time is no check of A's rate
        print("fair time: no figure (the seed, trial 0, was not trained: interrupted before its end)")
    else:
        fair_time(seed, a.get("samples_per_s"))
        mix_factor(b, seed)
    rate = first_wave(b, k)
    cold, warm = warm_ups(b, k)
    pruned(b)
    c = load_slice(f"{out}/c.db") if os.path.exists(f"{out}/c.db") else []
    if c:
        versus(b, c)
    else:
        print("C: no result (not run, or nothing trained)")
    projection(b, k, rate, cold, warm, share, archs)
    if c:  # what C's switches would make of the headline job, by the same formula
        k = concurrency(c)
        print(f"C: {len(c)} trained trials, at most {k} at once")
        rate = first_wave(c, k)
        cold, warm = warm_ups(c, k)
        projection(c, k, rate, cold, warm, share, archs)
    measured = bench_rate(out)
    if measured:  # the same formula at D's aggregate rate, with the validation and warm-ups of C (else B)
        k, rate = measured
        trials = c or b
        print(f"with D's {k} processes at {rate:,.0f} samples/s and {'C' if c else 'B'}'s validation and warm-ups:")
        cold, warm = warm_ups(trials, k)
        projection(trials, k, rate, cold, warm, None if share is None else share, archs)


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    if what == "run":
        run_line(*rest)
    else:
        {"vit": vit, "search": search, "translation": translation, "canary": canary, "slice": slice_}[what](*rest)
