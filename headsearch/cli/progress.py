"""Rich displays: training (a progress bar per epoch and a line per evaluated epoch), a search (a
live table of trials by state, the best values and the current trial), and their results.

A search whose console is not a terminal (a Slurm job's log, `nohup`, a pipe) prints plain lines instead of
the live table (`TrialLog`): one per finished trial and a status line every `STATUS_EVERY` seconds; results
print through `output_console`, whose lines are never wrapped there."""
from __future__ import annotations

import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column, Table

from headsearch.io import hide_passwords
from headsearch.search.record import is_paused, kept_pauses, resumes
from headsearch.search.rungcheck import RungWatch
from headsearch.search.runner import SearchCallback, arch_summary
from headsearch.search.snapshot import snapshot, trial_state
from headsearch.training.trainer import Callback, EpochRecord, StepInfo, TrainResult


# Seconds between a search's status lines when its console is not a terminal; the environment variable
# HEADSEARCH_STATUS_EVERY (seconds) overrides it.
STATUS_EVERY = 120.0
# The width of a console that is not a terminal: wide enough that no table or line of a log wraps.
LOG_WIDTH = 10_000


def output_console(stderr: bool = False) -> Console:
    """The console a command's results print on: Rich's own on a terminal; elsewhere (a file, a pipe, a Slurm
    job's log) one `LOG_WIDTH` columns wide, so that tables and long lines stay whole instead of wrapping at 80."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=LOG_WIDTH)


def log_title(title: str, console: Console):
    """A table's title, whole on one line on a console that is not a terminal (Rich wraps a title to its
    table's width, which breaks a log's line)."""
    from rich.text import Text

    return title if console.is_terminal else Text(title, no_wrap=True, overflow="ignore")


def status_every() -> float:
    """`STATUS_EVERY`, or the seconds HEADSEARCH_STATUS_EVERY gives."""
    from headsearch.environment import env_value

    seconds = env_value("HEADSEARCH_STATUS_EVERY")
    return STATUS_EVERY if seconds is None else seconds


def duration(seconds: float) -> str:
    """0.4s, 42s, 12m05s, 3h07m."""
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())


class TrainProgress(Callback):
    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]} samples/s  {task.fields[metric]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.task_id = None
        self.last_metric = ""
        self.started = False

    def __enter__(self) -> "TrainProgress":
        return self  # the bar starts with training, so input errors print nothing else

    def __exit__(self, *exc) -> None:
        if self.started:
            self.progress.stop()

    def on_start(self, steps_per_epoch: int, epochs: int) -> None:
        if not self.started:
            self.progress.start()
            self.started = True
        self.task_id = self.progress.add_task("train", total=steps_per_epoch * epochs, epoch=f"0/{epochs}",
                                              loss="-", speed="-", metric="")

    def on_prepared(self, step_mode: str, warm_up_seconds: float, note: str | None) -> None:
        if note:  # a faster mode failed: one line, then training goes on in the slower one
            self.progress.console.print(f"note: {note}; training as {step_mode}")
        if warm_up_seconds:
            self.progress.console.print(f"steps: {step_mode} (warm-up {warm_up_seconds:.1f} s, not timed)")

    def on_step(self, info: StepInfo) -> None:
        self.progress.update(self.task_id, completed=info.step, epoch=f"{info.epoch}/{info.epochs}",
                             loss=f"{info.loss:.4f}", speed=f"{info.samples_per_s:,.0f}", metric=self.last_metric)

    def on_epoch_end(self, record: EpochRecord) -> None:
        self.last_metric = _fmt({k: v for k, v in record.metrics.items()})
        self.progress.console.print(
            f"epoch {record.epoch:>3}  train loss {record.train_loss:.4f}  val: {self.last_metric}"
            f"  ({record.samples_per_s:,.0f} samples/s, {record.wall_seconds:.0f}s)"
        )


def print_result(run_dir: Path, result: TrainResult, console: Console | None = None) -> None:
    console = console or output_console()
    title = f"{result.primary_metric}: best validation {result.best_value:.4g} at epoch {result.best_epoch}"
    table = Table("figure", Column("value", justify="right"), title=title)
    for k, v in result.test_metrics.items():
        table.add_row(f"test {k}", f"{v:.4f}")
    table.add_row("parameters", f"{result.params:,}")
    table.add_row("training seconds (to best)", f"{result.train_seconds:.1f} ({result.best_train_seconds:.1f})")
    if result.seconds_to_target is not None:
        table.add_row(f"seconds to {result.primary_metric} {result.target}", f"{result.seconds_to_target:.1f}")
    table.add_row("throughput", f"{result.samples_per_s:,.0f} samples/s")
    console.print(table)
    console.print(f"run directory: {run_dir}")


def grid_label(grid) -> Callable:
    """How `TrialLog` names a comparison's or a table's run (a ConfigGrid point): its config and seed."""
    names = [c.name for c in grid.candidates]

    def label(t) -> str:
        i, seed = t.params.get("config"), t.params.get("seed")
        if isinstance(i, int) and 0 <= i < len(names) and seed is not None:
            return f"{names[i]} seed {seed}"
        return t.user_attrs.get("arch", "")

    return label


class TrialLog:
    """A search's progress as plain lines, for a console that is not a terminal (a Slurm job's log, a pipe):
    one line per trial that finishes (number, architecture, state, its objective values or why it was
    pruned, rejected or failed), read from the study, so that the trials of worker processes count as the
    display's own do, each printed once; and a status line every `every` seconds (default `status_every()`):
    the time since the start, the trials finished and running, and the best value of each objective so far."""

    COUNTED = ("complete", "pruned", "rejected")  # what --trials counts
    UNSHOWN = ("over_budget",)  # bookkeeping: asked when the budget was full, never started

    def __init__(self, study, trials: int, console: Console, label: Callable | None = None,
                 every: float | None = None, clock: Callable[[], float] = time.monotonic,
                 rungs: RungWatch | None = None):
        self.study, self.trials, self.console, self.clock = study, trials, console, clock
        self.rungs = rungs  # the first rung's check: its warning printed once, among the trial lines
        self.label = label or (lambda t: t.user_attrs.get("arch", ""))
        self.every = status_every() if every is None else every
        self.started = clock()
        self.next_status = self.started + self.every
        self.seen: set[int] = set()
        self.finished = 0
        self.direction = None
        self.host = socket.gethostname()  # the "worker" user_attr's host of this machine's trials

    def print(self, line: str) -> None:
        self.console.print(line, soft_wrap=True, markup=False, highlight=False, emoji=False)  # one line, whatever the width

    def start(self) -> None:
        """Take the trials finished already (a resumed study) as printed; say how many there are."""
        meta = self.study.user_attrs.get("headsearch") or {}
        self.direction = (meta.get("objectives") or [{}])[0].get("direction")
        for t in self.study.get_trials(deepcopy=False):
            state = trial_state(t)
            if state not in ("running", "waiting"):
                self.seen.add(t.number)
                self.finished += state in self.COUNTED and resumes(t) is None  # a resumption takes no place of --trials
        if self.finished:
            self.print(f"resuming study {self.study.study_name}: {self.finished} of {self.trials} trials finished already")

    def due(self) -> bool:
        return self.clock() >= self.next_status

    def poll(self, end: str | None = None) -> None:
        """Print the trials finished since the last poll, then the status line when it is due (always when
        `end`, the word the last one starts with: done, stopped)."""
        trials = self.study.get_trials(deepcopy=False)
        for t in trials:
            state = trial_state(t)
            if t.number in self.seen or state in ("running", "waiting"):
                continue
            self.seen.add(t.number)
            self.finished += state in self.COUNTED and resumes(t) is None  # a resumption takes no place of --trials
            if state not in self.UNSHOWN:
                self.print(self.trial_line(t, state))
        if self.rungs is not None and (warning := self.rungs.warning(trials, final=end is not None)):
            self.print(f"warning: {warning}")
        if end or self.due():
            self.status(trials, end)

    def trial_line(self, t, state: str) -> str:
        """trial 3 complete: 4-4 skip=none fusion=none  accuracy 0.8125  time 1.234  (12s; 3/12 finished)"""
        from headsearch.search.report import trial_note

        if state == "complete":
            names = self.study.metric_names or [f"objective {i}" for i in range(len(t.values or []))]
            detail = "  ".join(f"{k} {v:.4g}" for k, v in zip(names, t.values or []))
        elif state == "pruned" and not isinstance(t.user_attrs.get("pruned"), dict):
            detail = f"after {len(t.intermediate_values)} epoch(s)"
        else:
            detail = trial_note(t, state, self.direction)
        took = ""
        if state not in ("rejected", "duplicate") and t.datetime_start and t.datetime_complete:
            took = duration((t.datetime_complete - t.datetime_start).total_seconds())
        host = str(t.user_attrs.get("worker", "")).rsplit(":", 1)[0]
        if host and host != self.host:  # another node's trial (a Slurm array shares one study)
            took = f"{took} on {host}".strip()
        tail = "; ".join(x for x in (took, f"{self.finished}/{self.trials} finished") if x)
        body = "  ".join(x for x in (self.label(t), detail, resumed_text(t)) if x)
        return f"trial {t.number} {shown_state(t, state)}: {body}  ({tail})"

    def status(self, trials, end: str | None = None) -> None:
        """status after 4m00s: 7/12 finished (...), 1 running (...); best so far: ..."""
        snap = snapshot(self.study, trials)
        c, now = snap.counts, self.clock()
        self.next_status = now + self.every
        line = (f"{end or 'status'} after {duration(now - self.started)}: {snap.finished}/{self.trials} finished"
                f" ({c['complete']} complete, {c['pruned']} pruned, {c['rejected']} rejected, {c['failed']} failed"
                f"{snap.resumption_words()})")
        if c["duplicate"]:
            line += f", {c['duplicate']} duplicate proposals skipped"
        running = [t for t in trials if trial_state(t) == "running"]
        if running:
            line += f", {len(running)} running (" + ", ".join(self.running_text(t) for t in running) + ")"
        if snap.best:
            line += "; best so far: " + "  ".join(f"{k} {v:.4g}" for k, v in snap.best.items())
        self.print(line)

    def running_text(self, t) -> str:
        epochs = max(t.intermediate_values, default=0)
        return " ".join(x for x in (f"trial {t.number}", self.label(t)) if x) + (f" after epoch {epochs}" if epochs else " in epoch 1")


class SearchProgress(SearchCallback):
    """Live view of a search: trials by state, the best value of each objective, the current trial. On a
    console that is not a terminal, plain lines instead (`TrialLog`); `label(trial)` names a trial there
    (default: its architecture)."""

    def __init__(self, study, trials: int, console: Console | None = None, label: Callable | None = None):
        from rich.live import Live

        self.study, self.trials = study, trials
        self.console = console or Console(stderr=True)
        self.current = "-"
        self.epoch = ""
        self.step = ""
        self.log: list[str] = []
        self.snap = None
        self.rungs = RungWatch(study)
        self.plain = None if self.console.is_terminal else TrialLog(study, trials, self.console, label, rungs=self.rungs)
        self.live = None if self.plain else Live(self._render(), console=self.console, refresh_per_second=4, transient=False)

    def __enter__(self) -> "SearchProgress":
        if self.plain:
            self.plain.start()
            return self
        self.refresh()
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:  # the last look at the study; after an error (the storage gone, say) the error is what is reported
            if self.plain:
                self.plain.poll("stopped" if exc[0] is not None else "done")
            else:
                self.refresh(final=True)
        except Exception:
            if exc[0] is None:
                raise
        if not self.plain:
            self.live.__exit__(*exc)

    def announce(self, line: str) -> None:
        """The search's plan (workers, trials per GPU, step mode, MPS): one line above the live table."""
        self.console.print(f"plan: {line}", soft_wrap=True, markup=False, highlight=False)  # one line, whatever the width

    def on_cost(self, done: int, total: int, cost) -> None:
        """One architecture's cost measured before the first trial (--sampler cost): a line above the live table."""
        how = f"measured in {cost.seconds:.1f} s" if cost.source == "measured" else "timed by a trial before"
        self.console.print(f"cost {done}/{total}: {cost.arch}: {cost.epoch_seconds_alone:.3g} s per epoch alone ({how})",
                           soft_wrap=True, markup=False, highlight=False)

    def refresh(self, final: bool = False) -> None:
        if self.plain:
            self.plain.poll()
            return
        trials = self.study.get_trials(deepcopy=False)  # read once: the snapshot and the rung check share it
        self.snap = snapshot(self.study, trials)
        if warning := self.rungs.warning(trials, final=final):
            self.console.print(f"warning: {warning}", soft_wrap=True, markup=False, highlight=False)  # above the live table
        self.live.update(self._render())

    def _render(self) -> Table:
        table = Table.grid(padding=(0, 2))
        if self.snap is not None:
            c = self.snap.counts
            table.add_row("trials", f"{self.snap.finished}/{self.trials} finished: {c['complete']} complete, {c['pruned']} pruned,"
                          f" {c['rejected']} rejected, {c['failed']} failed, {c['running']} running"
                          + self.snap.resumption_words()
                          + (f"; {c['duplicate']} duplicate proposals skipped" if c["duplicate"] else ""))
            if self.snap.best:
                table.add_row("best so far", "  ".join(f"{k} {v:.4g}" for k, v in self.snap.best.items()))
            for r in self.snap.running:
                table.add_row(f"trial {r['number']}", f"{r['arch']}  epoch {r['epoch']}")
        table.add_row("current", f"{self.current} {self.epoch} {self.step}")
        for line in self.log[-8:]:
            table.add_row("", line)
        return table

    def on_trial_start(self, number: int, cfg) -> None:
        self.current, self.epoch, self.step = f"trial {number}: {arch_summary(cfg)}", "", ""
        self.refresh()

    def on_step(self, info: StepInfo) -> None:
        if self.plain:
            if self.plain.due():  # the status line, on time within a long epoch
                self.plain.poll()
            return
        self.epoch = f"epoch {info.epoch}/{info.epochs}"
        self.step = f"step {info.epoch_step}/{info.steps_per_epoch} loss {info.loss:.3f} ({info.samples_per_s:,.0f} samples/s)"
        self.live.update(self._render())

    def on_epoch_end(self, record: EpochRecord) -> None:
        if self.plain:
            if self.plain.due():
                self.plain.poll()
            return
        self.epoch = f"epoch {record.epoch} val: {_fmt(record.metrics)}"
        self.refresh()

    def on_trial_end(self, number: int, state: str) -> None:
        if self.plain:
            self.plain.poll()  # its line, read back from the study as a worker process's trials are
            return
        t = self.study.trials[number]
        if state == "COMPLETE":
            detail = "  ".join(f"{k} {v:.4g}" for k, v in zip(self.study.metric_names or [], t.values or []))
        elif "pruned" in t.user_attrs:
            from headsearch.search.report import pruned_text

            direction = (self.study.user_attrs.get("headsearch") or {}).get("objectives", [{}])[0].get("direction")
            detail = pruned_text(t.user_attrs["pruned"], direction)
        else:  # why it was rejected or failed, when it says
            detail = t.user_attrs.get("rejected", t.user_attrs.get("fail_reason", ""))
        body = "  ".join(x for x in (t.user_attrs.get("arch", ""), detail, resumed_text(t)) if x)
        self.log.append(f"trial {number} {shown_state(t, state.lower())}: {body}")
        self.current, self.epoch, self.step = "-", "", ""
        self.refresh()


def shown_state(t, state: str) -> str:
    """A trial's state as a line shows it: "paused" for a pruned trial that kept its state (--pruner-pause)."""
    return "paused" if state == "pruned" and is_paused(t) else state


def resumed_text(t) -> str:
    """"(resumes trial 9)" for a trial that goes on from a paused one, else ""."""
    n = resumes(t)
    return "" if n is None else f"(resumes trial {n})"


def print_search_summary(study, storage: str, console: Console | None = None) -> None:
    console = console or output_console()
    snap = snapshot(study)
    c = snap.counts
    console.print(f"study {study.study_name}: {c['complete']} complete, {c['pruned']} pruned, {c['rejected']} rejected,"
                  f" {c['failed']} failed" + (f"; {c['duplicate']} duplicate proposals skipped (not trained)" if c["duplicate"] else ""))
    if snap.best:
        console.print("best per objective: " + "  ".join(f"{k} {v:.4g}" for k, v in snap.best.items()))
    if kept := kept_pauses(study.get_trials(deepcopy=False)):
        megabytes = sum(path.stat().st_size for path in kept) / 1e6
        console.print(f"paused: {len(kept)} trials keep their state ({megabytes:.1f} MB of pause.pt in their run"
                      " directories); a longer search of this study (a larger --trials) asks its rule about them again")
    console.print(f"next: headsearch report --study {study.study_name} --storage {hide_passwords(storage)}")


def print_analysis(result: dict, console: Console | None = None) -> None:
    """The tables of `headsearch analyze`: per-layer diversity and importance, and the pruning curve."""
    from headsearch.analysis.figures import short_name

    console = console or Console()
    table = Table(title=f"{result['task']}: {result['metric']} {result['baseline']:.4g} on {result['samples']} validation samples")
    for col in ("layer", "H", "q-ortho", "ctx-nonortho", "out-dissim", "att-div", "entropy", "importance"):
        table.add_column(col, justify="right" if col != "layer" else "left")
    table.caption = ("q-ortho, ctx-nonortho (0-1): high = heads less diverse; out-dissim, att-div: high = more diverse;"
                     " entropy in nats; importance: min-max of the per-layer normalised scores")
    fmt_num = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    for layer in result["layers"]:
        sc = layer["scalars"]
        imp = [v for v in layer["importance"] if v is not None]
        table.add_row(short_name(layer["name"]), str(layer["heads"]), fmt_num(sc.get("query_orthogonality")),
                      fmt_num(sc.get("context_nonorthogonality_normalized")), fmt_num(sc.get("output_dissimilarity")),
                      fmt_num(sc.get("attention_diversity")),
                      fmt_num(sum(layer["entropy"]) / len(layer["entropy"])),
                      f"{min(imp):.2f}-{max(imp):.2f}" if imp else "-")
    console.print(table)
    curve = Table(Column("heads pruned", justify="right"), Column(result["metric"], justify="right"),
                  title="pruning curve (least important heads first)")
    for p in result["pruning_curve"]:
        curve.add_row(f"{p['heads_pruned']} ({100 * p['fraction']:.0f}%)", f"{p[result['metric']]:.4g}")
    console.print(curve)
    console.print(f"wrote {len(result['figures'])} figures and analysis.json to {Path(result['figures'][0]).parent}")
    if result.get("uploaded"):
        console.print(f"uploaded to {result['uploaded']}")


class SearchWatch:
    """The live view `headsearch.api` runs a search under (its `watch` hook): a `SearchProgress` for each
    search it opens, kept so that `run` can print the study's summary when it ends or is interrupted."""

    def __init__(self, storage: str | None = None):
        self.storage = storage
        self.study = None

    def __call__(self, study, trials: int, grid=None) -> SearchProgress:
        self.study = study
        return SearchProgress(study, trials, label=grid_label(grid) if grid is not None else None)

    def print_summary(self) -> None:
        if self.study is not None:
            print_search_summary(self.study, self.storage)

    @contextmanager
    def summary_on_interrupt(self):
        """Ctrl-C: the summary of what the study holds, then the interruption goes on to its one line."""
        try:
            yield
        except KeyboardInterrupt:
            self.print_summary()
            raise
