"""What every command shares: the one-line failure, the storage option, output formats.

Commands import from here, never from `cli/main.py` (which imports the commands to register them).
"""
from __future__ import annotations

import typer

DEFAULT_STORAGE = "sqlite:///headsearch.db"
# Optuna's own CLI reads the storage URL from this variable; headsearch's commands do too.
STORAGE_ENV = "OPTUNA_STORAGE"


SET_HELP = ("SECTION.KEY=VALUE (SECTION arch, train or data; VALUE as YAML), e.g. train.lr=3e-4 data.train_limit=5000;"
            " repeatable; over the preset and --config, under --epochs/--seed/--compile.")


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


def worker_failure_line(failures) -> str:
    """The library's one line for failed worker processes (headsearch.search.workers.failure_line)."""
    from headsearch.search.workers import failure_line

    return failure_line(failures)


def storage_option(help: str = "Optuna storage URL (sqlite, postgresql, journal:FILE, redis).") -> str:
    """`--storage URL`, read from $OPTUNA_STORAGE when the flag is not given."""
    return typer.Option(DEFAULT_STORAGE, "--storage", envvar=STORAGE_ENV, show_envvar=True,
                        help=f"{help} Default: ${STORAGE_ENV}, else {DEFAULT_STORAGE}.")


def check_format(fmt: str, known: tuple[str, ...]) -> None:
    if fmt not in known:
        fail(f"--format {fmt!r} is not known: use {' or '.join(known)}")
