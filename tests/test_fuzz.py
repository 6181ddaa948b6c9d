"""Property-based (hypothesis) tests of the CLI's bad-input promise.

The promise (docs/reference.md, "What bad input gets"): bad input to any `headsearch` command ends with exit code 2,
one line on stderr that starts with "error: ", no Python traceback, and nothing created on disk: no run
directory, no study database, no output file or folder.

Every example here runs the CLI in-process (Typer's CliRunner, as `tests/conftest.py` does) inside a
fresh temporary directory that is also the working directory, with every output location (--out,
--storage, --run-root, --plots) pointing inside it, and then checks:

  * exit code 2 (an uncaught exception would give 1, a missed check usually 0);
  * stdout + stderr together hold exactly one non-empty line, and it starts with "error: ";
  * "Traceback" appears nowhere in that output;
  * the temporary directory holds exactly what the test itself put there, byte for byte (the
    inputs), so no run directory, no `runs/`, no `h.db` / `headsearch.db`, no `*.budget.lock`, no
    `--out`/`--plots` folder, no `analysis/` inside a run directory, no overwritten file;
  * the example finished within a few seconds (SIGALRM watchdog): bad input must be refused before
    anything trains. A watchdog expiry is reported as "SLOW" and is itself a failure.

What is generated (values that parse as the option's type, so Click's own usage errors never occur):

 1. every field of ArchConfig, TrainConfig, RunConfig (task, seed, the sections themselves) and of the
    tasks' data options (CifarData, TranslationData), for both tasks through `train --config`: a table
    of canonical bad values per field, all tried on every run (`test_canonical_bad_values`, which
    lists every value not refused), and a hypothesis strategy of invalid values per field (out of
    range, NaN/inf, wrong types: strings, lists, mappings, booleans, null; unknown names for choice
    fields), written as a full run config or, for architecture fields, an arch-only file
    (`test_invalid_config_field`); plus sections that are not mappings, unknown sections and keys,
    fields that contradict each other, and sizes far beyond this machine's memory (the size guard).
    The field lists come from the dataclasses, so a new field without bad values fails at once;
 2. junk for every path argument: random bytes, empty files, directories where files go and files
    where directories go, missing paths, YAML that is not a mapping, invalid YAML, malformed CIFAR-10
    layouts (npz and official pickles) and parallel corpora, broken run directories (config.yaml,
    model.safetensors, the tokenizers), existing files as --out/--plots/--artifact-dir/--run-root,
    junk storage URLs and files, and a study whose recorded trial config no longer validates;
    unreadable (chmod 000) files are skipped when running as root, where they stay readable;
 3. bad search settings for `run` (counts, timeout, sampler, pruner, objectives, pruner options,
    heartbeat, seed, epochs, compile, preset, task, and search spaces every trial of which is invalid,
    e.g. head counts that divide nothing); for these the storage must hold no study afterwards;
 4. devices that do not exist here (--device foo / cuda / cuda:7 / mps ...) for train, run, analyze;
 5. the other flags that parse but are invalid (analyze --samples/--format, report --format, export's
    selectors, --trial, --best and --study, dashboard --port);
 6. names and output paths of every command (`NAMES_AND_PATHS`, one row each): study names that cannot name a
    run folder (an empty one included), outputs below a file or in a read-only folder, a folder where a
    file goes, storage files that cannot be; each refused before anything loads, trains or is written.

Every kind of junk is a pytest parameter, so every kind is tried on every run; hypothesis draws the
details. The examples are derandomised (the same on every run; HEADSEARCH_FUZZ_RANDOM=1 draws new
ones, HEADSEARCH_FUZZ_SCALE=N runs N times as many) and not shrunk (they are small already, and
shrinking one that slipped through would retrain it many times). The base configs, spaces and flags
the faults are injected into are themselves valid: the module fixtures train a run per task and run a
one-trial search with them (they also provide the run directories and the study database that the
analyze/report/export cases break). Commands that must load data before they can see the fault (a
junk storage is opened after the data loads) use a small synthetic CIFAR-10 layout instead of the real
one, which takes seconds to load.

A failing example's assertion message names the command (paths shown relative to <tmp>), the files
the test wrote, the exit code, the output, the exception with its innermost frames, and what was left
on disk (with the studies of any database left behind).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import signal
import sqlite3
import string
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

# make test-oldest runs this module on the floor: Typer and Click (how bad input is parsed and told), Hypothesis.
pytestmark = pytest.mark.floor

# ------------------------------------------------------------------------------------------------ settings

# Derandomised, so that a run in CI checks the same examples every time (and a failure reproduces);
# HEADSEARCH_FUZZ_RANDOM=1 draws fresh examples on each run instead, HEADSEARCH_FUZZ_SCALE=N runs N times
# as many. No shrinking: the generated values are small already, and shrinking an example that slipped
# through validation retrains it hundreds of times. No example database (nothing written to .hypothesis/).
_RANDOM = os.environ.get("HEADSEARCH_FUZZ_RANDOM", "") not in ("", "0")
_SCALE = max(1, int(os.environ.get("HEADSEARCH_FUZZ_SCALE", "1") or 1))
COMMON = dict(deadline=None, database=None, derandomize=not _RANDOM, print_blob=False,
              phases=(Phase.explicit, Phase.generate),
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.filter_too_much, HealthCheck.data_too_large])


def examples(n: int) -> settings:
    return settings(max_examples=n * _SCALE, **COMMON)


CHEAP = examples(6)  # each example: milliseconds (validation only)
PATHS = examples(12)
LOADING = examples(4)  # examples that may load data (a second or two each) before they should fail

FAST_LIMIT = 6.0  # seconds an example that only validates may take (milliseconds are normal)
LOAD_LIMIT = 25.0  # seconds an example that may legitimately load data first may take

VIT, MT = "vit-cifar10", "translation-en-es"


# ------------------------------------------------------------------------------------------------ harness


class Slow(Exception):
    """Raised by the watchdog inside the command: it was still running (data loading or training)."""


@contextlib.contextmanager
def watchdog(seconds: float, fired: list):
    def handler(signum, frame):
        fired.append(seconds)
        raise Slow(f"still running after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _digest(p: Path) -> str:
    if p.is_symlink():
        return "symlink"
    if p.is_dir():
        return "dir"
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    except OSError:
        return "unreadable"


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = _digest(p)
    return out


def _show_bytes(data: bytes, limit: int = 300) -> str:
    try:
        text = data.decode("utf-8")
        shown = repr(text[:limit]) + ("..." if len(text) > limit else "")
        return f"text {shown} ({len(data)} bytes)"
    except UnicodeDecodeError:
        return f"bytes {data[:60]!r}{'...' if len(data) > 60 else ''} ({len(data)} bytes)"


def _studies_in(db: Path) -> str:
    """The studies in a SQLite file, read without changing it."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT s.study_name, COUNT(t.trial_id), GROUP_CONCAT(t.state) FROM studies s"
                               " LEFT JOIN trials t ON t.study_id = s.study_id GROUP BY s.study_id").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        return f"no Optuna studies ({e})"
    return "studies: " + ("; ".join(f"{n} ({c} trials: {st_ or '-'})" for n, c, st_ in rows) or "none")


class Box:
    """One example's world: a fresh temporary directory (also the working directory while the CLI
    runs), the inputs the test wrote into it, and the result of one CLI invocation."""

    def __init__(self, root: Path, cache: Path):
        self.root, self.cache = root, cache
        self.inputs: dict[str, str] = {}  # relative path -> description (for the reproducer)
        self.result = None
        self.args: list[str] = []
        self.fired: list = []
        self.before: dict[str, str] = {}
        self.after: dict[str, str] = {}

    # -- inputs -------------------------------------------------------------------------------
    def path(self, rel: str) -> Path:
        return self.root / rel

    def write(self, rel: str, data: bytes | str, note: str | None = None) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        data = data.encode() if isinstance(data, str) else data
        p.write_bytes(data)
        self.inputs[rel] = note or _show_bytes(data)
        return p

    def write_yaml(self, rel: str, obj: Any) -> Path:
        text = yaml.safe_dump(obj, sort_keys=False, allow_unicode=True)
        from headsearch.config import parse_yaml

        # The file must say what the test means (e.g. a string stays a string for headsearch's loader).
        again = yaml.safe_dump(parse_yaml(text), sort_keys=False, allow_unicode=True)
        assert again == text, f"test bug: {obj!r} does not round-trip through YAML"
        return self.write(rel, text)

    def mkdir(self, rel: str, note: str = "an empty directory") -> Path:
        p = self.root / rel
        p.mkdir(parents=True, exist_ok=True)
        self.inputs[rel] = note
        return p

    def copy(self, src: Path, rel: str, note: str) -> Path:
        dst = self.root / rel
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        self.inputs[rel] = note
        return dst

    # -- running ------------------------------------------------------------------------------
    def invoke(self, args, limit: float = FAST_LIMIT):
        from click.testing import CliRunner

        self.args = [str(a) for a in args]
        self.before = snapshot(self.root)
        env = {"COLUMNS": "240", "HEADSEARCH_CACHE": str(self.cache)}
        cwd = os.getcwd()
        os.chdir(self.root)
        try:
            with watchdog(limit, self.fired):
                self.result = CliRunner().invoke(headsearch_command(), self.args, env=env)
        finally:
            os.chdir(cwd)
        self.after = snapshot(self.root)
        return self.result

    def left_behind(self) -> list[str]:
        out = []
        for rel, digest in sorted(self.after.items()):
            if rel not in self.before:
                out.append(f"created {rel}" + ("/" if digest == "dir" else ""))
            elif digest != self.before[rel] and not rel.endswith(".db"):
                out.append(f"changed {rel}")
        out += [f"removed {rel}" for rel in sorted(set(self.before) - set(self.after))]
        return out

    def describe(self) -> str:
        r, root = self.result, str(self.root)
        hide = lambda s: s.replace(root, "<tmp>")  # noqa: E731
        lines = ["", "command: headsearch " + " ".join(hide(a) if a else "''" for a in self.args)]
        for rel, note in sorted(self.inputs.items()):
            lines.append(f"  input <tmp>/{rel}: {hide(note)}")
        if self.fired:
            lines.append(f"SLOW: the watchdog stopped it after {self.fired[0]:.0f} s (it went on to load data, train or serve)")
        lines.append(f"exit code: {r.exit_code}")
        out = hide(r.output)
        shown = out if len(out) < 3000 else out[:1500] + "\n[...]\n" + out[-1500:]
        lines.append("output:\n" + "\n".join("  | " + x for x in shown.splitlines()))
        if r.exception is not None and not isinstance(r.exception, SystemExit) and r.exc_info is not None:
            tb = traceback.format_exception(*r.exc_info)
            lines.append("exception (innermost frames):\n" + hide("".join(tb[-4:])).rstrip())
        lines.append(f"left on disk: {self.left_behind() or 'nothing'}")
        for rel, digest in sorted(self.after.items()):
            if rel.endswith(".db") and rel not in self.before:
                lines.append(f"  {rel}: {_studies_in(self.root / rel)}")
        return "\n".join(lines)

    def assert_bad_input(self) -> None:
        r = self.result
        msg = self.describe()
        assert not self.fired, "SLOW (bad input was not refused: it went on to load data, train or serve)" + msg
        assert r.exit_code == 2, "exit code is not 2" + msg
        assert "Traceback" not in r.output, "a traceback was printed" + msg
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), "not exactly one 'error: ' line" + msg
        assert not self.left_behind(), "something was left on disk" + msg


@contextlib.contextmanager
def box(cache: Path):
    with tempfile.TemporaryDirectory(prefix="hs-fuzz-") as d:
        root = Path(d).resolve()
        try:
            yield Box(root, cache)
        finally:
            # chmod 000 inputs must not stop the clean-up (as a non-root user)
            for dirpath, dirnames, filenames in os.walk(root):
                for name in dirnames + filenames:
                    with contextlib.suppress(OSError):
                        os.chmod(Path(dirpath) / name, 0o700)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """HEADSEARCH_CACHE for every example (outside the checked directories: a tokenizer cache is a cache)."""
    return tmp_path_factory.mktemp("fuzz-cache")


@functools.cache
def headsearch_command():
    """The app's Click command, built once (Typer's public `get_command`): Typer's CliRunner rebuilds it
    on every invoke (~15 ms, 20 times what refusing a bad value takes), which would make the
    thousand-odd examples here slow. Invoking the same command object again is what the real CLI does
    with a fresh one on each run."""
    import typer.main

    from headsearch.cli.main import app

    return typer.main.get_command(app)


@pytest.fixture(scope="module", autouse=True)
def _imports():
    """Import the heavy libraries once, so that the watchdog times commands, not imports."""
    import optuna  # noqa: F401
    import torch  # noqa: F401

    import headsearch.cli.main  # noqa: F401
    import headsearch.search.runner  # noqa: F401
    import headsearch.analysis.tracking  # noqa: F401  (what `train` imports when it starts: 4 s here, 8 s on a busy host)
    import headsearch.tasks.cifar_data  # noqa: F401
    import headsearch.training  # noqa: F401
    import headsearch.training.trainer  # noqa: F401


# ------------------------------------------------------------------------------------------------ base configs

# Cheap, valid configs: should a bad value slip through, training is one step on a few samples.
VIT_BASE = {
    "task": VIT, "seed": 0,
    "arch": {},  # the task's defaults: d_model 48, 4 layers x 4 heads
    "train": {"epochs": 1, "max_steps_per_epoch": 1, "batch_size": 16},
    "data": {"train_limit": 64, "val_size": 64, "test_limit": 64},
}
MT_BASE = {
    "task": MT, "seed": 0,
    "arch": {"d_model": 32, "enc_heads": [2, 2], "dec_heads": [2], "d_ff": 64},
    "train": {"epochs": 1, "max_steps_per_epoch": 1, "batch_size": 16},
    "data": {"train_limit": 200, "val_size": 20, "test_size": 20, "max_len": 16, "vocab_size": 500},
}
BASES = {VIT: VIT_BASE, MT: MT_BASE}

# `headsearch run`: spaces whose every trial is cheap and valid.
VIT_SPACE = {"schedule": {"families": ["uniform"], "heads": [4]}, "skip": ["none"], "fusion": ["none"],
             "fixed": {"train": dict(VIT_BASE["train"]), "data": dict(VIT_BASE["data"])}}
MT_SPACE = {"tasks": [MT], "schedule": {"families": ["uniform"], "heads": [2]}, "skip": ["none"], "fusion": ["none"],
            "fixed": {"arch": {"d_model": 32, "enc_layers": 2, "dec_layers": 1, "dec_heads": 2, "d_ff": 64},
                      "train": dict(MT_BASE["train"]), "data": dict(MT_BASE["data"])}}


def train_args(task: str, b: Box, cifar_dir: Path, spa_file: Path, *extra) -> list:
    data = ["--data-dir", cifar_dir] if task == VIT else ["--data-file", spa_file]
    return ["train", "--task", task, "--preset", "tiny", *data, "--out", b.path("out"), "--device", "cpu", *extra]


def run_args(task: str, b: Box, space: Path, data_path: Path, *extra) -> list:
    data = ["--data-dir" if task == VIT else "--data-file", data_path]
    return ["run", "--task", task, "--preset", "tiny", "--space", space, *data,
            "--storage", f"sqlite:///{b.path('h.db')}", "--run-root", b.path("runs"), "--device", "cpu",
            "--epochs", "1", *extra]


def assert_no_study(b: Box) -> None:
    """Beyond an empty directory: if a database exists at all, it holds no study."""
    db = b.path("h.db")
    if db.exists() and db.stat().st_size:
        import optuna

        summaries = optuna.get_all_study_summaries(storage=f"sqlite:///{db}")
        assert not summaries, "a study was created: " + ", ".join(
            f"{s.study_name} ({s.n_trials} trials)" for s in summaries) + b.describe()


# ------------------------------------------------------------------------------------------------ value strategies

LETTERS = string.ascii_letters + "_-"
_WORD = st.text(LETTERS, min_size=1, max_size=10)
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
LISTS = st.lists(st.integers(-2, 64), max_size=3)
MAPS = st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=4), st.integers(-2, 9), max_size=2)
NONEMPTY_MAPS = st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=4), st.integers(-2, 9), min_size=1, max_size=2)
BOOLS = st.booleans()
NON_INTEGRAL = st.floats(-1e6, 1e6, allow_nan=False).filter(lambda x: not x.is_integer())


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def words(exclude=(), empty: bool = True) -> st.SearchStrategy:
    """Strings that are not numbers (a number-like string is leniently accepted) and not in `exclude`
    (with the empty string unless `empty` is False)."""
    base = st.one_of(st.just(""), _WORD) if empty else _WORD
    return base.filter(lambda s: s not in exclude and not _numeric(s))


def wrong_types(none: bool = True, bools: bool = True) -> st.SearchStrategy:
    """A string, a list, a mapping, a boolean or null where a number goes."""
    options = [words(), LISTS, MAPS]
    if bools:
        options.append(BOOLS)
    if none:
        options.append(st.none())
    return st.one_of(options)


def ints_below(minimum: int, optional: bool = False) -> st.SearchStrategy:
    """An integer field whose valid values are >= minimum."""
    return st.one_of(st.integers(-10**6, minimum - 1), NON_INTEGRAL, NONFINITE, wrong_types(none=not optional))


def floats_outside(ranges: list[st.SearchStrategy], optional: bool = False) -> st.SearchStrategy:
    return st.one_of(*ranges, NONFINITE, wrong_types(none=not optional))


def below(x: float, inclusive: bool) -> st.SearchStrategy:
    """Floats < x (or <= x)."""
    return st.floats(-1e6, x, allow_nan=False, exclude_max=not inclusive).filter(lambda v: v <= x if inclusive else v < x)


def above(x: float, inclusive: bool) -> st.SearchStrategy:
    return st.floats(x, 1e6, allow_nan=False, exclude_min=not inclusive).filter(lambda v: v >= x if inclusive else v > x)


def choice(allowed, none: bool = True, bools: bool = True) -> st.SearchStrategy:
    """An unknown name, or a value of the wrong type, for a choice field."""
    options = [words(exclude=allowed), st.integers(-5, 5), st.floats(allow_nan=False), LISTS, MAPS]
    if bools:
        options.append(BOOLS)
    if none:
        options.append(st.none())
    return st.one_of(options)


GOOD_HEADS = st.sampled_from([1, 2, 4, 8])  # divide both d_models used here (32, 48, 64)
NON_DIVISORS = st.sampled_from([5, 7, 9, 10, 11, 13, 14, 15, 18, 20, 96, 97])  # divide none of 32, 48, 64
BAD_HEAD = st.one_of(st.integers(-50, 0), NON_DIVISORS, NON_INTEGRAL, NONFINITE, words(), st.none(), BOOLS, LISTS, MAPS)


@st.composite
def head_list_with_a_bad_entry(draw):
    heads = draw(st.lists(GOOD_HEADS, max_size=3))
    heads.insert(draw(st.integers(0, len(heads))), draw(BAD_HEAD))
    return heads


def heads_bad() -> st.SearchStrategy:
    return st.one_of(st.integers(-50, 0), NON_DIVISORS, NON_INTEGRAL, NONFINITE, BOOLS, st.none(), NONEMPTY_MAPS,
                     words(), head_list_with_a_bad_entry())


@st.composite
def betas_bad(draw):
    ok = st.floats(0, 1, exclude_max=True)
    bad = st.one_of(below(0, inclusive=False), above(1, inclusive=True), NONFINITE, words(), st.none(), BOOLS, LISTS)
    kind = draw(st.sampled_from(["one out of range", "wrong length", "not a list"]))
    if kind == "one out of range":
        pair = [draw(ok), draw(ok)]
        pair[draw(st.integers(0, 1))] = draw(bad)
        return pair
    if kind == "wrong length":
        return draw(st.lists(ok, max_size=4).filter(lambda x: len(x) != 2))
    return draw(st.one_of(st.floats(allow_nan=False), NONFINITE, words(), BOOLS, st.none(), MAPS))


def split_size_bad() -> st.SearchStrategy:
    """TranslationData.val_size/test_size: valid are whole numbers >= 0 and fractions in (0, 1)."""
    return st.one_of(st.integers(-10**6, -1), below(0, inclusive=False),
                     st.floats(1, 1e6, exclude_min=True).filter(lambda x: not x.is_integer()),
                     NONFINITE, wrong_types())


@st.composite
def augment_bad(draw):
    from headsearch.tasks.vit_cifar10 import AUGMENTATIONS

    kind = draw(st.sampled_from(["a bare string", "an unknown name", "not a list"]))
    if kind == "a bare string":
        return draw(st.one_of(st.sampled_from(AUGMENTATIONS), words()))
    if kind == "an unknown name":
        ops = draw(st.lists(st.sampled_from(AUGMENTATIONS), max_size=2))
        ops.insert(draw(st.integers(0, len(ops))), draw(st.one_of(words(exclude=AUGMENTATIONS), st.integers(), st.none())))
        return ops
    return draw(st.one_of(st.integers(), st.floats(allow_nan=False), BOOLS, st.none(), MAPS))


def _arch_fields(task: str) -> dict[str, st.SearchStrategy]:
    from headsearch.config import ACTIVATIONS, FUSIONS, SKIPS, SOFT_SCORES

    odd = st.integers(0, 5000).map(lambda k: 2 * k + 1)  # divisible by none of the head counts (2 or 4)
    out = {
        "d_model": st.one_of(ints_below(1), odd),
        "enc_layers": ints_below(1),
        "enc_heads": heads_bad(),
        "d_ff": ints_below(1),
        "head_dim": st.one_of(st.integers(-50, 0), NON_INTEGRAL, NONFINITE, words(exclude=("split",)), BOOLS,
                              st.none(), LISTS, MAPS),
        "skip": choice(SKIPS),
        "skip_mean": st.one_of(st.integers(), st.floats(allow_nan=False), NONFINITE, words(), st.none(), LISTS, MAPS),
        "fusion": choice(FUSIONS),
        "soft_dim": ints_below(1, optional=True),
        "soft_score": choice(SOFT_SCORES),
        "activation": choice(ACTIVATIONS),
        "dropout": floats_outside([below(0, False), above(1, True)]),
        "attn_dropout": floats_outside([below(0, False), above(1, True)]),
    }
    if task == VIT:
        # Encoder-only: any decoder layer is wrong, and so is a head count that is not a count.
        out["dec_layers"] = st.one_of(st.integers(-10**6, -1), st.integers(1, 12), NON_INTEGRAL, NONFINITE, wrong_types())
        # (not "" or []: no head counts for no decoder layers is consistent; a positive int likewise)
        out["dec_heads"] = st.one_of(st.integers(-50, 0), NON_INTEGRAL, NONFINITE, BOOLS, st.none(), words(empty=False),
                                     head_list_with_a_bad_entry(), st.lists(GOOD_HEADS, min_size=1, max_size=3))
        out["patch_size"] = st.one_of(ints_below(1), st.integers(1, 200).filter(lambda p: 32 % p != 0))
    else:
        out["dec_layers"] = ints_below(1)  # the translation model needs a decoder
        out["dec_heads"] = heads_bad()
        out["patch_size"] = ints_below(1)  # ViT-only, but a patch size that is not a size is still wrong
    return out


def _train_fields() -> dict[str, st.SearchStrategy]:
    from headsearch.config import AMP_MODES, CHANNELS_LAST, COMPILE_MODES, LR_SCHEDULES, OPTIMIZERS

    return {
        "epochs": ints_below(1),
        "batch_size": ints_below(1),
        "optimizer": choice(OPTIMIZERS),
        "lr": floats_outside([below(0, True)]),
        "weight_decay": floats_outside([below(0, False)]),
        "betas": betas_bad(),
        "eps": floats_outside([below(0, True)]),
        "warmup_epochs": floats_outside([below(0, False)]),
        "schedule": choice(LR_SCHEDULES),
        "min_lr_ratio": floats_outside([below(0, False), above(1, False)]),
        "label_smoothing": floats_outside([below(0, False), above(1, True)]),
        "grad_clip": floats_outside([below(0, True)], optional=True),
        "amp": choice(AMP_MODES),
        "target": st.one_of(NONFINITE, wrong_types(none=False)),
        "max_steps_per_epoch": ints_below(1, optional=True),
        # null/false mean "off" and true "default" (older configs): not bad input
        "compile": choice(COMPILE_MODES, none=False, bools=False),
        "channels_last": choice(CHANNELS_LAST),
        "diversity_samples": ints_below(0),
    }


def _data_fields(task: str) -> dict[str, st.SearchStrategy]:
    if task == VIT:
        left = 50_000 - VIT_BASE["data"]["val_size"]
        return {
            "val_size": st.one_of(st.integers(-10**6, -1), st.integers(50_000, 10**7), NON_INTEGRAL, NONFINITE, wrong_types()),
            "train_limit": st.one_of(st.integers(-10**6, 0), st.integers(left + 1, 10**7), NON_INTEGRAL, NONFINITE,
                                     wrong_types(none=False)),
            "test_limit": st.one_of(st.integers(-10**6, 0), st.integers(10_001, 10**7), NON_INTEGRAL, NONFINITE,
                                    wrong_types(none=False)),
            "augment": augment_bad(),
            "eval_batch_size": ints_below(1),
        }
    return {
        "val_size": split_size_bad(),
        "test_size": split_size_bad(),
        "train_limit": ints_below(1, optional=True),
        "max_len": ints_below(4),
        "vocab_size": ints_below(5),
        "min_frequency": ints_below(1),
        "eval_batch_size": ints_below(1),
        "buckets": buckets_bad(),
        "revision": revision_bad(),
    }


def revision_bad() -> st.SearchStrategy:
    """TranslationData.revision: valid are null and one word (a number is refused: YAML may have changed it)."""
    spaced = st.tuples(_WORD, st.sampled_from([" ", "\t", "\n"]), _WORD).map("".join)
    return st.one_of(st.sampled_from(["", " ", "\t"]), spaced, st.integers(), st.floats(), BOOLS, LISTS, MAPS)


def buckets_bad() -> st.SearchStrategy:
    """TranslationData.buckets: valid are null and increasing whole numbers in 2..max_len (16 in MT_BASE)."""
    bad_length = st.one_of(st.integers(-10**6, 1), st.integers(17, 10**6), NON_INTEGRAL, NONFINITE, words(), st.none(), BOOLS)
    not_increasing = st.lists(st.integers(2, 16), min_size=2, max_size=4).filter(
        lambda xs: any(a >= b for a, b in zip(xs, xs[1:])))
    one_bad = st.tuples(st.lists(st.integers(2, 16), unique=True, max_size=2), bad_length).map(lambda t: sorted(t[0]) + [t[1]])
    return st.one_of(st.just([]), not_increasing, one_bad, words(), st.integers(), st.floats(allow_nan=False), BOOLS, MAPS)


def _dataclass_fields(cls) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls)]


def _field_cases() -> list[tuple[str, str, str]]:
    """(task, section, field) for every field of every config dataclass, both tasks."""
    from headsearch.config import ArchConfig, TrainConfig
    from headsearch.tasks.translation import TranslationData
    from headsearch.tasks.vit_cifar10 import CifarData

    cases = []
    for task, data_cls in ((VIT, CifarData), (MT, TranslationData)):
        cases += [(task, "arch", f) for f in _dataclass_fields(ArchConfig)]
        cases += [(task, "train", f) for f in _dataclass_fields(TrainConfig)]
        cases += [(task, "data", f) for f in _dataclass_fields(data_cls)]
        cases += [(task, "run", "task"), (task, "run", "seed")]
    return cases


FIELD_CASES = _field_cases()


def field_strategy(task: str, section: str, name: str) -> st.SearchStrategy:
    if section == "arch":
        table = _arch_fields(task)
    elif section == "train":
        table = _train_fields()
    elif section == "data":
        table = _data_fields(task)
    elif name == "seed":
        return st.one_of(st.integers(-10**6, -1), st.floats(allow_nan=False), NONFINITE, wrong_types())
    else:  # task
        other = MT if task == VIT else VIT
        return st.one_of(st.just(other), words(exclude=(task,)), st.integers(), st.none(), LISTS, MAPS)
    assert name in table, f"test bug: no invalid-value strategy for {section}.{name} (a new field?)"
    return table[name]


def test_every_config_field_has_a_strategy():
    """The field lists come from the dataclasses: a new field without a strategy fails here."""
    for task, section, name in FIELD_CASES:
        field_strategy(task, section, name)


def full_config(task: str, section: str, name: str, value: Any) -> dict:
    cfg = copy.deepcopy(BASES[task])
    if section == "run":
        cfg[name] = value
    else:
        cfg[section][name] = value
    return cfg


# ------------------------------------------------------------------------------------------------ 1. config fields


# -- the canonical bad values of each field, all of them on every run (hypothesis explores around them) --

NAN, INF = math.nan, math.inf
WRONG = ["abc", [1], {"a": 1}]  # a string, a list, a mapping where a scalar goes


def int_edges(minimum: int, optional: bool = False) -> list:
    return [minimum - 1, min(-1, minimum - 2), 1.5, NAN, INF, True] + WRONG + ([] if optional else [None])


def float_edges(out_of_range: list, optional: bool = False) -> list:
    return out_of_range + [NAN, INF, -INF, True] + WRONG + ([] if optional else [None])


def choice_edges(valid: tuple, none: bool = True, bools: bool = True) -> list:
    return ["nope", valid[0].upper(), "", 1, [valid[0]], {valid[0]: 1}] + ([True] if bools else []) + ([None] if none else [])


HEAD_EDGES = [0, -4, 7, 4.5, INF, True, None, "x", [4, 0], [4, 7], [4.5], [INF], [NAN], [True, True], ["x"], {4: "a"}]


def edge_values(task: str, section: str, name: str) -> list:
    from headsearch.config import (ACTIVATIONS, AMP_MODES, CHANNELS_LAST, COMPILE_MODES, FUSIONS, LR_SCHEDULES,
                                   OPTIMIZERS, SKIPS, SOFT_SCORES)

    vit = task == VIT
    table = {
        ("arch", "d_model"): int_edges(1) + ([50, 47] if vit else [33, 47]),  # not divisible by the heads (4; 2)
        ("arch", "enc_layers"): int_edges(1),
        ("arch", "enc_heads"): HEAD_EDGES,
        ("arch", "dec_layers"): int_edges(0) + [1, 2] if vit else int_edges(1),
        # encoder-only: a positive count for its zero decoder layers says nothing, any list adds layers
        ("arch", "dec_heads"): ([h for h in HEAD_EDGES if h != 7] + [[2], [4, 4]]) if vit else HEAD_EDGES,
        ("arch", "d_ff"): int_edges(1),
        ("arch", "head_dim"): [0, -8, 8.5, INF, NAN, True, False, "eight", "", None, [8], {"a": 8}],
        ("arch", "skip"): choice_edges(SKIPS),
        ("arch", "skip_mean"): [0, 1, "yes", "true", None, 0.5, NAN, [True], {"a": True}],
        ("arch", "fusion"): choice_edges(FUSIONS),
        ("arch", "soft_dim"): int_edges(1, optional=True),
        ("arch", "soft_score"): choice_edges(SOFT_SCORES),
        ("arch", "activation"): choice_edges(ACTIVATIONS),
        ("arch", "dropout"): float_edges([-0.1, 1.0, 1.5]),
        ("arch", "attn_dropout"): float_edges([-0.1, 1.0, 1.5]),
        ("arch", "patch_size"): int_edges(1) + ([3, 5, 64] if vit else []),
        ("train", "epochs"): int_edges(1),
        ("train", "batch_size"): int_edges(1),
        ("train", "optimizer"): choice_edges(OPTIMIZERS),
        ("train", "lr"): float_edges([0.0, -1e-3]),
        ("train", "weight_decay"): float_edges([-0.01]),
        ("train", "betas"): [[1.0, 0.999], [0.9, 1.0], [-0.1, 0.999], [0.9], [0.9, 0.99, 0.999], [], [NAN, 0.999],
                             [INF, 0.999], [False, 0.999], [True, 0.5], ["a", "b"], 0.9, "ab", "00", None, True,
                             {0.9: "a", 0.99: "b"}],
        ("train", "eps"): float_edges([0.0, -1e-8]),
        ("train", "warmup_epochs"): float_edges([-1.0]),
        ("train", "schedule"): choice_edges(LR_SCHEDULES),
        ("train", "min_lr_ratio"): float_edges([-0.1, 1.5]),
        ("train", "label_smoothing"): float_edges([-0.1, 1.0]),
        ("train", "grad_clip"): float_edges([0.0, -1.0], optional=True),
        ("train", "amp"): choice_edges(AMP_MODES),
        ("train", "target"): [NAN, INF, -INF, True, False] + WRONG,
        ("train", "max_steps_per_epoch"): int_edges(1, optional=True),
        ("train", "compile"): choice_edges(COMPILE_MODES, none=False, bools=False),
        ("train", "channels_last"): choice_edges(CHANNELS_LAST),
        ("train", "diversity_samples"): int_edges(0),
        ("run", "seed"): [-1, 1.5, 2.0, NAN, INF, True, False, None] + WRONG,
        ("run", "task"): [MT if vit else VIT, "nope", "", 1, None, [task]],
    }
    if vit:
        table.update({
            ("data", "val_size"): int_edges(0) + [50_000, 10**9],
            ("data", "train_limit"): int_edges(1, optional=True) + [50_000],
            ("data", "test_limit"): int_edges(1, optional=True) + [10_001],
            ("data", "augment"): ["flip", "", "nope", ["nope"], ["flip", "nope"], [1], [None], 1, True, None, {"flip": 1}],
            ("data", "eval_batch_size"): int_edges(1),
        })
    else:
        table.update({
            ("data", "val_size"): [-1, -0.5, 1.5, 2.5, NAN, INF, -INF, True, False, None] + WRONG,
            ("data", "test_size"): [-1, -0.5, 1.5, 2.5, NAN, INF, -INF, True, False, None] + WRONG,
            ("data", "train_limit"): int_edges(1, optional=True),
            ("data", "max_len"): int_edges(4),
            ("data", "vocab_size"): int_edges(5),
            ("data", "min_frequency"): int_edges(1),
            ("data", "eval_batch_size"): int_edges(1),
            ("data", "buckets"): [[], [16, 8], [8, 8], [8, 17], [1, 8], [0], [8, 1.5], [8, NAN], [8, INF], [True], ["x"],
                                  [None], 8, "8,16", True, {"a": 8}],
            ("data", "revision"): ["", " ", "two words", "v1\tv2", 2, 1.1, NAN, True, False, ["main"], {"a": 1}],
        })
    assert (section, name) in table, f"test bug: no edge values for {section}.{name} (a new field?)"
    return table[(section, name)]


def _summary(b: Box) -> str:
    r = b.result
    if b.fired:
        what = f"SLOW (still running after {b.fired[0]:.0f} s)"
    elif r.exception is not None and not isinstance(r.exception, SystemExit):
        what = f"exit {r.exit_code}, {type(r.exception).__name__}: {str(r.exception)[:120]}"
    else:
        lines = [line for line in r.output.splitlines() if line.strip()]
        what = f"exit {r.exit_code}, {len(lines)} line(s)" + (f", first: {lines[0][:100]!r}" if lines else "")
    left = b.left_behind()
    return what + (f"; left {left[0]}{' ...' if len(left) > 1 else ''}" if left else "")


@pytest.mark.parametrize("task,section,name", FIELD_CASES, ids=[f"{t}-{s}.{n}" for t, s, n in FIELD_CASES])
def test_canonical_bad_values(task, section, name, cifar_dir, spa_file, cache):
    """Every canonical bad value of the field, in a full run config: all must be refused. The message
    lists each value that was not (the hypothesis test below explores values around these)."""
    failures = []
    for value in edge_values(task, section, name):
        with box(cache) as b:
            b.write_yaml("config.yaml", full_config(task, section, name, value))
            b.invoke(train_args(task, b, cifar_dir, spa_file, "--config", b.path("config.yaml")))
            try:
                b.assert_bad_input()
            except AssertionError:
                failures.append(f"{section}.{name} = {value!r}: {_summary(b)}")
    assert not failures, f"{len(failures)} bad value(s) of {section}.{name} not refused ({task}):\n" + "\n".join(failures)


@pytest.mark.parametrize("task,section,name", FIELD_CASES, ids=[f"{t}-{s}.{n}" for t, s, n in FIELD_CASES])
@CHEAP
@given(data=st.data())
def test_invalid_config_field(task, section, name, data, cifar_dir, spa_file, cache):
    """`train --config` with one invalid field: exit 2, one line, nothing created, before data loads."""
    value = data.draw(field_strategy(task, section, name), label=f"{section}.{name}")
    arch_only = section == "arch" and data.draw(st.booleans(), label="arch-only file")
    with box(cache) as b:
        cfg = {name: value} if arch_only else full_config(task, section, name, value)
        b.write_yaml("config.yaml", cfg)
        b.invoke(train_args(task, b, cifar_dir, spa_file, "--config", b.path("config.yaml")))
        b.assert_bad_input()


@contextlib.contextmanager
def memory_cap(extra_gib: float = 6.0):
    """Cap this process's address space a few GiB above its current size while a command runs, so that
    a size the guard lets through fails to allocate at once instead of paging the machine to death."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = size + int(extra_gib * 2**30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# Sizes whose training memory is hundreds of GiB to petabytes: the size guard refuses them
# (docs/reference.md, "What bad input gets").
ABSURD = {
    VIT: [("arch", "d_model", 2**20), ("arch", "d_ff", 10**9), ("arch", "enc_layers", 10**6),
          ("arch", "enc_heads", [2**16] * 4), ("train", "batch_size", 10**8)],
    MT: [("arch", "d_model", 2**20), ("arch", "d_ff", 10**9), ("data", "vocab_size", 10**9),
         ("data", "max_len", 10**7), ("train", "batch_size", 10**8)],
}


@pytest.mark.parametrize("task", [VIT, MT])
def test_absurd_sizes_are_refused(task, cifar_dir, spa_file, cache):
    """The size guard: a model far larger than this machine's memory is refused in one line."""
    failures = []
    for section, name, value in ABSURD[task]:
        with box(cache) as b:
            cfg = full_config(task, section, name, value)
            if name == "enc_heads":
                cfg["arch"]["head_dim"] = 64  # 65,536 heads of width 64 each
            b.write_yaml("config.yaml", cfg)
            with memory_cap():
                b.invoke(train_args(task, b, cifar_dir, spa_file, "--config", b.path("config.yaml")))
            try:
                b.assert_bad_input()
            except AssertionError:
                failures.append(f"{section}.{name} = {value!r}: {_summary(b)}")
    assert not failures, f"{len(failures)} absurd size(s) not refused ({task}):\n" + "\n".join(failures)


SECTION_EDGES = [[], False, [1], "abc", 5, True]  # the first two are empty: no different from [], "", 0


@pytest.mark.parametrize("task", [VIT, MT])
def test_canonical_bad_structure(task, cifar_dir, spa_file, cache):
    """A section that is not a mapping (empty or not), unknown sections and unknown keys: all refused."""
    cases = []
    for section in ("arch", "train", "data"):
        cases += [(f"{section}: {v!r}", {**copy.deepcopy(BASES[task]), section: v}) for v in SECTION_EDGES]
        cfg = copy.deepcopy(BASES[task])
        cfg[section]["nope"] = 1
        cases.append((f"{section}.nope: 1", cfg))
    cases.append(("top-level nope: 1", {**copy.deepcopy(BASES[task]), "nope": 1}))
    cases.append(("arch-only file with nope: 1", {"nope": 1}))
    failures = []
    for what, cfg in cases:
        with box(cache) as b:
            b.write_yaml("config.yaml", cfg)
            b.invoke(train_args(task, b, cifar_dir, spa_file, "--config", b.path("config.yaml")))
            try:
                b.assert_bad_input()
            except AssertionError:
                failures.append(f"{what}: {_summary(b)}")
    assert not failures, f"{len(failures)} malformed config(s) not refused ({task}):\n" + "\n".join(failures)


@st.composite
def cross_field(draw, task: str):
    """Fields valid one by one that contradict each other."""
    kind = draw(st.sampled_from(["layers vs heads", "scores skip", "output skip", "unknown arch key",
                                 "unknown train key", "unknown data key", "unknown section", "section type"]
                                + (["train_limit vs val_size"] if task == VIT else [])))
    if kind == "layers vs heads":
        heads = draw(st.lists(GOOD_HEADS, min_size=1, max_size=4))
        layers = draw(st.integers(1, 6).filter(lambda n: n != len(heads)))
        return kind, {"arch": {"enc_layers": layers, "enc_heads": heads}}
    if kind == "scores skip":  # a RealFormer scores skip needs one head count to divide the next
        a, b = draw(st.sampled_from([(3, 2), (2, 3), (4, 3), (3, 4), (8, 6), (6, 8), (16, 12), (12, 16)]))
        return kind, {"arch": {"d_model": 48, "enc_heads": [a, b], "skip": "scores"}}
    if kind == "output skip":  # an output skip with a fixed head width needs equal widths
        a, b = draw(st.sampled_from([(1, 2), (2, 4), (4, 8), (8, 2)]))
        return kind, {"arch": {"enc_heads": [a, b], "head_dim": draw(st.integers(1, 16)), "skip": "output"}}
    if kind == "train_limit vs val_size":
        val = draw(st.integers(0, 49_999))
        return kind, {"data": {"val_size": val, "train_limit": 50_000 - val + draw(st.integers(1, 1000))}}
    if kind.startswith("unknown") and kind != "unknown section":
        section = kind.split()[1]
        from headsearch.config import ArchConfig, TrainConfig
        from headsearch.tasks.translation import TranslationData
        from headsearch.tasks.vit_cifar10 import CifarData

        cls = {"arch": ArchConfig, "train": TrainConfig, "data": CifarData if task == VIT else TranslationData}[section]
        key = draw(words(exclude=_dataclass_fields(cls), empty=False))
        return kind, {section: {key: draw(st.one_of(st.integers(), words(), st.none()))}}
    if kind == "unknown section":
        key = draw(words(exclude=("task", "seed", "arch", "train", "data"), empty=False))
        return kind, {key: draw(st.one_of(st.integers(), MAPS))}
    section = draw(st.sampled_from(["arch", "train", "data"]))
    return kind, {section: draw(st.one_of(LISTS, words(), st.integers(), st.floats(allow_nan=False), BOOLS))}


@pytest.mark.parametrize("task", [VIT, MT])
@examples(40)
@given(data=st.data())
def test_contradictory_or_unknown_config(task, data, cifar_dir, spa_file, cache):
    kind, change = data.draw(cross_field(task), label="change")
    with box(cache) as b:
        cfg = copy.deepcopy(BASES[task])
        for key, value in change.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key].update(value)
            else:
                cfg[key] = value
        b.write_yaml("config.yaml", cfg)
        b.invoke(train_args(task, b, cifar_dir, spa_file, "--config", b.path("config.yaml")))
        b.assert_bad_input()


# ------------------------------------------------------------------------------------------------ 2. junk paths

INVALID_YAML = ["a: [1, 2\n", "a: b: c\n", "key: 'unterminated\n", "- a\nb: c\n", "{a: 1\n", "a:\n  - b\n c: d\n",
                "\tarch: 1\n", "a: *nowhere\n", "[1, 2]]\n", "%YAML 9.9\n---\na: 1\n"]
NON_MAPPING = st.one_of(st.lists(st.integers(), min_size=1, max_size=3), st.integers(), st.floats(allow_nan=False),
                        _WORD, BOOLS)


def _yaml_mapping(data: bytes) -> bool:
    try:
        from headsearch.config import parse_yaml

        return isinstance(parse_yaml(data.decode("utf-8")), dict)
    except Exception:
        return False


JUNK_FILE_KINDS = ("bytes", "empty", "directory", "missing", "non-mapping", "invalid-yaml")


@st.composite
def junk_text_file(draw, kind: str):
    """(kind, payload) for a path where a YAML file is expected."""
    if kind == "bytes":
        data = draw(st.binary(min_size=1, max_size=200))
        assume(not _yaml_mapping(data))  # random bytes could be a valid (empty) mapping
        return kind, data
    if kind == "non-mapping":
        return kind, yaml.safe_dump(draw(NON_MAPPING)).encode()
    if kind == "invalid-yaml":
        return kind, draw(st.sampled_from(INVALID_YAML)).encode()
    return kind, b""


def place_junk(b: Box, rel: str, kind: str, payload: bytes) -> Path:
    if kind == "directory":
        b.mkdir(rel, "a directory (a file is expected)")
    elif kind == "missing":
        return b.path(rel)
    elif kind == "missing-parent":
        return b.path("nowhere") / rel
    else:
        b.write(rel, payload)
    return b.path(rel)


@pytest.mark.parametrize("kind", JUNK_FILE_KINDS)
@examples(4)
@given(data=st.data())
def test_train_config_junk(kind, data, cifar_dir, spa_file, cache):
    junk = data.draw(junk_text_file(kind), label="junk")
    with box(cache) as b:
        path = place_junk(b, "config.yaml", *junk)
        b.invoke(train_args(VIT, b, cifar_dir, spa_file, "--config", path))
        b.assert_bad_input()


# -- CIFAR-10 directories ------------------------------------------------------------------------------

CIFAR_NAMES = np.array(["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"])
CIFAR_MUTATIONS = ["bytes", "empty", "truncated", "no-x", "no-y", "x-dtype", "x-shape", "x-empty", "y-range", "y-length",
                   "y-float", "names-count", "names-mismatch", "object-array", "test-missing", "train-missing",
                   "test-is-dir", "too-few"]


def _npz(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _shard(n: int, names: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {"x": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), "y": np.arange(n) % 10}
    if names:
        out["label_names"] = CIFAR_NAMES
    return out


def synthetic_cifar(n: int = 200) -> dict[str, dict]:
    """A small, valid npz layout: enough images for VIT_BASE's val_size + train_limit and test_limit."""
    return {"train_0.npz": _shard(n, names=False), "test.npz": _shard(n, names=True, seed=1)}


@pytest.fixture(scope="module")
def small_cifar(tmp_path_factory) -> Path:
    """The synthetic valid layout (200 + 200 images): loads in milliseconds where the real data takes
    seconds, for the commands that load data before they can find the fault (storages, run roots,
    checkpoints). The base configs fit it."""
    d = tmp_path_factory.mktemp("small-cifar")
    for name, arrays in synthetic_cifar().items():
        (d / name).write_bytes(_npz(arrays))
    return d


def test_synthetic_cifar_baseline_is_valid(tmp_path):
    """The mutations below start from this layout: it must load, so each mutation is the only fault."""
    from headsearch.tasks.cifar_data import load_cifar10

    for name, arrays in synthetic_cifar().items():
        (tmp_path / name).write_bytes(_npz(arrays))
    arrays = load_cifar10(tmp_path)
    assert len(arrays.train_y) == 200 and len(arrays.test_y) == 200


PY_MUTATIONS = ["truncated", "not-a-dict", "no-data", "data-shape", "labels-range", "missing-file"]
CIFAR_CASES = (["file", "missing", "empty-dir"] + [f"npz:{m}" for m in CIFAR_MUTATIONS]
               + [f"python:{m}" for m in PY_MUTATIONS])


@st.composite
def cifar_junk(draw, case: str):
    """A broken CIFAR-10 directory: `case` is "file", "missing", "empty-dir", "npz:MUTATION" (of a small
    valid npz layout) or "python:MUTATION" (of small official-format pickles)."""
    if case == "file":
        return case, draw(st.binary(max_size=64))
    if case in ("missing", "empty-dir"):
        return case, None
    layout, mutation = case.split(":")
    if layout == "npz":
        return "shard", (mutation, draw(st.sampled_from(["train_0.npz", "test.npz"])),
                         draw(st.binary(min_size=1, max_size=300)), draw(st.floats(0.05, 0.95)))
    return "python-batches", (mutation, draw(st.sampled_from(["data_batch_1", "test_batch", "batches.meta"])))


def place_cifar_junk(b: Box, spec) -> Path:
    kind, detail = spec
    rel = "cifar"
    if kind == "file":
        b.write(rel, detail, "a file (a CIFAR-10 directory is expected): " + _show_bytes(detail))
        return b.path(rel)
    if kind == "missing":
        return b.path(rel)
    if kind == "empty-dir":
        b.mkdir(rel)
        return b.path(rel)
    if kind == "python-batches":
        return _place_python_batches(b, rel, *detail)
    mutation, target, junk, frac = detail
    if mutation == "names-mismatch":
        target = "train_0.npz"  # the test shard's names are the reference
    shards = synthetic_cifar()
    files: dict[str, Any] = {name: _npz(arrays) for name, arrays in shards.items()}
    notes = {name: "a synthetic valid npz shard (200 images)" for name in files}
    a = dict(shards[target])
    mutated = f"a synthetic npz shard with mutation {mutation}"
    if mutation == "bytes":
        files[target], mutated = junk, "random bytes: " + _show_bytes(junk)
    elif mutation == "empty":
        files[target] = b""
    elif mutation == "truncated":
        files[target] = files[target][: int(len(files[target]) * frac)]
        mutated = f"a valid npz cut to {frac:.0%} ({len(files[target])} bytes)"
    elif mutation in ("test-missing", "train-missing"):
        files.pop("test.npz" if mutation == "test-missing" else "train_0.npz")
    elif mutation == "test-is-dir":
        files["test.npz"] = "dir"
    elif mutation == "too-few":  # valid format, fewer images than val_size + train_limit (64 + 64) ask for
        files = {name: _npz(_shard(10, names=name == "test.npz")) for name in files}
        notes = {name: "a synthetic valid npz shard of 10 images" for name in files}
    else:
        if mutation == "no-x":
            a.pop("x")
        elif mutation == "no-y":
            a.pop("y")
        elif mutation == "x-dtype":
            a["x"] = a["x"].astype(np.float32)
        elif mutation == "x-shape":
            a["x"] = np.ascontiguousarray(a["x"].transpose(0, 3, 1, 2))  # CHW instead of HWC
        elif mutation == "x-empty":
            a["x"], a["y"] = a["x"][:0], a["y"][:0]
        elif mutation == "y-range":
            a["y"] = a["y"].copy()
            a["y"][3] = 10
        elif mutation == "y-length":
            a["y"] = a["y"][:-1]
        elif mutation == "y-float":
            a["y"] = a["y"].astype(np.float32) + 0.5
        elif mutation == "names-count":
            a["label_names"] = CIFAR_NAMES[:9]
        elif mutation == "names-mismatch":
            a["label_names"] = CIFAR_NAMES[::-1]
        elif mutation == "object-array":
            a["x"] = np.array([{"pixels": i} for i in range(4)], dtype=object)  # np.savez pickles it
        else:
            raise AssertionError(mutation)
        files[target] = _npz(a)
    for name, data in files.items():
        note = mutated if name == target else notes[name]
        if data == "dir":
            b.mkdir(f"{rel}/{name}", "a directory named test.npz")
        else:
            b.write(f"{rel}/{name}", data, note)
    if mutation in ("test-missing", "train-missing"):
        b.inputs[f"{rel}/(absent)"] = "test.npz left out" if mutation == "test-missing" else "train_0.npz left out"
    return b.path(rel)


def _batch(n: int = 20) -> dict:
    rng = np.random.default_rng(0)
    return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(np.arange(n) % 10)}


def _place_python_batches(b: Box, rel: str, mutation: str, target: str) -> Path:
    files = {f"data_batch_{i}": pickle.dumps(_batch()) for i in range(1, 6)}
    files["test_batch"] = pickle.dumps(_batch())
    files["batches.meta"] = pickle.dumps({b"label_names": [n.encode() for n in CIFAR_NAMES]})
    if mutation == "truncated":
        files[target] = files[target][: len(files[target]) // 2]
    elif mutation == "not-a-dict":
        files[target] = pickle.dumps([1, 2, 3])
    elif mutation == "no-data":
        files[target] = pickle.dumps({b"labels": [0, 1]}) if target != "batches.meta" else pickle.dumps({b"x": 1})
    elif mutation == "data-shape":
        bad = _batch()
        bad[b"data"] = bad[b"data"][:, :100]
        files[target] = pickle.dumps(bad) if target != "batches.meta" else pickle.dumps({b"label_names": [b"a"] * 3})
    elif mutation == "labels-range":
        bad = _batch()
        bad[b"labels"] = [11] * 20
        files[target] = pickle.dumps(bad) if target != "batches.meta" else pickle.dumps({b"label_names": list(range(10))[:4]})
    elif mutation == "missing-file":
        files.pop(target)
    for name, data in files.items():
        b.write(f"{rel}/cifar-10-batches-py/{name}", data,
                f"{mutation} pickle" if name == target else "a valid official-format pickle (20 images)")
    return b.path(rel)


@pytest.mark.parametrize("case", CIFAR_CASES)
@examples(2)
@given(data=st.data())
def test_train_data_dir_junk(case, data, cache):
    spec = data.draw(cifar_junk(case), label="data")
    with box(cache) as b:
        b.write_yaml("config.yaml", VIT_BASE)
        path = place_cifar_junk(b, spec)
        b.invoke(["train", "--task", VIT, "--preset", "tiny", "--config", b.path("config.yaml"), "--data-dir", path,
                  "--out", b.path("out"), "--device", "cpu"], limit=LOAD_LIMIT)
        b.assert_bad_input()


# -- parallel corpora ----------------------------------------------------------------------------------

SPA_KINDS = ["bytes", "empty", "directory", "missing", "no-tabs", "empty-side", "bad-line", "blank", "too-few", "latin-1"]


@st.composite
def spa_junk(draw, kind: str):
    """A broken parallel corpus of the given kind."""
    pairs = "\n".join(f"Sentence {i}.\tFrase {i}." for i in range(300))
    if kind == "bytes":
        data = draw(st.binary(min_size=1, max_size=300))
        assume(b"\t" not in data)  # no line can be a sentence pair
        return kind, data
    if kind == "no-tabs":
        return kind, "\n".join(draw(st.lists(st.text(LETTERS + " .", min_size=1, max_size=30), min_size=1, max_size=5))).encode()
    if kind == "empty-side":
        line = draw(st.sampled_from(["Hello.\t", "\tHola.", "Hello.\t \tCC-BY", " \tHola.\tCC-BY"]))
        return kind, (pairs + "\n" + line + "\n" + pairs).encode()
    if kind == "bad-line":  # one line without a tab among good ones
        return kind, (pairs + "\n" + draw(st.text(LETTERS + " .", min_size=1, max_size=30)) + "\n" + pairs).encode()
    if kind == "blank":
        return kind, draw(st.sampled_from(["\n", "\n\n\n", "   \n\t\n", "\r\n"])).encode()
    if kind == "too-few":  # valid pairs, fewer than val_size + test_size + one training pair
        n = draw(st.integers(1, 30))
        return kind, "\n".join(f"Sentence {i}.\tFrase {i}." for i in range(n)).encode()
    if kind == "latin-1":
        return kind, (pairs + "\nCaf\xe9.\tCaf\xe9.\n").encode("latin-1")
    return kind, b""


def place_spa_junk(b: Box, spec) -> Path:
    kind, data = spec
    if kind in ("directory", "missing"):
        return place_junk(b, "spa.txt", kind, data)
    note = f"{kind}: " + _show_bytes(data)
    if kind in ("empty-side", "bad-line", "latin-1"):  # 300 good pairs around one bad line
        lines = data.split(b"\n")
        note = f"{kind}: lines 1-300 'Sentence i.<TAB>Frase i.', then line 301 {lines[300]!r}, then 300 more good pairs"
    b.write("spa.txt", data, note)
    return b.path("spa.txt")


@pytest.mark.parametrize("kind", SPA_KINDS)
@examples(3)
@given(data=st.data())
def test_train_data_file_junk(kind, data, cache):
    spec = data.draw(spa_junk(kind), label="data")
    with box(cache) as b:
        b.write_yaml("config.yaml", MT_BASE)
        path = place_spa_junk(b, spec)
        b.invoke(["train", "--task", MT, "--preset", "tiny", "--config", b.path("config.yaml"), "--data-file", path,
                  "--out", b.path("out"), "--device", "cpu"], limit=LOAD_LIMIT)
        b.assert_bad_input()


@pytest.mark.parametrize("command", ["train", "run"])
@pytest.mark.parametrize("task", [VIT, MT])
def test_wrong_kind_of_data_source(command, task, small_cifar, spa_file, cache):
    """vit-cifar10 given --data-file, translation given --data-dir (both paths exist)."""
    with box(cache) as b:
        source = ["--data-file", spa_file] if task == VIT else ["--data-dir", small_cifar]
        if command == "train":
            config = b.write_yaml("config.yaml", BASES[task])
            args = ["train", "--task", task, "--preset", "tiny", "--config", config, *source, "--out", b.path("out"),
                    "--device", "cpu"]
        else:
            space = b.write_yaml("space.yaml", VIT_SPACE if task == VIT else MT_SPACE)
            args = run_args(task, b, space, Path("x"), "--trials", "1")
            j = args.index("--data-dir" if task == VIT else "--data-file")
            args[j:j + 2] = source
        b.invoke(args, limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


# -- --out ------------------------------------------------------------------------------------------------

@PATHS
@given(kind=st.sampled_from(["a file", "a non-empty directory", "below a file"]), content=st.binary(max_size=50),
       task=st.sampled_from([VIT, MT]))
def test_train_out_taken(kind, content, task, cifar_dir, spa_file, cache):
    with box(cache) as b:
        b.write_yaml("config.yaml", BASES[task])
        if kind == "a file":
            out = b.write("out", content)
        elif kind == "a non-empty directory":
            b.write("out/keep.txt", content)
            out = b.path("out")
        else:
            out = b.write("out", content) / "run"
        data = ["--data-dir", cifar_dir] if task == VIT else ["--data-file", spa_file]
        b.invoke(["train", "--task", task, "--preset", "tiny", "--config", b.path("config.yaml"), *data, "--out", out,
                  "--device", "cpu"])
        b.assert_bad_input()


# -- run: --space, --data-dir, --data-file, --run-root, --storage -------------------------------------------

def _names(cls_path: str) -> list[str]:
    import dataclasses
    import importlib

    module, name = cls_path.rsplit(".", 1)
    return [f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))]


ARCH_FIELDS = _names("headsearch.config.ArchConfig")
TRAIN_FIELDS = _names("headsearch.config.TrainConfig")


def space_content_bad() -> dict[str, st.SearchStrategy]:
    """Search-space mappings that parse as YAML but are not valid spaces, by what is wrong."""
    return dict(zip(SPACE_CONTENT, [
        st.fixed_dictionaries({"schedule": st.fixed_dictionaries({"families": st.lists(words(("uniform", "halving", "doubling", "free")), min_size=1, max_size=2)})}),
        st.fixed_dictionaries({"schedule": st.fixed_dictionaries({"heads": st.one_of(st.lists(st.integers(-8, 0), min_size=1, max_size=3), st.just([]), words(), st.lists(st.floats(0.1, 3.9).filter(lambda x: not x.is_integer()), min_size=1, max_size=2))})}),
        st.fixed_dictionaries({"schedule": st.fixed_dictionaries({"min_heads": st.one_of(st.integers(-5, 0), words(), st.floats(0.1, 2.9).filter(lambda x: not x.is_integer()))})}),
        st.fixed_dictionaries({"skip": st.one_of(st.lists(words(("none", "output", "scores")), min_size=1, max_size=2), st.just([]))}),
        st.fixed_dictionaries({"fusion": st.one_of(st.lists(words(("none", "hadamard", "add")), min_size=1, max_size=2), st.just([]))}),
        st.fixed_dictionaries({"ranges": st.one_of(
            st.fixed_dictionaries({"lr": st.fixed_dictionaries({"low": st.floats(0.1, 1), "high": st.floats(0.001, 0.09)})}),
            st.fixed_dictionaries({"lr": st.fixed_dictionaries({"low": st.floats(-1, 0), "high": st.floats(0.1, 1), "log": st.just(True)})}),
            st.dictionaries(words(exclude=ARCH_FIELDS + TRAIN_FIELDS, empty=False), st.lists(st.integers(), min_size=1, max_size=2),
                            min_size=1, max_size=1),
            st.fixed_dictionaries({"d_model": st.one_of(st.just([]), st.integers(), words())}),
            st.fixed_dictionaries({"enc_heads": st.just([2, 4])}))}),
        st.fixed_dictionaries({"fixed": st.one_of(
            st.fixed_dictionaries({"arch": st.fixed_dictionaries({"d_model": st.integers(-64, 0)})}),
            st.fixed_dictionaries({"train": st.fixed_dictionaries({"lr": below(0, True)})}),
            st.fixed_dictionaries({"data": st.fixed_dictionaries({"val_size": st.integers(-10, -1)})}),
            st.dictionaries(words(("arch", "train", "data"), empty=False), MAPS, min_size=1, max_size=1),
            st.fixed_dictionaries({"arch": st.dictionaries(words(exclude=ARCH_FIELDS, empty=False), st.integers(), min_size=1, max_size=1)}))}),
        st.fixed_dictionaries({"tasks": st.one_of(st.just([MT]), words(), st.lists(st.integers(), min_size=1, max_size=2))}),
        st.dictionaries(words(("description", "tasks", "schedule", "skip", "fusion", "ranges", "fixed"), empty=False),
                        st.integers(), min_size=1, max_size=1),
    ]))


SPACE_CONTENT = ["families", "heads", "min_heads", "skip", "fusion", "ranges", "fixed", "tasks", "unknown key"]
SPACE_CASES = list(JUNK_FILE_KINDS) + [f"content:{c}" for c in SPACE_CONTENT]


@pytest.mark.parametrize("case", SPACE_CASES)
@examples(3)
@given(data=st.data())
def test_run_space_junk(case, data, small_cifar, cache):
    if case.startswith("content:"):
        spec = "content", yaml.safe_dump(data.draw(space_content_bad()[case.split(":")[1]], label="space")).encode()
    else:
        spec = data.draw(junk_text_file(case), label="space")
    with box(cache) as b:
        kind, payload = spec
        path = place_junk(b, "space.yaml", kind, payload) if kind != "content" else b.write("space.yaml", payload)
        b.invoke(run_args(VIT, b, path, small_cifar, "--trials", "1"), limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


@pytest.mark.parametrize("case", CIFAR_CASES)
@examples(1)
@given(data=st.data())
def test_run_data_dir_junk(case, data, cache):
    spec = data.draw(cifar_junk(case), label="data")
    with box(cache) as b:
        space = b.write_yaml("space.yaml", VIT_SPACE)
        path = place_cifar_junk(b, spec)
        b.invoke(run_args(VIT, b, space, path, "--trials", "1"), limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


@pytest.mark.parametrize("kind", SPA_KINDS)
@examples(2)
@given(data=st.data())
def test_run_data_file_junk(kind, data, cache):
    spec = data.draw(spa_junk(kind), label="data")
    with box(cache) as b:
        space = b.write_yaml("space.yaml", MT_SPACE)
        path = place_spa_junk(b, spec)
        b.invoke(run_args(MT, b, space, path, "--trials", "1"), limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


@LOADING
@given(kind=st.sampled_from(["a file", "below a file"]), content=st.binary(max_size=40))
def test_run_root_is_a_file(kind, content, small_cifar, cache):
    with box(cache) as b:
        space = b.write_yaml("space.yaml", VIT_SPACE)
        f = b.write("taken", content)
        root = f if kind == "a file" else f / "runs"
        args = run_args(VIT, b, space, small_cifar, "--trials", "1")
        args[args.index("--run-root") + 1] = root
        b.invoke(args, limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


STORAGE_KINDS = ["no-scheme", "unknown-scheme", "sqlite-dir", "sqlite-missing-dir", "sqlite-below-a-file", "sqlite-junk-file",
                 "sqlite-empty-file", "journal-dir", "journal-junk-file", "log-junk-file"]


@st.composite
def storage_junk(draw, kind: str):
    return kind, draw(st.binary(min_size=1, max_size=200)), draw(_WORD)


def place_storage_junk(b: Box, spec) -> str:
    kind, junk, word = spec
    if kind == "no-scheme":
        return word
    if kind == "unknown-scheme":
        return f"{word.lower()}x://{word}"
    if kind == "sqlite-dir":
        return f"sqlite:///{b.mkdir('db')}"
    if kind == "sqlite-missing-dir":
        return f"sqlite:///{b.path('nowhere/h.db')}"
    if kind == "sqlite-below-a-file":
        return f"sqlite:///{b.write('taken', junk)}/h.db"
    if kind == "sqlite-empty-file":
        return f"sqlite:///{b.write('empty.db', b'')}"
    if kind == "sqlite-junk-file":
        return f"sqlite:///{b.write('junk.db', junk)}"
    if kind == "journal-dir":
        return f"journal:{b.mkdir('journal')}"
    if kind == "journal-junk-file":
        return f"journal:{b.write('journal.bin', junk)}"
    return str(b.write("study.log", junk))


# An empty file is a valid new SQLite database (SQLite's own rule): fine for `run`, which creates storages.
RUN_STORAGE_KINDS = [k for k in STORAGE_KINDS if k != "sqlite-empty-file"]


@pytest.mark.parametrize("kind", RUN_STORAGE_KINDS)
@examples(2)
@given(data=st.data())
def test_run_storage_junk(kind, data, small_cifar, cache):
    spec = data.draw(storage_junk(kind), label="storage")
    with box(cache) as b:
        space = b.write_yaml("space.yaml", VIT_SPACE)
        url = place_storage_junk(b, spec)
        args = run_args(VIT, b, space, small_cifar, "--trials", "1")
        args[args.index("--storage") + 1] = url
        b.invoke(args, limit=LOAD_LIMIT)
        b.assert_bad_input()


# -- analyze ----------------------------------------------------------------------------------------------

def _cli_ok(args: list, cache: Path, cwd: Path) -> None:
    """A command that must succeed (the positive controls behind the templates)."""
    from typer.testing import CliRunner

    from headsearch.cli.main import app

    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "240", "HEADSEARCH_CACHE": str(cache)})
    finally:
        os.chdir(old)
    assert r.exit_code == 0, (args, r.exit_code, r.output[-3000:], r.exception)


@pytest.fixture(scope="module")
def run_templates(tmp_path_factory, cifar_dir, spa_file, cache) -> dict[str, Path]:
    """A real run directory per task, written by `headsearch train` with the cheap base configs used
    throughout this file (so these also show that the base configs and flags are valid input)."""
    root = tmp_path_factory.mktemp("run-templates")
    out = {}
    for task in (VIT, MT):
        (root / f"{task}.yaml").write_text(yaml.safe_dump(BASES[task], sort_keys=False))
        data = ["--data-dir", cifar_dir] if task == VIT else ["--data-file", spa_file]
        _cli_ok(["train", "--task", task, "--preset", "tiny", "--config", root / f"{task}.yaml", *data,
                 "--out", root / task, "--device", "cpu"], cache, root)
        out[task] = root / task
    return out


@pytest.fixture(scope="module")
def study_template(tmp_path_factory, cifar_dir, cache) -> Path:
    """A real study database: `headsearch run` with VIT_SPACE and the flags `run_args` uses, one trial,
    study "s" (so it also shows that those settings are valid input)."""
    root = tmp_path_factory.mktemp("study-template")
    (root / "space.yaml").write_text(yaml.safe_dump(VIT_SPACE, sort_keys=False))
    _cli_ok(["run", "--task", VIT, "--preset", "tiny", "--space", root / "space.yaml", "--data-dir", cifar_dir,
             "--storage", f"sqlite:///{root / 'h.db'}", "--run-root", root / "runs", "--device", "cpu", "--epochs", "1",
             "--trials", "1", "--study", "s"], cache, root)
    return root / "h.db"


RUN_DIR_FAULTS = ["missing", "a file", "empty dir", "config:bytes", "config:empty", "config:non-mapping",
                  "config:invalid-yaml", "config:directory", "config:missing", "config:invalid-values",
                  "config:no-task", "checkpoint:bytes", "checkpoint:empty", "checkpoint:truncated",
                  "checkpoint:other-model", "checkpoint:directory", "checkpoint:missing"]
MT_RUN_DIR_FAULTS = ["tokenizer:bytes", "tokenizer:empty", "tokenizer:json", "tokenizer:directory"]


RUN_DIR_CASES = [(t, f) for t in (VIT, MT) for f in RUN_DIR_FAULTS + (MT_RUN_DIR_FAULTS if t == MT else [])]


@st.composite
def run_dir_fault(draw, task: str, fault: str):
    junk = draw(st.binary(min_size=1, max_size=200))
    frac = draw(st.floats(0.0, 0.99))
    section, name = draw(st.sampled_from([(s, n) for t, s, n in FIELD_CASES if t == task and s != "run"]))
    value = draw(field_strategy(task, section, name))
    return fault, junk, frac, (section, name, value), draw(st.sampled_from(INVALID_YAML)), draw(NON_MAPPING)


def place_run_dir(b: Box, template: Path, task: str, spec) -> Path:
    fault, junk, frac, (section, name, value), bad_yaml, non_mapping = spec
    rel = "run"
    if fault == "missing":
        return b.path(rel)
    if fault == "a file":
        b.write(rel, junk, "a file (a run directory is expected)")
        return b.path(rel)
    if fault == "empty dir":
        b.mkdir(rel)
        return b.path(rel)
    b.copy(template, rel, f"a valid {task} run directory (config.yaml, model.safetensors, ...)")
    what, how = fault.split(":")
    target = {"config": "config.yaml", "checkpoint": "model.safetensors", "tokenizer": "tokenizer_src.json"}[what]
    p = b.path(f"{rel}/{target}")
    original = p.read_bytes()
    p.unlink()
    if how == "missing":
        b.inputs[f"{rel}/{target}"] = "deleted"
        return b.path(rel)
    if how == "directory":
        b.mkdir(f"{rel}/{target}", "a directory (a file is expected)")
        return b.path(rel)
    if how == "bytes":
        data = junk
    elif how == "empty":
        data = b""
    elif how == "non-mapping":
        data = yaml.safe_dump(non_mapping).encode()
    elif how == "invalid-yaml":
        data = bad_yaml.encode()
    elif how == "invalid-values":
        cfg = yaml.safe_load(original)
        cfg[section][name] = value
        data = yaml.safe_dump(cfg, sort_keys=False).encode()
    elif how == "no-task":
        cfg = yaml.safe_load(original)
        cfg.pop("task")
        data = yaml.safe_dump(cfg, sort_keys=False).encode()
    elif how == "truncated":
        data = original[: int(len(original) * frac)]
    elif how == "other-model":
        from headsearch.training.rundir import save_checkpoint

        import torch

        save_checkpoint({"encoder.weight": torch.zeros(3, 5), "head.bias": torch.ones(7)}, p)
        b.inputs[f"{rel}/{target}"] = "a valid safetensors file of another model (keys encoder.weight, head.bias)"
        return b.path(rel)
    elif how == "json":
        data = b'{"version": "1.0", "model": {"type": "Nonsense"}}'
    else:
        raise AssertionError(how)
    note = f"{how}: " + (_show_bytes(data) if how not in ("truncated",) else f"the valid file cut to {frac:.0%} ({len(data)} bytes)")
    b.write(f"{rel}/{target}", data, note)
    return b.path(rel)


@pytest.mark.parametrize("task,fault", RUN_DIR_CASES, ids=[f"{t}-{f}" for t, f in RUN_DIR_CASES])
@examples(2)
@given(data=st.data())
def test_analyze_run_dir_junk(task, fault, data, run_templates, small_cifar, spa_file, cache):
    spec = data.draw(run_dir_fault(task, fault), label="fault")
    with box(cache) as b:
        run = place_run_dir(b, run_templates[task], task, spec)
        source = ["--data-dir", small_cifar] if task == VIT else ["--data-file", spa_file]
        b.invoke(["analyze", run, *source, "--samples", "8", "--no-ablation", "--device", "cpu"], limit=LOAD_LIMIT)
        b.assert_bad_input()


@PATHS
@given(content=st.binary(max_size=60), task=st.sampled_from([VIT, MT]))
def test_analyze_out_is_a_file(content, task, run_templates, small_cifar, spa_file, cache):
    with box(cache) as b:
        run = b.copy(run_templates[task], "run", f"a valid {task} run directory")
        out = b.write("taken", content)
        source = ["--data-dir", small_cifar] if task == VIT else ["--data-file", spa_file]
        b.invoke(["analyze", run, *source, "--out", out, "--samples", "8", "--no-ablation", "--device", "cpu"],
                 limit=LOAD_LIMIT)
        b.assert_bad_input()


ANALYZE_DATA_CASES = [(VIT, c) for c in CIFAR_CASES] + [(MT, k) for k in SPA_KINDS] + [(VIT, "a --data-file"), (MT, "a --data-dir")]


@pytest.mark.parametrize("task,case", ANALYZE_DATA_CASES, ids=[f"{t}-{c}" for t, c in ANALYZE_DATA_CASES])
@examples(1)
@given(data=st.data())
def test_analyze_data_junk(task, case, data, run_templates, small_cifar, spa_file, cache):
    if case.startswith("a --"):  # the other task's kind of data source (which exists)
        with box(cache) as b:
            run = b.copy(run_templates[task], "run", f"a valid {task} run directory")
            source = ["--data-file", spa_file] if task == VIT else ["--data-dir", small_cifar]
            b.invoke(["analyze", run, *source, "--samples", "8", "--no-ablation", "--device", "cpu"], limit=LOAD_LIMIT)
            b.assert_bad_input()
        return
    spec = data.draw(cifar_junk(case) if task == VIT else spa_junk(case), label="data")
    with box(cache) as b:
        run = b.copy(run_templates[task], "run", f"a valid {task} run directory")
        if task == VIT:
            source = ["--data-dir", place_cifar_junk(b, spec)]
        else:
            source = ["--data-file", place_spa_junk(b, spec)]
        b.invoke(["analyze", run, *source, "--samples", "8", "--no-ablation", "--device", "cpu"], limit=LOAD_LIMIT)
        b.assert_bad_input()


# -- report / export / dashboard -----------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command", ["report", "export", "dashboard"])
@pytest.mark.parametrize("kind", STORAGE_KINDS)
@examples(2)
@given(data=st.data())
def test_reading_commands_storage_junk(kind, command, data, cache):
    spec = data.draw(storage_junk(kind), label="storage")
    with box(cache) as b:
        url = place_storage_junk(b, spec)
        extra = {"report": ["--format", "json"], "export": ["--pareto", "--out", b.path("out")],
                 "dashboard": ["--port", free_port(), "--artifact-dir", b.path("artifacts")]}[command]
        # A dashboard that starts serving has accepted the storage: the watchdog ends it.
        b.invoke([command, "--storage", url, *extra], limit=FAST_LIMIT if command == "dashboard" else LOAD_LIMIT)
        b.assert_bad_input()


@PATHS
@given(content=st.binary(max_size=60),
       case=st.sampled_from(["report --plots", "export --out", "export --out below a file", "dashboard --artifact-dir"]))
def test_reading_commands_output_is_a_file(content, case, study_template, cache):
    with box(cache) as b:
        db = b.copy(study_template, "h.db", "a valid study database (study s, one complete trial)")
        f = b.write("taken", content)
        url = f"sqlite:///{db}"
        args = {
            "report --plots": ["report", "--storage", url, "--plots", f],
            "export --out": ["export", "--storage", url, "--trial", "0", "--out", f],
            "export --out below a file": ["export", "--storage", url, "--trial", "0", "--out", f / "configs"],
            "dashboard --artifact-dir": ["dashboard", "--storage", url, "--port", free_port(), "--artifact-dir", f],
        }[case]
        b.invoke(args, limit=LOAD_LIMIT)
        b.assert_bad_input()


@PATHS
@given(data=st.data())
def test_export_of_a_trial_whose_config_no_longer_resolves(data, study_template, cache):
    """A trial's recorded config that is invalid (edited storage, older version): refused, no --out."""

    task, section, name = data.draw(st.sampled_from([c for c in FIELD_CASES if c[0] == VIT and c[1] != "run"]), label="field")
    value = data.draw(field_strategy(task, section, name), label=f"{section}.{name}")
    with box(cache) as b:
        db = b.copy(study_template, "h.db", "a valid study database")
        url = f"sqlite:///{db}"
        con = sqlite3.connect(db)
        try:
            (attr_id, text), = con.execute("SELECT trial_user_attribute_id, value_json FROM trial_user_attributes"
                                           " WHERE key = 'config'").fetchall()
            cfg = json.loads(text)
            cfg[section][name] = value
            con.execute("UPDATE trial_user_attributes SET value_json = ? WHERE trial_user_attribute_id = ?",
                        (json.dumps(cfg), attr_id))
            con.commit()
        finally:
            con.close()
        b.inputs["h.db"] += f"; trial 0's recorded config has {section}.{name} = {value!r}"
        b.invoke(["export", "--storage", url, "--trial", "0", "--out", b.path("out")])
        b.assert_bad_input()


# -- unreadable files (chmod 000): meaningful only when not running as root ----------------------------------

UNREADABLE = ["train --config", "train --data-file", "run --space", "analyze config.yaml", "analyze model.safetensors"]


@pytest.mark.parametrize("case", UNREADABLE)
def test_unreadable_file(case, run_templates, cifar_dir, spa_file, cache):
    with box(cache) as b:
        if case == "train --config":
            p = b.write_yaml("config.yaml", VIT_BASE)
            args = ["train", "--task", VIT, "--config", p, "--data-dir", cifar_dir, "--out", b.path("out"), "--device", "cpu"]
        elif case == "train --data-file":
            p = b.copy(spa_file, "spa.txt", "a copy of spa.txt")
            args = ["train", "--task", MT, "--preset", "tiny", "--data-file", p, "--out", b.path("out"), "--device", "cpu"]
        elif case == "run --space":
            p = b.write_yaml("space.yaml", VIT_SPACE)
            args = run_args(VIT, b, p, cifar_dir, "--trials", "1")
        else:
            run = b.copy(run_templates[VIT], "run", "a valid run directory")
            p = run / ("config.yaml" if "config" in case else "model.safetensors")
            args = ["analyze", run, "--data-dir", cifar_dir, "--samples", "8", "--no-ablation", "--device", "cpu"]
        os.chmod(p, 0)
        key = p.relative_to(b.root).as_posix()
        b.inputs[key] = b.inputs.get(key, "the valid file") + " (chmod 000)"
        if os.access(p, os.R_OK):
            pytest.skip("running as root: chmod 000 does not stop reading, so the file is not unreadable")
        b.invoke(args, limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


# ------------------------------------------------------------------------------------------------ 3. search settings

def _not_known(known):
    return words(exclude=known, empty=False)


@st.composite
def bad_setting(draw, name: str):
    """Extra `run` flags (a list), each set parsing but invalid."""
    from headsearch.search.pruning import pruner_names
    from headsearch.search.study import SAMPLERS

    if name == "trials":
        return ["--trials", draw(st.integers(-10**6, 0))]
    if name == "workers":
        return ["--workers", draw(st.integers(-100, 0))]
    if name == "trials-per-gpu":
        return ["--trials-per-gpu", draw(st.integers(-100, 0))]
    if name == "workers and trials-per-gpu":
        return ["--workers", draw(st.integers(1, 3)), "--trials-per-gpu", draw(st.integers(1, 3))]
    if name == "timeout":
        return [f"--timeout={draw(st.one_of(below(0, False), NONFINITE.filter(lambda x: x != math.inf)))!r}"]
    if name == "sampler":
        return ["--sampler", draw(_not_known(SAMPLERS))]
    if name == "pruner":
        return ["--pruner", draw(_not_known(pruner_names()))]
    if name == "objectives":
        known = ("accuracy", "loss", "time", "epochs", "params")
        names = draw(st.lists(st.sampled_from(known), max_size=2))
        bad = draw(st.one_of(_not_known(known + ("seconds", "epoch")), st.sampled_from(known).map(lambda k: ("dup", k))))
        if isinstance(bad, tuple):
            names += [bad[1], bad[1]]
        else:
            names.insert(draw(st.integers(0, len(names))), bad)
        return ["--objectives", ",".join(names)]
    if name == "pruner-startup":
        return ["--pruner-startup", draw(st.integers(-10**6, -1))]
    if name == "pruner-warmup":
        return ["--pruner-warmup", draw(st.integers(-10**6, -1))]
    if name == "pruner-min-epochs":
        return ["--pruner-min-epochs", draw(st.one_of(st.integers(-10**6, 0).map(str), _not_known(("auto",))))]
    if name == "pruner-noise-margin":
        return [f"--pruner-noise-margin={draw(st.one_of(below(0, False), NONFINITE))!r}"]
    if name == "pruner-noise":
        return [f"--pruner-noise={draw(st.one_of(below(0, False), NONFINITE))!r}"]
    if name == "pruner-reduction-factor":
        return ["--pruner-reduction-factor", draw(st.integers(-10**6, 1))]
    if name == "heartbeat":
        return ["--heartbeat", draw(st.integers(-10**6, -1))]
    if name == "track-diversity":
        return ["--track-diversity", draw(st.integers(-10**6, -1))]
    if name == "epochs":
        return ["--epochs", draw(st.integers(-10**6, 0))]
    if name == "seed":
        return ["--seed", draw(st.integers(-10**6, -1))]
    if name == "compile":
        from headsearch.config import COMPILE_MODES

        return ["--compile", draw(_not_known(COMPILE_MODES))]
    if name == "preset":
        return ["--preset", draw(_not_known(("tiny",)))]
    if name == "task":
        return ["--task", draw(_not_known((VIT, MT)))]
    raise AssertionError(name)


SETTINGS = ["trials", "workers", "trials-per-gpu", "workers and trials-per-gpu", "timeout", "sampler", "pruner",
            "objectives", "pruner-startup", "pruner-warmup", "pruner-min-epochs", "pruner-reduction-factor",
            "pruner-noise-margin", "pruner-noise", "heartbeat",
            "track-diversity", "epochs", "seed", "compile", "preset", "task"]


def _override(args: list, extra: list) -> list:
    """Replace flags of `args` that `extra` sets again (e.g. --trials, --epochs, --preset, --task). `extra` is flags
    with their values (`--flag VALUE`, or `--flag=VALUE` in one item): only a flag's position is read as a flag, so
    a drawn value that looks like one (`--sampler --task`) does not remove the real `--task`."""
    args, i = list(args), 0
    while i < len(extra):
        flag = extra[i]
        if "=" in flag:
            i += 1
            continue
        if flag in args:
            j = args.index(flag)
            del args[j:j + 2]
        i += 2
    return args + extra


@pytest.mark.parametrize("name", SETTINGS)
@LOADING
@given(data=st.data())
def test_run_bad_setting(name, data, cifar_dir, cache):
    extra = data.draw(bad_setting(name), label="flags")
    with box(cache) as b:
        space = b.write_yaml("space.yaml", VIT_SPACE)
        args = _override(run_args(VIT, b, space, cifar_dir, "--trials", "1"), extra)
        b.invoke(args, limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


@st.composite
def all_trials_invalid_space(draw):
    """Spaces that parse, but from which no valid architecture can be drawn: every trial would be rejected."""
    kind = draw(st.sampled_from(["heads divide nothing", "ranges all invalid", "range bounds all invalid"]))
    space = copy.deepcopy(VIT_SPACE)
    if kind == "heads divide nothing":  # the default d_model is 48
        space["schedule"] = {"families": draw(st.lists(st.sampled_from(["uniform", "halving", "doubling", "free"]),
                                                        min_size=1, max_size=4, unique=True)),
                             "heads": draw(st.lists(st.sampled_from([5, 7, 9, 10, 11, 13, 14, 15, 18, 20, 96]),
                                                    min_size=1, max_size=3, unique=True))}
        if "halving" in space["schedule"]["families"] or "doubling" in space["schedule"]["families"]:
            space["schedule"]["min_heads"] = min(space["schedule"]["heads"])
    elif kind == "ranges all invalid":
        field, values = draw(st.sampled_from([
            ("lr", st.lists(below(0, True), min_size=1, max_size=3)),
            ("dropout", st.lists(st.floats(1, 10), min_size=1, max_size=3)),
            ("epochs", st.lists(st.integers(-5, 0), min_size=1, max_size=3)),
            ("batch_size", st.lists(st.integers(-5, 0), min_size=1, max_size=3)),
            ("activation", st.lists(_not_known(("gelu", "relu")), min_size=1, max_size=2)),
            ("patch_size", st.lists(st.sampled_from([3, 5, 6, 7, 9]), min_size=1, max_size=3)),
        ]))
        space["ranges"] = {field: draw(values)}
    else:
        field, low, high = draw(st.sampled_from([("lr", -2.0, -1.0), ("dropout", 1.0, 2.0), ("epochs", -5, 0),
                                                 ("label_smoothing", 1.0, 3.0)]))
        space["ranges"] = {field: {"low": low, "high": high}}
    return kind, space


@examples(8)
@given(spec=all_trials_invalid_space())
def test_run_space_whose_every_trial_is_invalid(spec, cifar_dir, cache):
    kind, space = spec
    with box(cache) as b:
        path = b.write_yaml("space.yaml", space)
        b.invoke(run_args(VIT, b, path, cifar_dir, "--trials", "2"), limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


# ------------------------------------------------------------------------------------------------ 4. devices

def _not_a_device_here(s: str) -> bool:
    import re

    return s.strip().lower() not in ("auto", "cpu") and not re.fullmatch(r"cpu:\d+", s.strip())


DEVICES = ["foo", "cuda", "cuda:7", "cuda:0", "gpu", "mps", "meta", "xpu", "CUDA", "cuda:x", "cuda:-1", "", " ",
           "cpu,cuda", "tpu"]
DEVICE_COMMANDS = ["train vit", "train mt", "run", "analyze"]
RANDOM_DEVICES = st.text(string.ascii_lowercase + ":0123456789", min_size=1, max_size=8).filter(_not_a_device_here)


def check_device(device: str, command: str, run_templates, data_dir: Path, spa_file: Path, cache: Path) -> None:
    import torch

    if torch.cuda.is_available() and device.strip().lower().startswith("cuda") and device not in ("cuda:7", "cuda:x", "cuda:-1"):
        pytest.skip("this machine has a GPU")
    with box(cache) as b:
        if command.startswith("train"):
            task = VIT if command == "train vit" else MT
            config = b.write_yaml("config.yaml", BASES[task])
            args = train_args(task, b, data_dir, spa_file, "--config", config)
        elif command == "run":
            space = b.write_yaml("space.yaml", VIT_SPACE)
            args = run_args(VIT, b, space, data_dir, "--trials", "1")
        else:
            run = b.copy(run_templates[VIT], "run", "a valid run directory")
            args = ["analyze", run, "--data-dir", data_dir, "--samples", "8", "--no-ablation"]
        if "--device" in args:
            j = args.index("--device")
            del args[j:j + 2]
        b.invoke(args + ["--device", device], limit=LOAD_LIMIT)
        b.assert_bad_input()
        assert_no_study(b)


@pytest.mark.parametrize("command", DEVICE_COMMANDS)
@pytest.mark.parametrize("device", DEVICES)
def test_device_that_is_not_here(device, command, run_templates, small_cifar, spa_file, cache):
    """Devices that do not exist on this (GPU-less, Linux) machine, or are no device at all."""
    check_device(device, command, run_templates, small_cifar, spa_file, cache)


@examples(12)
@given(device=RANDOM_DEVICES, command=st.sampled_from(DEVICE_COMMANDS))
def test_random_device_strings(device, command, run_templates, small_cifar, spa_file, cache):
    check_device(device, command, run_templates, small_cifar, spa_file, cache)


# ------------------------------------------------------------------------------------------------ 5. other flags

@examples(20)
@given(data=st.data())
def test_other_flags_that_parse_but_are_invalid(data, run_templates, study_template, cifar_dir, cache):
    case = data.draw(st.sampled_from(["analyze --samples", "analyze --format", "report --format", "export selectors",
                                      "export --trial", "export --best", "dashboard --port", "report --study",
                                      "export --study"]), label="case")
    with box(cache) as b:
        db = b.copy(study_template, "h.db", "a valid study database (study s, one complete trial 0)")
        url = f"sqlite:///{db}"
        run = b.copy(run_templates[VIT], "run", "a valid run directory")
        analyze = ["analyze", run, "--data-dir", cifar_dir, "--no-ablation", "--device", "cpu"]
        out = ["--out", b.path("out")]
        if case == "analyze --samples":
            args = analyze + ["--samples", data.draw(st.integers(-10**6, 0))]
        elif case == "analyze --format":
            args = analyze + ["--samples", "8", "--format", data.draw(_not_known(("table", "json")))]
        elif case == "report --format":
            args = ["report", "--storage", url, "--format", data.draw(_not_known(("table", "json", "csv")))]
        elif case == "export selectors":
            sel = data.draw(st.sampled_from([[], ["--trial", "0", "--pareto"], ["--pareto", "--best", "accuracy"],
                                             ["--trial", "0", "--best", "time"]]))
            args = ["export", "--storage", url, *sel, *out]
        elif case == "export --trial":
            args = ["export", "--storage", url, "--trial", data.draw(st.one_of(st.integers(-10**6, -1), st.integers(1, 10**6))), *out]
        elif case == "export --best":
            args = ["export", "--storage", url, "--best", data.draw(_not_known(("accuracy", "loss", "time", "epochs", "params"))), *out]
        elif case == "dashboard --port":
            args = ["dashboard", "--storage", url, "--port", data.draw(st.one_of(st.integers(-10**6, 0), st.integers(65536, 10**7)))]
        else:
            command = case.split()[0]
            args = [command, "--storage", url, "--study", data.draw(_not_known(("s",)))] + (["--pareto", *out] if command == "export" else [])
        b.invoke(args, limit=LOAD_LIMIT)
        b.assert_bad_input()


# ------------------------------------------------------------------------------------------------ 6. names and output paths

# Issue 38, item 5: every name and output path is checked before anything loads, trains or is written. Each row
# is one bad argument of one command: (the command's arguments, given the Box; a fragment of its error line;
# the folders to make read-only first). The rest of each command is valid and cheap, so a check that came late
# would load, train (the watchdog's SLOW), or write (what the Box finds left behind). A study database is
# copied in where a command reads one: `study_db`, made with Optuna alone (no training). Existing files and
# folders where the other kind goes are also in the tables above (test_train_out_taken, test_run_root_is_a_file,
# test_reading_commands_output_is_a_file, the storage tables).

@pytest.fixture(scope="module")
def study_db(tmp_path_factory) -> Path:
    """A storage holding study "s" (one complete trial, no run behind it): made by Optuna, in a second."""
    import optuna

    db = tmp_path_factory.mktemp("study-db") / "h.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}", directions=["maximize", "minimize"])
    study.add_trial(optuna.trial.create_trial(values=[0.5, 1.0], user_attrs={"config": copy.deepcopy(VIT_BASE)}))
    return db


def _spaced(b: Box) -> Path:
    """A space of two cheap architectures (a table needs two)."""
    return b.write_yaml("space.yaml", {**VIT_SPACE, "skip": ["none", "output"]})


def _run(b: Box, data: Path, *extra) -> list:
    return _override(run_args(VIT, b, _spaced(b), data, "--trials", "1"), list(extra))


# VIT_BASE's train and data sections as --set flags (compare and table take a config's architecture only).
CHEAP_SETS = [x for section in ("train", "data") for k, v in VIT_BASE[section].items() for x in ("--set", f"{section}.{k}={v}")]


def _compare(b: Box, data: Path, *extra) -> list:
    one = b.write_yaml("a.yaml", VIT_BASE)
    two = b.write_yaml("b.yaml", {**VIT_BASE, "arch": {"enc_heads": [2, 2, 2, 2]}})
    args = ["compare", one, two, "--task", VIT, "--seeds", "2", "--data-dir", data, "--storage", f"sqlite:///{b.path('h.db')}",
            "--run-root", b.path("runs"), "--device", "cpu", "--epochs", "1", *CHEAP_SETS]
    return _override(args, list(extra))


def _table(b: Box, data: Path, *extra) -> list:
    args = ["table", "--task", VIT, "--space", _spaced(b), "--preset", "tiny", "--epochs", "1", "--seeds", "2",
            "--data-dir", data, "--storage", f"sqlite:///{b.path('h.db')}", "--run-root", b.path("runs"),
            "--out", b.path("table.json"), "--device", "cpu", *CHEAP_SETS]
    return _override(args, list(extra))


def _stored(b: Box, db: Path) -> str:
    return f"sqlite:///{b.copy(db, 'study.db', 'a study database (study s, one complete trial)')}"


def _file_in(b: Box, rel: str = "taken") -> Path:
    return b.write(rel, "x")


# name -> (args(b, data, db), fragment of the error line, folders made read-only)
NAMES_AND_PATHS = {
    # a study the command creates: its run directories go in RUN_ROOT/<study>/
    "run --study ''": (lambda b, d, db: _run(b, d, "--study", ""), "--study '' is empty", ()),
    "run --study of spaces": (lambda b, d, db: _run(b, d, "--study", "   "), "is empty", ()),
    "run --study ' s'": (lambda b, d, db: _run(b, d, "--study", " s"), "begins or ends with a space", ()),
    "run --study a/b": (lambda b, d, db: _run(b, d, "--study", "a/b"), "holds a slash", ()),
    "run --study ..": (lambda b, d, db: _run(b, d, "--study", ".."), "is not a folder name", ()),
    "run --study with a newline": (lambda b, d, db: _run(b, d, "--study", "a\nb"), "control character", ()),
    "run --study too long": (lambda b, d, db: _run(b, d, "--study", "s" * 256), "too long for a folder name", ()),
    "run --study a file in --run-root": (lambda b, d, db: _file_in(b, "runs/s") and _run(b, d, "--study", "s"),
                                         "runs/s is a file", ()),
    "compare --study ''": (lambda b, d, db: _compare(b, d, "--study", ""), "--study '' is empty", ()),
    "compare --study a/b": (lambda b, d, db: _compare(b, d, "--study", "a/b"), "holds a slash", ()),
    "table --study ''": (lambda b, d, db: _table(b, d, "--study", ""), "--study '' is empty", ()),
    "table --study ..": (lambda b, d, db: _table(b, d, "--study", ".."), "is not a folder name", ()),
    # a study the command reads
    "report --study ''": (lambda b, d, db: ["report", "--storage", _stored(b, db), "--study", ""], "--study '' is empty", ()),
    "export --study ''": (lambda b, d, db: ["export", "--storage", _stored(b, db), "--study", "", "--pareto", "--out", b.path("out")],
                          "--study '' is empty", ()),
    "dashboard --study ''": (lambda b, d, db: ["dashboard", "--storage", _stored(b, db), "--study", "", "--port", free_port()],
                             "--study '' is empty", ()),
    # storages of a study the command creates: checked before the data loads
    "run --storage ''": (lambda b, d, db: _run(b, d, "--storage", ""), "--storage '' is empty", ()),
    "run --storage sqlite below a file": (lambda b, d, db: _run(b, d, "--storage", f"sqlite:///{_file_in(b)}/h.db"),
                                          "which is a file", ()),
    "run --storage journal below a file": (lambda b, d, db: _run(b, d, "--storage", f"journal:{_file_in(b)}/j.log"),
                                           "which is a file", ()),
    "run --storage in a read-only folder": (lambda b, d, db: _run(b, d, "--storage", f"sqlite:///{b.mkdir('ro')}/h.db"),
                                            "is not writable", ("ro",)),
    "compare --storage a folder": (lambda b, d, db: _compare(b, d, "--storage", f"sqlite:///{b.mkdir('db')}"),
                                   "is a folder, not a database file", ()),
    "compare --storage journal below a file": (lambda b, d, db: _compare(b, d, "--storage", f"journal:{_file_in(b)}/j.log"),
                                               "which is a file", ()),
    "table --storage journal a folder": (lambda b, d, db: _table(b, d, "--storage", f"journal:{b.mkdir('journal')}"),
                                         "is a folder, not a journal file", ()),
    "table --storage sqlite junk": (lambda b, d, db: _table(b, d, "--storage", f"sqlite:///{b.write('junk.db', b'junk')}"),
                                    "is not a SQLite database", ()),
    # output folders and files
    "train --out in a read-only folder": (lambda b, d, db: train_args(VIT, b, d, d, "--config", b.write_yaml("c.yaml", VIT_BASE),
                                                                      "--out", b.mkdir("ro") / "run"), "is not writable", ("ro",)),
    "run --run-root in a read-only folder": (lambda b, d, db: _run(b, d, "--run-root", b.mkdir("ro") / "runs"),
                                             "is not writable", ("ro",)),
    "run --tensorboard in a read-only folder": (lambda b, d, db: _run(b, d, "--tensorboard", b.mkdir("ro") / "tb"),
                                                "is not writable", ("ro",)),
    "compare --out a file": (lambda b, d, db: _compare(b, d, "--out", _file_in(b)), "--out", ()),
    "compare --out below a file": (lambda b, d, db: _compare(b, d, "--out", _file_in(b) / "cmp"), "which is a file", ()),
    "compare --out in a read-only folder": (lambda b, d, db: _compare(b, d, "--out", b.mkdir("ro") / "cmp"), "is not writable", ("ro",)),
    "compare --run-root a file": (lambda b, d, db: _compare(b, d, "--run-root", _file_in(b)), "--run-root", ()),
    "table --out a folder": (lambda b, d, db: _table(b, d, "--out", b.mkdir("out")), "is a folder: give the path of a file", ()),
    "table --out below a file": (lambda b, d, db: _table(b, d, "--out", _file_in(b) / "table.json"), "which is a file", ()),
    "table --out in a read-only folder": (lambda b, d, db: _table(b, d, "--out", b.mkdir("ro") / "table.json"),
                                          "is not writable", ("ro",)),
    "table --run-root below a file": (lambda b, d, db: _table(b, d, "--run-root", _file_in(b) / "runs"), "which is a file", ()),
    "report --plots below a file": (lambda b, d, db: ["report", "--storage", _stored(b, db), "--plots", _file_in(b) / "plots"],
                                    "which is a file", ()),
    "report --plots in a read-only folder": (lambda b, d, db: ["report", "--storage", _stored(b, db), "--plots", b.mkdir("ro") / "p"],
                                             "is not writable", ("ro",)),
    "report --plots, the artifact folder a file": (
        lambda b, d, db: _file_in(b, "study-artifacts") and ["report", "--storage", _stored(b, db), "--plots", b.path("plots")],
        "study-artifacts, beside the storage's file, and it is a file", ()),
    "report --plots with --robust": (lambda b, d, db: ["report", "--storage", _stored(b, db), "--robust", "2", "--plots", b.path("p"),
                                                       "--run-root", b.path("runs"), "--device", "cpu"], "--plots does not go with --robust", ()),
    "export --out in a read-only folder": (lambda b, d, db: ["export", "--storage", _stored(b, db), "--pareto", "--out", b.mkdir("ro") / "o"],
                                           "is not writable", ("ro",)),
    "dashboard --artifact-dir below a file": (lambda b, d, db: ["dashboard", "--storage", _stored(b, db), "--port", free_port(),
                                                                "--artifact-dir", _file_in(b) / "a"], "which is a file", ()),
    "dashboard, the artifact folder a file": (
        lambda b, d, db: _file_in(b, "study-artifacts") and ["dashboard", "--storage", _stored(b, db), "--port", free_port()],
        "pass --artifact-dir", ()),
    "analyze --out below a file": (lambda b, d, db: ["analyze", b.mkdir("run"), "--data-dir", d, "--out", _file_in(b) / "a",
                                                     "--device", "cpu"], "which is a file", ()),
    "analyze --out in a read-only folder": (lambda b, d, db: ["analyze", b.mkdir("run"), "--data-dir", d, "--out", b.mkdir("ro") / "a",
                                                              "--device", "cpu"], "is not writable", ("ro",)),
}


def read_only(monkeypatch, folders: list[Path]) -> None:
    """`folders` read-only to headsearch's checks, whoever runs the tests (root writes anywhere): os.access
    says no to writing there. The folders themselves stay writable, so the Box cleans up as always."""
    real = os.access
    shut = [f.resolve() for f in folders]

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path).resolve() in shut:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


@pytest.mark.parametrize("name", list(NAMES_AND_PATHS))
def test_names_and_output_paths_are_checked_first(name, cifar_dir, study_db, cache, monkeypatch):
    make, fragment, shut = NAMES_AND_PATHS[name]
    with box(cache) as b:
        args = make(b, cifar_dir, study_db)  # the real data: a comparison's checks read it whole
        read_only(monkeypatch, [b.path(f) for f in shut])
        b.invoke(args)
        b.assert_bad_input()
        line = b.result.output.strip()
        assert fragment in line, f"the error line does not say {fragment!r}" + b.describe()
        assert_no_study(b)
