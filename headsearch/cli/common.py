"""What every command shares: the one-line failure and the one place exceptions become exits, the options
several commands take (declared here once), output formats, and help without `<bool>` on flags.

Commands import from here, never from `cli/main.py` (which imports the commands to register them).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand, TyperGroup

DEFAULT_STORAGE = "sqlite:///headsearch.db"
# Optuna's own CLI reads the storage URL from this variable; headsearch's commands do too.
STORAGE_ENV = "OPTUNA_STORAGE"


SET_HELP = ("SECTION.KEY=VALUE (SECTION arch, train or data; VALUE as YAML), e.g. train.lr=3e-4 data.train_limit=5000;"
            " repeatable; over the preset and --config, under --epochs/--seed/--compile.")
TASK_HELP = "Task name (see `headsearch tasks`), or a plugin as package.module:attr (docs/plugins.md)."
DATA_DIR_HELP = "Local dataset folder (vit-cifar10)."
DATA_FILE_HELP = "Local data file (translation-en-es: tab-separated parallel text; plugins that read one file)."
DEVICE_HELP = "auto, cpu, cuda, cuda:1 ..."
FORMAT_HELP = "table (Rich) | json (for scripts)."
COMPILE_HELP = ("How training steps run: auto (default: on CUDA compiled blocks + the whole step in a CUDA graph,"
                " on the CPU eager) | off | graphs | default | reduce-overhead | max-autotune; overrides train.compile."
                " The warm-up is timed apart (compile_seconds in final.json).")
TENSORBOARD_HELP = ("Write each epoch's train loss, learning rate, epoch seconds and validation metrics as TensorBoard"
                    " scalars into DIR (`run`: one run per trial, DIR/trial-NNNNN). Needs the tensorboard package (headsearch's extra of that name).")


# ------------------------------------------------------------------------------------ failures and exits


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def fail_on_fault(e: BaseException, kept: str) -> None:
    """An environment fault (a full disk, an I/O error) gets one line and exit code 1, saying what
    finished work is kept; anything else is re-raised with its traceback (a bug)."""
    from headsearch.errors import environment_fault

    fault = environment_fault(e)
    if fault is None:
        raise e
    fail(f"{fault}: {kept}", code=1)


def exits(kept: Optional[str] = None, interrupted: Optional[str] = None):
    """The one place a command's exceptions become its exit, as a decorator (`@exits(...)`) or a `with`
    block: bad input (`HeadsearchError`) one line, exit code 2 (or the error's `exit_code`, as
    `api.SearchFailed` gives); Ctrl-C "interrupted: <interrupted>", 130; an environment fault one line
    saying what is `kept`, 1. Without `interrupted` (`kept`), Ctrl-C (a fault) goes on as Python raises it."""
    return _Exits(kept, interrupted)


class _Exits:
    def __init__(self, kept: Optional[str], interrupted: Optional[str]):
        self.kept, self.interrupted = kept, interrupted

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        from headsearch.errors import HeadsearchError

        if e is None or isinstance(e, (typer.Exit, typer.Abort, SystemExit)):
            return False
        if isinstance(e, HeadsearchError):
            fail(str(e), code=getattr(e, "exit_code", 2))
        if isinstance(e, KeyboardInterrupt) and self.interrupted is not None:
            fail(f"interrupted: {self.interrupted}", code=130)
        if isinstance(e, Exception) and self.kept is not None:
            fail_on_fault(e, self.kept)
        return False

    def __call__(self, command: Callable) -> Callable:
        @functools.wraps(command)  # Typer reads the options from the wrapped signature
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with self:
                return command(*args, **kwargs)

        return guarded


def worker_failure_line(failures) -> str:
    """The library's one line for failed worker processes (headsearch.search.workers.failure_line)."""
    from headsearch.search.workers import failure_line

    return failure_line(failures)


def check_format(fmt: str, known: tuple[str, ...]) -> None:
    if fmt not in known:
        fail(f"--format {fmt!r} is not known: use {' or '.join(known)}")


# ------------------------------------------------------------------------------------- help without <bool>


def _bare_flags(params: list) -> list:
    """Flags (--help, --pruning-audit, --ablation/--no-ablation) take no value: show no metavar for them."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class Command(TyperCommand):
    """Every command's class: Typer's, with flags shown without a metavar."""

    def get_params(self, ctx):
        return _bare_flags(super().get_params(ctx))


class Group(TyperGroup):
    """The app's class: the same for its own flags (--version, --help, completion)."""

    def get_params(self, ctx):
        return _bare_flags(super().get_params(ctx))


# ------------------------------------------------------------------------------ options several commands take
# Each returns the typer.Option a command takes as a parameter's default; `help` says what differs in a
# command, `panel` names its help panel (None: Typer's "Options").


def storage_option(help: str = "Optuna storage URL (sqlite, postgresql, journal:FILE, redis).", panel: Optional[str] = None) -> str:
    """`--storage URL`, read from $OPTUNA_STORAGE when the flag is not given."""
    return typer.Option(DEFAULT_STORAGE, "--storage", envvar=STORAGE_ENV, show_envvar=True, rich_help_panel=panel,
                        help=f"{help} Default: ${STORAGE_ENV}, else {DEFAULT_STORAGE}.")


def task_option(panel: Optional[str] = None) -> Any:
    return typer.Option(..., "--task", "-t", help=TASK_HELP, rich_help_panel=panel)


def space_option(help: str, panel: Optional[str] = None) -> Any:
    return typer.Option("deep-head", "--space", "-s", help=help, rich_help_panel=panel)


def preset_option(help: str = "Task preset, e.g. tiny for a CPU smoke run.", panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--preset", "-p", help=help, rich_help_panel=panel)


def epochs_option(help: str, panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--epochs", help=help, rich_help_panel=panel)


def data_dir_option(panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--data-dir", help=DATA_DIR_HELP, rich_help_panel=panel)


def data_file_option(panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--data-file", help=DATA_FILE_HELP, rich_help_panel=panel)


def device_option(help: str = DEVICE_HELP, panel: Optional[str] = None) -> Any:
    return typer.Option("auto", "--device", help=help, rich_help_panel=panel)


def format_option(help: str = FORMAT_HELP, short: bool = True) -> Any:
    return typer.Option("table", "--format", *(["-f"] if short else []), help=help)


def study_option(help: str, panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--study", help=help, rich_help_panel=panel)


def run_root_option(help: str = "Run directories go in RUN_ROOT/<study>/.", panel: Optional[str] = None) -> Any:
    return typer.Option(Path("runs"), "--run-root", help=help, rich_help_panel=panel)


def workers_option(panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--workers", help="Worker processes (default: the plan's, as `run`).", rich_help_panel=panel)


def cohort_option(panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--cohort", help="Runs a worker trains as one stacked model (ViT; 1: off).",
                        rich_help_panel=panel)


def sets_option(help: str = SET_HELP, panel: Optional[str] = None) -> Any:
    return typer.Option([], "--set", help=help, metavar="<section.key=value>", rich_help_panel=panel)


def compile_option(panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--compile", help=COMPILE_HELP, rich_help_panel=panel)


def tensorboard_option(panel: Optional[str] = None) -> Any:
    return typer.Option(None, "--tensorboard", help=TENSORBOARD_HELP, rich_help_panel=panel)
