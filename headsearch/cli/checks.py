"""Checks of the names and output paths commands take, made at the top of each command: before any data
is loaded, anything trains or anything is written (a command must not train for minutes, then fail on
where its output goes). Each one ends the command with `fail`'s one line (exit code 2) when its
argument cannot work. They look at the file system only: nothing is created.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from headsearch.cli.common import fail


def check_new_study_name(name: Optional[str], flag: str = "--study") -> None:
    """A study the command creates (or resumes): its run directories go in RUN_ROOT/<name>/."""
    from headsearch.search.settings import study_name_problem

    if name is not None and (problem := study_name_problem(name)):
        fail(f"{flag} {name!r} {problem}")


def check_study_to_read(name: Optional[str], flag: str = "--study") -> None:
    """A study the command reads: any name Optuna holds, but not an empty one."""
    if name is not None and not name.strip():
        fail(f"{flag} {name!r} is empty: give the name of a study in the storage (`headsearch report --format json`"
             " names them), or leave --study out when the storage holds one study")


def check_output_folder(path: Optional[Path], flag: str, purpose: str) -> None:
    """A folder the command writes into (made, with its parents, when missing)."""
    from headsearch.io import folder_problem

    if path is not None and (problem := folder_problem(Path(path), purpose)):
        fail(f"{flag} {path}{problem}")


def check_output_file(path: Optional[Path], flag: str, purpose: str) -> None:
    """A file the command writes (made, with its folders, when missing; replaced whole when there)."""
    from headsearch.io import file_problem

    if path is not None and (problem := file_problem(Path(path), purpose)):
        fail(f"{flag} {path}{problem}")


def check_artifact_folder(storage: str, artifact_dir: Optional[Path] = None, flag: Optional[str] = None,
                          writes: bool = True) -> None:
    """Where a study's artifacts go: `artifact_dir` (given as `flag`), else the folder beside the storage's
    file. It must be (or become) a folder; one the command `writes` into must be writable too."""
    from headsearch.io import folder_problem
    from headsearch.search.artifacts import default_artifact_dir

    folder = Path(artifact_dir) if artifact_dir is not None else default_artifact_dir(storage)
    problem = folder_problem(folder, "the study's artifacts")
    if problem is None or (not writes and "not writable" in problem):
        return
    if artifact_dir is not None:
        fail(f"{flag} {folder}{problem}")
    from headsearch.search.storage import journal_path, sqlite_path

    where = "beside the storage's file" if (sqlite_path(storage) or journal_path(storage)) else "in the working folder"
    advice = f"move it away or pass {flag} DIR" if flag else "move it away"
    if folder.exists() and not folder.is_dir():
        fail(f"the study's artifacts go in {folder}, {where}, and it is a file: {advice}")
    fail(f"the study's artifacts go in {folder}, {where}{problem}")


def check_new_storage(url: str) -> None:
    """The storage of a study the command creates: a storage URL, and for a file storage a file that can be
    (or is) the storage, in a folder that can hold it. What a database server holds is checked when it is
    opened; what a file holds (a SQLite database, an Optuna journal) is read here, before any data loads."""
    from headsearch.errors import HeadsearchError
    from headsearch.search.storage import (check_journal_file, check_sqlite_file, find_scheme, journal_path, known_urls,
                                           normalize_url, sqlite_path)

    if not url.strip():
        fail(f"--storage {url!r} is empty: use {known_urls()} (or leave --storage out for the default)")
    url = normalize_url(url)
    if find_scheme(url) is None:  # the table of storage schemes (search/storage/schemes.py), a plugin's included
        fail(f"storage {url!r} is not a storage URL: use {known_urls()}")
    journal = journal_path(url)
    path = journal if journal is not None else sqlite_path(url)
    if path is None:
        return  # a database server, Redis, or an in-memory SQLite database
    kind = "journal" if journal is not None else "database"
    if path.is_dir():
        fail(f"storage {url}: {path} is a folder, not a {kind} file: pass "
             + ("journal:FILE.log" if journal is not None else "sqlite:///FILE.db"))
    folder = path.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)  # the nearest that exists
    if existing.exists() and not existing.is_dir():
        fail(f"storage {url}: {path} is inside {existing}, which is a file: give a {kind} file in a folder")
    if journal is None and existing != folder:
        fail(f"storage {url}: the folder {folder} does not exist: create it or give a database file in another folder")
    # SQLite writes its journal, and headsearch its budget lock, beside the database; a journal file's lock too.
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"storage {url}: {existing} is not writable (the storage's lock files go beside {path.name}):"
             " give a file in another folder")
    try:
        if journal is not None:
            check_journal_file(url, path)
        else:
            check_sqlite_file(url, path)
    except HeadsearchError as e:
        fail(str(e))


# Options naming where a command writes. Typer turns an empty value into Path("."), the current folder, before
# a command sees it, so an empty one is caught on the raw command line (`refuse_empty_outputs`).
OUTPUT_FLAGS = ("--out", "--plots", "--run-root", "--tensorboard", "--artifact-dir")


def empty_output_flag(argv: list[str]) -> Optional[str]:
    """The first output option of `argv` given an empty value (`--out ""` or `--out=`), else None."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in OUTPUT_FLAGS:
            continue
        if (eq and not value.strip()) or (not eq and i + 1 < len(argv) and not argv[i + 1].strip()):
            return flag
    return None
