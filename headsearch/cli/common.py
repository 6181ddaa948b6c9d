"""What every command shares: the one-line failure and the one place exceptions become exits, the options
several commands take (declared here once), output formats, and help without `<bool>` on flags.

Commands import from here, never from `cli/main.py` (which imports the commands to register them).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Optional, Sequence

import typer
from typer.core import TyperCommand, TyperGroup

# What the commands that train say of the plan's workers and cohorts (compare, table).
PLAN_WORKERS_HELP = "Worker processes (default: the plan's, as `run`)."
PLAN_COHORT_HELP = "Runs a worker trains as one stacked model (ViT; 1: off)."


# ------------------------------------------------------------------------------------ failures and exits


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, no traceback; a URL's password in it shown as `***`."""
    from headsearch.io import hide_passwords

    typer.echo(f"error: {hide_passwords(message)}", err=True)
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
    `api.SearchFailed` gives); Ctrl-C "interrupted: <interrupted>", 130, and SIGTERM (`errors.Terminated`)
    "interrupted (SIGTERM): <interrupted>", 143; a device fault (`errors.device_fault`) one line and
    <interrupted>, 1; an environment fault one line saying what is `kept`, 1. Without `interrupted` (`kept`),
    Ctrl-C and a device fault (an environment fault) go on as Python raises them."""
    return _Exits(kept, interrupted)


class _Exits:
    def __init__(self, kept: Optional[str], interrupted: Optional[str]):
        self.kept, self.interrupted = kept, interrupted

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        from headsearch.errors import HeadsearchError, device_fault

        if e is None or isinstance(e, (typer.Exit, typer.Abort, SystemExit)):
            return False
        if isinstance(e, HeadsearchError):
            fail(str(e), code=getattr(e, "exit_code", 2))
        if isinstance(e, KeyboardInterrupt) and self.interrupted is not None:
            fail(f"{stopped_by(e)}: {self.interrupted}", code=getattr(e, "exit_code", 130))
        if isinstance(e, Exception) and self.interrupted is not None and (fault := device_fault(e)) is not None:
            fail(f"device fault ({fault}): the device is unusable; {self.interrupted}", code=1)
        if isinstance(e, Exception) and self.kept is not None:
            fail_on_fault(e, self.kept)
        return False

    def __call__(self, command: Callable) -> Callable:
        @functools.wraps(command)  # Typer reads the options from the wrapped signature
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with self:
                return command(*args, **kwargs)

        return guarded


def stopped_by(e: KeyboardInterrupt) -> str:
    """How the one line names a stop: "interrupted" (Ctrl-C), "interrupted (SIGTERM)" (a scheduler's stop)."""
    from headsearch.errors import Terminated

    return f"interrupted ({e.signal_name})" if isinstance(e, Terminated) else "interrupted"


def check_format(fmt: str, known: tuple[str, ...]) -> None:
    if fmt not in known:
        choices = " or ".join(known) if len(known) == 2 else f"one of {', '.join(known)}"
        fail(f"--format {fmt!r} is not known: use {choices}")


def echo_json(data: Any, indent: int = 1, default: Optional[Callable] = None) -> None:
    """`data` as JSON on stdout: what `--format json` prints."""
    import json

    typer.echo(json.dumps(data, indent=indent, default=default))


def right_columns(*headers: str) -> list:
    """Right-justified Rich columns (numbers), to pass among a Table's headers."""
    from rich.table import Column

    return [Column(header, justify="right") for header in headers]


# ------------------------------------------------------------------------------------- help without <bool>


def _bare_flags(params: list) -> list:
    """Flags (--help, --pruning-audit, --ablation/--no-ablation) take no value: show no metavar for them."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


def _registry_names(params: list) -> list:
    """`run`'s --sampler and --pruner list the registries' rows (read when `run` parses or shows its help)."""
    for p in params:
        if p.help and "{samplers}" in p.help:
            from headsearch.search.study import SAMPLERS

            p.help = p.help.replace("{samplers}", " | ".join(SAMPLERS))
        if p.help and "{pruners}" in p.help:
            from headsearch.search.pruning import RULES

            objectives = {rule.name: " (one objective)" if isinstance(rule.several, str) else
                          " (several objectives)" if isinstance(rule.one, str) else "" for rule in RULES.values()}
            p.help = p.help.replace("{pruners}", " | ".join(name + only for name, only in objectives.items()))
    return params


class Command(TyperCommand):
    """Every command's class: Typer's, with flags shown without a metavar."""

    def get_params(self, ctx):
        return _registry_names(_bare_flags(super().get_params(ctx)))


class Group(TyperGroup):
    """The app's class: the same for its own flags (--version, --help, completion)."""

    def get_params(self, ctx):
        return _bare_flags(super().get_params(ctx))


# ------------------------------------------------------------------------------ options several commands take


def format_option(help: str = "table (Rich) | json (for scripts).", short: bool = True) -> Any:
    return typer.Option("table", "--format", *(["-f"] if short else []), help=help)


def setting_option(name: str, help: Optional[str] = None, panel: Optional[str] = None) -> Any:
    """The typer.Option of the setting `name` as `run` takes it (headsearch.search.settings: its flags, default
    and help), which a command takes as a parameter's default: `help` says what differs in this command, `panel`
    names its help panel (None: Typer's "Options")."""
    from headsearch.search.settings import SETTINGS, flag_of, option_of

    o = option_of(name)
    default = ... if SETTINGS[name].default is dataclasses.MISSING else [] if o.repeat else SETTINGS[name].default
    flags = [flag_of(name), *([o.alias] if o.alias else []), *([o.short] if o.short else [])]
    return typer.Option(default, *flags, help=help or o.help, rich_help_panel=panel, metavar=o.metavar,
                        envvar=o.envvar, show_envvar=o.envvar is not None)


# ------------------------------------------------------------------------- the options of the settings tree


def settings_command(extra: Sequence[inspect.Parameter] = ()) -> Callable:
    """A decorator: the command takes one option per `SearchSettings` field (headsearch.search.settings: its flag,
    help, part as the help panel) and the `extra` parameters, and its body gets the settings read from the
    command line as a dict first, then the `extra` values by name."""
    from headsearch.search.settings import SETTINGS, SearchSettings

    hints = typing.get_type_hints(SearchSettings)
    params = [_option_parameter(name, f, hints[name]) for name, f in SETTINGS.items()] + list(extra)

    def decorate(body: Callable) -> Callable:
        @functools.wraps(body)
        def command(**given: Any) -> Any:
            return body({name: _read_option(name, given.pop(name)) for name in SETTINGS}, **given)

        command.__signature__ = inspect.Signature(params)  # what Typer reads the options from
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def _option_parameter(name: str, f: dataclasses.Field, hint: Any) -> inspect.Parameter:
    from headsearch.search.settings import option_of

    o = option_of(name)
    kind = o.cli_type or hint
    annotation = list[kind] if o.repeat else Optional[kind] if f.default is None else kind
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=setting_option(name, panel=o.part))


def _read_option(name: str, given: Any) -> Any:
    """The setting from what the command line gave: an empty repeatable option is the field's default."""
    from headsearch.search.settings import SETTINGS, option_of

    o = option_of(name)
    if o.repeat and not given:
        return SETTINGS[name].default
    return o.read(given) if o.read is not None and given is not None else given
