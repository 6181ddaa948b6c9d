"""Credentials stay secret (issue 50, item 7): a storage URL's password is shown as `***` wherever headsearch prints,
writes or records the URL, yet the storage stays usable (`analyze` finds it again from $OPTUNA_STORAGE or --storage).

The real run uses the shared PostgreSQL ($HEADSEARCH_TEST_PG), which trusts local connections: a URL carrying any
password connects, so a run whose URL holds one succeeds, and everything it left is searched for that password.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import optuna
import pytest
import yaml

from headsearch.errors import HeadsearchError
from headsearch.io import hide_passwords
from headsearch.search.artifacts import TRIAL_LINK, upload_to_trial, without_hidden_password, write_trial_link
from headsearch.search.notes import write_dashboard_notes
from headsearch.search.storage import budget_lock, open_storage, timings
from headsearch.search.study import StudyStorage
from test_search import load, run_cmd, space_dict, sub_env

PASSWORD = "s3cretPW"


def with_password(url: str, password: str = PASSWORD) -> str:
    """`url` with `password` after its user: postgresql://postgres:s3cretPW@127.0.0.1:5432/test."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.netloc.rpartition('@')[2]}"))


def unreachable(url: str) -> str:
    """The same URL on a port where nothing listens."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition(":")[0] + ":1"))


def files_holding(root: Path, secret: str) -> list[str]:
    """Every file under `root` (recursively, binary ones too) whose bytes hold `secret`."""
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.parametrize("url", ["postgresql://u:p%40ss@db:5432/study", "postgresql+psycopg2://u:pw@db/s",
                                 "mysql+pymysql://root:pw@127.0.0.1:3306/test", "redis://:pw@127.0.0.1:6379/0",
                                 "redis://default:pw@redis-host:6379", "postgresql://u:@db/s", "postgresql://u@db/s"])
def test_a_urls_password_is_shown_as_sqlalchemy_shows_it(url):
    from sqlalchemy.engine import make_url

    assert hide_passwords(url) == make_url(url).render_as_string(hide_password=True)
    assert hide_passwords(f"cannot open storage {url!r}: x") == f"cannot open storage {hide_passwords(url)!r}: x"


def test_passwords_in_queries_and_command_lines_are_hidden_too():
    assert hide_passwords("mysql://u@h/db?charset=utf8&passwd=pw") == "mysql://u@h/db?charset=utf8&passwd=***"
    assert hide_passwords("postgresql://u@h/db?password=pw&sslmode=require") == \
        "postgresql://u@h/db?password=***&sslmode=require"
    assert hide_passwords("host=h user=u password=pw dbname=d") == "host=h user=u password=*** dbname=d"
    assert hide_passwords("postgresql://u:a/b@c@h/db") == "postgresql://u:***@h/db"  # unescaped: hide more, not less
    unchanged = ["sqlite:////tmp/a@b/x.db", "journal:/tmp/x.log", "https://example.org/a:b@c", "mypassword=kept"]
    assert [hide_passwords(text) for text in unchanged] == unchanged
    assert hide_passwords("--storage=redis://:pw@h:6379") == "--storage=redis://:***@h:6379"


def test_a_hidden_password_is_dropped_for_the_driver_to_find_and_nothing_else_changes():
    assert without_hidden_password("postgresql+psycopg2://u:***@h:5432/db") == "postgresql+psycopg2://u@h:5432/db"
    assert without_hidden_password("redis://:***@h:6379/0") == "redis://@h:6379/0"
    assert without_hidden_password("mysql://u@h/db?password=***&charset=utf8") == "mysql://u@h/db?charset=utf8"
    assert without_hidden_password("mysql://u@h/db?charset=utf8&passwd=***") == "mysql://u@h/db?charset=utf8"
    for url in ("sqlite:////tmp/x.db", "sqlite:///x.db", "journal:/tmp/x.log", "postgresql://u@h/db?sslmode=require"):
        assert without_hidden_password(url) == url


@pytest.mark.processes
@pytest.mark.slow
def test_a_run_with_a_password_in_its_url_prints_writes_and_records_it_nowhere(tmp_path, pg_url, pg_study, spa_file,
                                                                              tiny_translation, tokenizer_cache, cli,
                                                                              optuna_dashboard):
    url = with_password(pg_url)
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(space_dict(tiny_translation, train={"epochs": 1}), sort_keys=False))
    runs = tmp_path / "runs"
    proc = subprocess.run(run_cmd(space, url, pg_study, 2, spa_file, runs, "--workers", 2, "--pruner", "none"),
                          cwd=tmp_path, env=sub_env(tokenizer_cache), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--storage {hide_passwords(url)}" in proc.stdout  # the "next:" line names the storage, masked
    assert PASSWORD not in proc.stdout + proc.stderr
    assert (runs / pg_study / "workers").is_dir() and list((runs / pg_study).glob("trial-*/command.txt"))
    assert files_holding(tmp_path, PASSWORD) == []  # command.txt, study.json, config.yaml, workers/*.log, ...

    study = load(url, pg_study)  # what the study records: its attributes, its trials', the dashboard's notes
    write_dashboard_notes(study)
    stored = StudyStorage(open_storage(url, heartbeat=None), pg_study)
    recorded = [study.user_attrs, stored.system_attrs(), *[(t.user_attrs, t.system_attrs) for t in study.trials]]
    assert PASSWORD not in json.dumps(recorded, default=str)

    common = ["--storage", url, "--study", pg_study]
    for args in (["report", *common], ["report", *common, "--format", "json"],
                 ["export", *common, "--pareto", "--out", tmp_path / "best"]):
        result = cli(args)
        assert result.exit_code == 0, result.output
        assert PASSWORD not in result.stdout + result.stderr
    assert hide_passwords(url) in cli(["report", *common]).stdout
    assert files_holding(tmp_path / "best", PASSWORD) == [] and list((tmp_path / "best").glob("trial-*.yaml"))

    # Failures: an unreachable server's one line, from the command and from the budget lock.
    bad = unreachable(url)
    for args in (["run", "--task", "translation-en-es", "--space", space, "--data-file", spa_file, "--trials", "1",
                  "--storage", bad, "--study", pg_study, "--run-root", tmp_path / "bad", "--device", "cpu"],
                 ["report", "--storage", bad, "--study", pg_study]):
        line = cli.error_line(cli(args), hide_passwords(bad))
        assert PASSWORD not in line
    line = cli.error_line(cli(["dashboard", "--storage", url, "--study", "no-such-study"]), hide_passwords(url))
    assert PASSWORD not in line
    assert files_holding(tmp_path, PASSWORD) == []


def test_the_storage_and_lock_errors_hide_the_password(redis_url, monkeypatch):
    monkeypatch.setattr(timings, "LOCK_RECONNECT", 1)  # the budget lock gives up on an unreachable database after 1 s
    for url in (unreachable(with_password(redis_url)), "postgresql+psycopg2://postgres:s3cretPW@127.0.0.1:1/test"):
        with pytest.raises(HeadsearchError) as opened:
            open_storage(url, heartbeat=None)
        assert PASSWORD not in str(opened.value) and hide_passwords(url) in str(opened.value)
        with pytest.raises(HeadsearchError) as locked:
            with budget_lock(url, "s"):
                pass
        assert PASSWORD not in str(locked.value) and "***" in str(locked.value)


def test_analyze_finds_the_storage_of_a_masked_study_json(tmp_path, pg_url, pg_study, monkeypatch):
    """study.json holds the URL with its password hidden; the upload opens the real one: $OPTUNA_STORAGE (or
    --storage) when it is the same storage, else the URL without a password (the driver's own: ~/.pgpass)."""
    url = with_password(pg_url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.create_study(study_name=pg_study, storage=open_storage(url, heartbeat=None))
    run_dir = tmp_path / "trial-00000"
    run_dir.mkdir()
    write_trial_link(run_dir, url, pg_study, 0)
    assert PASSWORD not in (run_dir / TRIAL_LINK).read_text()
    assert json.loads((run_dir / TRIAL_LINK).read_text())["storage"] == hide_passwords(url)
    figure = tmp_path / "figure.txt"
    figure.write_text("a figure")
    monkeypatch.chdir(tmp_path)  # the artifacts of a server's study go to ./headsearch-artifacts

    monkeypatch.setenv("OPTUNA_STORAGE", url)
    assert upload_to_trial(run_dir, [figure]) == f"{pg_study} trial 0 (headsearch-artifacts)"
    monkeypatch.delenv("OPTUNA_STORAGE")
    assert upload_to_trial(run_dir, [figure], storage=url)  # --storage
    assert upload_to_trial(run_dir, [figure])  # no password given: the driver's own (trusted here)
    names = [a.filename for a in optuna.artifacts.get_all_artifact_meta(load(url, pg_study))]
    assert "trial0-figure.txt" in names

    write_trial_link(run_dir, unreachable(url), pg_study, 0)  # a server that refuses without the password
    with pytest.raises(HeadsearchError) as refused:
        upload_to_trial(run_dir, [figure])
    message = str(refused.value)
    assert PASSWORD not in message and "--storage" in message and "OPTUNA_STORAGE" in message
    assert "pgpass" in message and "\n" not in message


@pytest.mark.server
@pytest.mark.processes
def test_the_dashboards_own_lines_hide_the_password(tmp_path, pg_url, pg_study, optuna_dashboard):
    url = with_password(pg_url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.create_study(study_name=pg_study, storage=open_storage(url, heartbeat=None))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "headsearch", "dashboard", "--storage", url, "--study", pg_study,
                             "--port", str(port), "--artifact-dir", str(tmp_path / "artifacts")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # until it serves
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
                time.sleep(0.3)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert f"storage {hide_passwords(url)}, artifacts in" in err
    assert PASSWORD not in out + err
    assert PASSWORD not in json.dumps(StudyStorage(open_storage(url, heartbeat=None), pg_study).system_attrs())


def test_a_run_directorys_command_line_hides_the_password(tmp_path):
    from headsearch.training.rundir import create_run_dir

    argv = ["headsearch", "run", "--storage", "postgresql://u:s3cretPW@h/db", "--storage=redis://:s3cretPW@h:6379",
            "--trials", "3"]
    create_run_dir(tmp_path / "run", "task: x\n", argv)
    assert files_holding(tmp_path / "run", PASSWORD) == []
    assert (tmp_path / "run" / "command.txt").read_text() == (
        "headsearch run --storage 'postgresql://u:***@h/db' '--storage=redis://:***@h:6379' --trials 3\n")
