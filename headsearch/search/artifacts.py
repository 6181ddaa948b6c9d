"""Files attached to a study as Optuna artifacts, so that optuna-dashboard shows them.

- `upload_plots`: the plots of `headsearch report --plots`, attached to the study.
- `upload_to_trial`: the figures and analysis.json of `headsearch analyze` on a search trial's run
  directory, found through the `study.json` link the search writes there (`write_trial_link`). The link's storage
  URL has its password hidden; `trial_storage_url` finds the storage again.

Artifacts are stored in a folder beside the database (`default_artifact_dir`, which asks the storage's row
in search/storage/schemes.py), where `headsearch dashboard` looks for them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

from headsearch.errors import HeadsearchError
from headsearch.io import HIDDEN, hide_passwords, write_atomic
from headsearch.search.settings import STORAGE_ENV
from headsearch.search.storage import absolute_url, artifact_dir, normalize_url, open_storage
from headsearch.search.study import StudyStorage

TRIAL_LINK = "study.json"  # in a trial's run directory: {"storage", "study", "trial"}


def default_artifact_dir(storage_url: str) -> Path:
    """Beside the database: sqlite:///runs/x.db -> runs/x-artifacts (journal files alike); else ./headsearch-artifacts.
    The storage's row decides (`StorageScheme.artifact_dir`, search/storage/schemes.py)."""
    return artifact_dir(storage_url)


# Optuna's key prefix for an artifact's record among a study's system attributes: its storage format (the value of
# the private optuna.artifacts._upload.ARTIFACTS_ATTR_PREFIX, which optuna-dashboard writes as well).
_ARTIFACT_RECORD_PREFIX = "artifacts:"


def _existing_artifacts(study, stored: StudyStorage) -> list[dict[str, Any]]:
    """The study's artifact metas (artifact_id, filename, mimetype, encoding), as Optuna's public
    `optuna.artifacts.get_all_artifact_meta` lists them.

    The one shim: optuna-dashboard marks an artifact deleted there with a JSON null record, on which
    `get_all_artifact_meta` raises (Optuna 4.0 to 5.0). Then the records are read here instead, through the
    storage's public `get_study_system_attrs` (`stored`: the storage the study was opened on), skipping the nulls.
    """
    from optuna.artifacts import get_all_artifact_meta

    try:
        return [dataclasses.asdict(m) for m in get_all_artifact_meta(study)]
    except (TypeError, KeyError, ValueError):  # a deleted artifact's null record
        pass
    records = [json.loads(value) if isinstance(value, str) else value
               for key, value in stored.system_attrs().items() if key.startswith(_ARTIFACT_RECORD_PREFIX)]
    return [meta for meta in records if meta]


def upload_plots(study, paths: Sequence[Path], artifact_dir: Path, stored: StudyStorage) -> list[str]:
    """Upload each file as an artifact of the study (`stored`: the storage it was opened on); return the
    artifact ids.

    A file identical to an artifact of the same name already in the store is not uploaded again
    (its id is returned), so running `report --plots` twice on an unchanged study adds nothing.
    """
    from optuna.artifacts import FileSystemArtifactStore, upload_artifact

    artifact_dir = Path(artifact_dir)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    store = FileSystemArtifactStore(str(artifact_dir))
    existing = _existing_artifacts(study, stored)
    ids = []
    for path in paths:
        path = Path(path)
        data = path.read_bytes()
        same = None
        for meta in (m for m in existing if m.get("filename") == path.name):
            try:
                with store.open_reader(meta["artifact_id"]) as f:
                    if f.read() == data:
                        same = meta["artifact_id"]
                        break
            except Exception:  # missing from this store: upload again
                continue
        if same is None:
            same = upload_artifact(artifact_store=store, file_path=str(path), study_or_trial=study)
        ids.append(same)
    return ids


def write_trial_link(run_dir: Path, storage_url: str, study_name: str, number: int) -> None:
    """Record in a trial's run directory which study and trial it belongs to (read by `upload_to_trial`). The
    storage's password is not written (`io.hide_passwords`): run directories are shared and uploaded."""
    write_atomic(Path(run_dir) / TRIAL_LINK, json.dumps(
        {"storage": hide_passwords(absolute_url(storage_url)), "study": study_name, "trial": number}) + "\n")


# What `hide_passwords` leaves of a password: `user:***@` after the scheme, a `password=***` query parameter.
_HIDDEN_USERINFO = re.compile(rf"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#@]*?):{re.escape(HIDDEN)}@")
_HIDDEN_QUERY = re.compile(rf"(?<=[?&])(?:password|passwd|pwd)={re.escape(HIDDEN)}(?:&|(?=#|$))", re.IGNORECASE)


def without_hidden_password(url: str) -> str:
    """`url` (as `hide_passwords` showed it) with no password at all: `user:***@host` becomes `user@host`, a
    `password=***` query parameter goes. Unchanged, character for character, when it hid none (string edits,
    not urllib's round trip, which turns sqlite:////abs/path into sqlite://abs/path)."""
    bare = _HIDDEN_QUERY.sub("", _HIDDEN_USERINFO.sub(r"\g<head>@", url))
    return url if bare == url else re.sub(r"[?&](?=#|$)", "", bare)  # a query left empty


def trial_storage_url(recorded: str, given: str | None = None) -> str:
    """The URL that opens the storage a trial's study.json records (`recorded`, its password hidden): `recorded`
    when it hid none; else `given` (`analyze --storage`, else $OPTUNA_STORAGE) when it is the same storage (its
    URL, password hidden, is `recorded`); else `recorded` without a password, which the driver completes from its
    own files (PostgreSQL's ~/.pgpass or $PGPASSFILE, MySQL's option file named by `?read_default_file=`)."""
    bare = without_hidden_password(recorded)
    if bare == recorded:
        return recorded
    for candidate in (given, os.environ.get(STORAGE_ENV)):
        if candidate and normalize_url(hide_passwords(absolute_url(candidate))) == normalize_url(recorded):
            return candidate
    return bare


def _open_trial_storage(info_path: Path, recorded: str, given: str | None):
    """`open_storage` on `trial_storage_url`; a storage that does not open without the password study.json hid is
    one line saying how to give it."""
    url = trial_storage_url(recorded, given)
    try:
        return open_storage(url, heartbeat=None)
    except HeadsearchError as e:
        if url != without_hidden_password(recorded):
            raise
        raise HeadsearchError(
            f"{info_path} names storage {recorded}, its password hidden, and it does not open without one ({e}): pass"
            f" the full URL as --storage (or ${STORAGE_ENV}), or give the driver the password (~/.pgpass or"
            " $PGPASSFILE for PostgreSQL, an option file as ?read_default_file= for MySQL)") from None


def upload_to_trial(run_dir: Path, paths: Sequence[Path], storage: str | None = None) -> str | None:
    """When the run is a search trial (study.json beside it), attach the files to its study as artifacts;
    return where they went ("<study> trial <N> (<artifact folder>)"), or None for a run of no study.
    `storage`: the study's storage URL with its password, for a study.json that hid it (`trial_storage_url`).

    Optuna keeps artifact records in a trial's attributes, which are frozen once the trial finished,
    so they go to the study, named `trial<N>-<file>`.
    """
    info_path = Path(run_dir) / TRIAL_LINK
    if not info_path.is_file():
        return None
    import optuna
    from optuna.artifacts import FileSystemArtifactStore, upload_artifact

    info = json.loads(info_path.read_text())
    storage = _open_trial_storage(info_path, info["storage"], storage)
    study = optuna.load_study(study_name=info["study"], storage=storage)
    store_dir = default_artifact_dir(info["storage"])
    store_dir.mkdir(parents=True, exist_ok=True)
    store = FileSystemArtifactStore(str(store_dir))
    with tempfile.TemporaryDirectory() as tmp:
        for p in paths:
            named = Path(tmp) / f"trial{info['trial']}-{Path(p).name}"
            shutil.copyfile(p, named)
            upload_artifact(artifact_store=store, file_path=str(named), study_or_trial=study, storage=storage)
    return f"{info['study']} trial {info['trial']} ({store_dir})"
