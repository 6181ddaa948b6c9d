"""`headsearch bench`: a few lines over `headsearch.api.bench`, and its table."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import typer

from headsearch.cli.common import echo_json, exits, fail, format_option, setting_option


@exits(kept="the ways measured so far are saved", interrupted="the ways measured so far are saved")
def bench(
    task: str = setting_option("task"),
    space: str = setting_option("space", "The search space whose base architecture is measured (as in `run`)."),
    preset: Optional[str] = setting_option("preset", "Task preset, as the searches you will run use it (e.g. tiny)."),
    data_dir: Optional[Path] = setting_option("data_dir"),
    data_file: Optional[Path] = setting_option("data_file"),
    device: str = setting_option("device", "auto (the GPUs, else the CPU) or cpu."),
    seconds: Optional[float] = typer.Option(None, "--seconds", help="Timed seconds per way (default 10 on a GPU, 6 on a CPU)."),
    ks: Optional[str] = typer.Option(None, "--ks", help="The K (processes, cohort sizes) to try, comma-separated, e.g. 8 (default: 2,4,8 within the GPU's memory; 2,4 for CPU cohorts)."),
    modes: Optional[str] = typer.Option(None, "--modes", help="Step modes one process tries on a GPU, comma-separated (default off,graphs,reduce-overhead); K processes run the fastest."),
    no_cohorts: bool = typer.Option(False, "--no-cohorts", help="Measure no cohort (K trials stacked in one model)."),
    fmt: str = format_option("table | json", short=False),
) -> None:
    """Measure the ways a search can run its trials on this machine (step modes, processes, MPS, cohorts;
    threads and workers on a CPU), each verified first; save the fastest for `headsearch run` to plan from."""
    from rich.console import Console
    from rich.table import Table

    from headsearch import api
    from headsearch.machine.bench import GPU_MODES

    if fmt not in ("table", "json"):
        fail(f"--format {fmt!r}: use table or json")
    k_list = parse_list("--ks", ks, int, "positive whole numbers, e.g. --ks 4,8", lambda k: k >= 1)
    mode_list = parse_list("--modes", modes, str, f"modes among {', '.join(GPU_MODES)}", lambda m: m in GPU_MODES)
    console = Console(stderr=fmt == "json")
    say = functools.partial(console.print, soft_wrap=True, highlight=False)
    m, plan = api.bench(task, space=space, preset=preset, data_dir=data_dir, data_file=data_file, device=device,
                        seconds=seconds, ks=k_list, modes=mode_list, cohorts=not no_cohorts, announce=console.print,
                        report=lambda r: say(f"  {r.way.describe()}: " + (
                            f"{r.samples_per_s:,.0f} samples/s" if r.verified else f"not used ({r.reason})")))
    if fmt == "json":
        return echo_json(m.to_dict(), indent=2)
    choice = m.choice()
    table = Table("way", "verified", "samples/s", "per trial", "warm-up s", title=f"{m.device}, torch {m.torch}")
    for r in m.results:
        table.add_row(r.way.describe() + (" (chosen)" if r is choice else ""), "yes" if r.verified else "no",
                      f"{r.samples_per_s:,.0f}" if r.verified else "-", f"{r.per_trial:,.0f}" if r.verified else "-",
                      f"{r.compile_seconds:.1f}" if r.verified else "-")
    console.print(table)
    for r in m.results:
        if not r.verified:
            console.print(f"not used: {r.way.describe()}: {r.reason}", soft_wrap=True, highlight=False, markup=False)
    from headsearch.machine.measured import measurement_path

    console.print(f"saved: {measurement_path(m.key)} ({m.seconds:.0f} s)", soft_wrap=True, highlight=False)
    console.print(f"plan of `headsearch run` here: {plan.describe()}", soft_wrap=True, highlight=False, markup=False)


def parse_list(flag: str, text: Optional[str], kind, what: str, ok) -> Optional[list]:
    """A comma-separated option as a list of `kind` (None when not given), or one line and exit 2."""
    if text is None:
        return None
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(ok(v) for v in values):
        fail(f"{flag} {text!r}: give {what}")
    return values
