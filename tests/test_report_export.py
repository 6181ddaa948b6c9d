"""`headsearch report`, `export` and `dashboard` on a real small search, and on hand-made studies.

The real study: a ViT search on a slice of CIFAR-10 (7 trials of 3 short epochs, CPU), built once
per module by `headsearch run`, as a user builds one. Its first trials are enqueued so that it always
holds complete trials, an invalid architecture (rejected) and a repeated configuration (a duplicate);
the rest are sampled. Hand-made studies (no training) cover states and edge cases a small search may
not reach.
"""
import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from headsearch.search.artifacts import default_artifact_dir, upload_plots
from headsearch.search.hypervolume import dominates, minimised
from headsearch.search.objectives import CONVERGENCE, Objective, axis_label, objectives_of, resolve_objectives
from headsearch.search.report import summarize

EPOCHS = 3
SPACE = {
    "schedule": {"families": ["uniform", "halving"], "heads": [1, 2, 4, 8, 16]},
    "skip": ["none", "scores"],
    "fusion": ["none"],
    "ranges": {"d_model": [24, 32]},
    "fixed": {
        "arch": {"d_ff": 64, "enc_layers": 2, "patch_size": 8},
        "train": {"epochs": EPOCHS, "max_steps_per_epoch": 8, "batch_size": 64, "warmup_epochs": 0.5},
        "data": {"train_limit": 1000, "val_size": 300, "test_limit": 300, "augment": ["flip"]},
    },
}
ENQUEUED = [
    {"d_model": 32, "schedule": "uniform", "heads": 8, "skip": "none", "fusion": "none"},
    {"d_model": 32, "schedule": "halving", "heads": 8, "skip": "scores", "fusion": "none"},
    {"d_model": 24, "schedule": "uniform", "heads": 16, "skip": "none", "fusion": "none"},  # 16 does not divide 24
    {"d_model": 32, "schedule": "uniform", "heads": 8, "skip": "none", "fusion": "none"},  # = trial 0
]
# The first two as the files `headsearch run --enqueue` reads (architecture fields, as in examples/).
ENQUEUED_FILES = [
    {"d_model": 32, "enc_heads": [8, 8], "skip": "none", "fusion": "none"},
    {"d_model": 32, "enc_heads": [8, 4], "skip": "scores", "fusion": "none"},
]


# ------------------------------------------------------------------------------ the real study


@pytest.fixture(scope="module")
def real(tmp_path_factory, cifar_dir):
    """A finished ViT search (accuracy, time objectives) made by `headsearch run`: its storage URL, study and folder.

    `run --enqueue` puts first only architectures the space holds, each once (by design), so the invalid
    architecture and the repeat cannot go through it: the study is built as a user resumes one. A first
    `run --trials 2 --enqueue A --enqueue B` creates the study and trains A and B; the repeat and the
    invalid one are then queued with Optuna's `enqueue_trial` (what any Optuna client of the storage can
    do); the same command with `--trials 7` resumes the search and runs them, then samples the rest."""
    from conftest import Cli, write_yaml

    cli = Cli()
    root = tmp_path_factory.mktemp("search")
    (root / "space.yaml").write_text(yaml.safe_dump(SPACE))
    url = f"sqlite:///{root / 'search.db'}"
    first = [write_yaml(root / f"enqueue-{i}.yaml", arch) for i, arch in enumerate(ENQUEUED_FILES)]
    command = ["run", "--task", "vit-cifar10", "--space", root / "space.yaml", "--sampler", "random",
               "--pruner", "median", "--pruner-startup", 2, "--storage", url, "--study", "vit-test", "--seed", 0,
               "--data-dir", cifar_dir, "--run-root", root / "runs", "--device", "cpu", "--heartbeat", 0,
               *[arg for path in first for arg in ("--enqueue", path)]]
    result = cli([*command, "--trials", len(first)])
    assert result.exit_code == 0, result.output
    study = optuna.load_study(study_name="vit-test", storage=url)
    assert [t.params for t in study.trials] == ENQUEUED[: len(first)]
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    for params in ENQUEUED[len(first):]:
        study.enqueue_trial(params)
    result = cli([*command, "--trials", 7])
    assert result.exit_code == 0, result.output
    study = optuna.load_study(study_name="vit-test", storage=url)
    assert [t.params for t in study.trials[: len(ENQUEUED)]] == ENQUEUED
    # trial 3 repeats trial 0: told FAIL as a duplicate, not trained and not counted toward the 7
    assert len([t for t in study.trials if "duplicate_of" not in t.user_attrs]) == 7
    return {"url": url, "study": study, "root": root, "data": cifar_dir}


def _directions(study):
    return [o["direction"] for o in study.user_attrs["headsearch"]["objectives"]]


@pytest.mark.slow
def test_summarize_counts_front_and_savings(real):
    study, rep = real["study"], summarize(real["url"], None)
    trials = study.trials
    assert rep.study == "vit-test" and rep.task == "vit-cifar10" and rep.primary_metric == "accuracy"
    assert [(o.name, o.direction) for o in rep.objectives] == [("accuracy", "maximize"), ("time", "minimize")]

    # Counts add up, and match the trials' states.
    assert sum(rep.counts.values()) == len(trials)
    rejected = [t for t in trials if "rejected" in t.user_attrs]
    assert rep.counts["rejected"] == len(rejected) >= 1
    assert rep.counts["complete"] == sum(t.state == TrialState.COMPLETE for t in trials)
    assert rep.counts["pruned"] == sum(t.state == TrialState.PRUNED for t in trials) - len(rejected)
    assert rep.counts["failed"] == rep.counts["running"] == rep.counts["waiting"] == 0
    assert trials[2].user_attrs["rejected"] and "does not divide" in trials[2].user_attrs["rejected"]
    assert trials[3].user_attrs["duplicate_of"] == 0 and trials[3].state == TrialState.FAIL and trials[3].values is None
    assert "epochs_run" not in trials[3].user_attrs and "run_dir" not in trials[3].user_attrs  # never trained
    assert rep.counts["duplicate"] == sum("duplicate_of" in t.user_attrs for t in trials) >= 1
    assert [r.state for r in rep.trials] == [
        "rejected" if "rejected" in t.user_attrs else "duplicate" if "duplicate_of" in t.user_attrs
        else t.state.name.lower() for t in trials]

    # Every front member is non-dominated among COMPLETE trials (checked by hand), and every
    # non-dominated complete trial is on the front (a duplicate folded into its twin's row).
    directions = _directions(study)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]

    def better_or_equal(a, b, d):
        return a >= b if d == "maximize" else a <= b

    def strictly_better(a, b, d):
        return a > b if d == "maximize" else a < b

    def dominated(t):
        return any(all(better_or_equal(o.values[i], t.values[i], d) for i, d in enumerate(directions))
                   and any(strictly_better(o.values[i], t.values[i], d) for i, d in enumerate(directions))
                   for o in complete)

    assert rep.front
    on_front = {r.number for r in rep.front} | {d for r in rep.front for d in r.duplicates}
    by_number = {t.number: t for t in trials}
    for r in rep.front:
        t = by_number[r.number]
        assert t.state == TrialState.COMPLETE and not dominated(t)
        assert r.values == dict(zip(["accuracy", "time"], t.values))
        assert r.schedule == t.user_attrs["config"]["arch"]["enc_heads"]
        assert r.skip == t.user_attrs["config"]["arch"]["skip"] and r.fusion == "none"
        assert r.test_metrics == t.user_attrs["test_metrics"] and r.val_metrics == t.user_attrs["val_metrics"]
        assert r.run_dir == t.user_attrs["run_dir"] and r.best_epoch == t.user_attrs["best_epoch"]
    assert on_front == {t.number for t in complete if not dominated(t)}

    # Pruning savings, by hand: trained trials (complete + pruned, not rejected, not duplicates).
    trained = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               and "rejected" not in t.user_attrs and "duplicate_of" not in t.user_attrs]
    ran = sum(t.user_attrs["epochs_run"] for t in trained)
    s = rep.savings
    assert (s.trials, s.epochs_run, s.epochs_without_pruning) == (len(trained), ran, len(trained) * EPOCHS)
    assert s.epochs_saved == len(trained) * EPOCHS - ran
    assert s.saved_fraction == pytest.approx(1 - ran / (len(trained) * EPOCHS))
    for t in trials:
        if t.state == TrialState.PRUNED and "pruned" in t.user_attrs:
            row = rep.trials[t.number]
            assert row.epochs_run == t.user_attrs["epochs_run"] < EPOCHS
            assert f"at epoch {t.user_attrs['pruned']['epoch']}" in row.note

    # Importances: one entry per objective, either normalised importances or a reason.
    assert [i.objective for i in rep.importances] == ["accuracy", "time"]
    for imp in rep.importances:
        assert imp.error or sum(imp.importances.values()) == pytest.approx(1.0)
    json.dumps(rep.to_dict())  # JSON-able as is


@pytest.mark.floor
@pytest.mark.slow
def test_report_json_csv_and_table(real, cli):
    url = real["url"]
    result = cli(["report", "--storage", url, "--format", "json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["study"] == "vit-test" and d["counts"]["rejected"] >= 1
    assert {r["number"] for r in d["front"]} <= {t["number"] for t in d["trials"] if t["state"] == "complete"}

    result = cli(["report", "--storage", url, "--study", "vit-test", "--format", "csv"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "number,state,arch,accuracy,time,epochs_run,duplicate_of,note"
    assert len(lines) == 1 + len(real["study"].trials)
    assert lines[3].startswith("2,rejected,") and "does not divide" in lines[3]
    assert lines[4].split(",")[6] == "0"  # trial 3 duplicates trial 0

    result = cli(["report", "--storage", url])
    assert result.exit_code == 0, result.output
    for text in ("Pareto front", "parameter importances", "pruning:", "epochs saved", "all trials", "rejected"):
        assert text in result.stdout

    # The anytime curve: one point per trained trial (complete or pruned), ending at the final front.
    curve = d["anytime"]
    trained = [t for t in d["trials"] if t["state"] in ("complete", "pruned")]
    assert [p["trials"] for p in curve] == list(range(1, len(trained) + 1))
    assert curve[-1]["hypervolume"] == pytest.approx(1.0)
    assert all(a["hypervolume"] <= b["hypervolume"] + 1e-12 for a, b in zip(curve, curve[1:]))
    assert all(0 < a["fair_seconds"] < b["fair_seconds"] for a, b in zip(curve, curve[1:]))
    assert f"anytime: front hypervolume after" in result.stdout and f"of {len(trained)}" in result.stdout


@pytest.mark.floor
@pytest.mark.slow
def test_report_plots_written_and_uploaded_as_artifacts(real, tmp_path, cli):
    url, study = real["url"], real["study"]
    out = tmp_path / "plots"
    result = cli(["report", "--storage", url, "--plots", out])
    assert result.exit_code == 0, result.output
    pngs, htmls = sorted(out.glob("*.png")), sorted(out.glob("*.html"))
    for kind in ("pareto-front", "learning-curves", "param-importances", "anytime"):
        assert (out / f"vit-test-{kind}.png").is_file()
    rep = summarize(url, "vit-test")
    assert {p.name for p in htmls} == {"vit-test-pareto-front.html", "vit-test-learning-curves.html"} | {
        f"vit-test-param-importances-{i.objective}.html" for i in rep.importances if not i.error} | (
        {"vit-test-rungs.html"} if rep.rung_check else set())
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    for p in htmls:
        text = p.read_text()
        assert "<html>" in text and "plotly" in text.lower()
    pareto = (out / "vit-test-pareto-front.html").read_text()
    assert "vit-test" in pareto and "seconds" in pareto and "accuracy" in pareto
    curves = (out / "vit-test-learning-curves.html").read_text()
    assert "epoch" in curves
    if not study_has_no_pruned(study):
        assert '"dash":"dash"' in curves.replace(" ", "")  # pruned trials are dashed
    for p in pngs + htmls:
        assert str(p) in result.stdout

    # Only the PNGs go to the artifact store (the HTML files inline plotly.js: MBs each).
    study = optuna.load_study(study_name="vit-test", storage=url)
    metas = optuna.artifacts.get_all_artifact_meta(study)
    assert sorted(m.filename for m in metas) == sorted(p.name for p in pngs)
    adir = default_artifact_dir(url)
    assert adir == real["root"] / "search-artifacts"
    for m in metas:
        assert (adir / m.artifact_id).read_bytes() == (out / m.filename).read_bytes()
        assert m.mimetype == "image/png"
    # The figures live in the study, for optuna-dashboard, under fixed ids: a few KB of JSON.
    from optuna_dashboard._custom_plot_data import get_plotly_graph_objects

    figures = get_plotly_graph_objects(_system_attrs(url, "vit-test"))
    assert {"headsearch-pareto-front", "headsearch-learning-curves"} <= set(figures)
    assert sum(len(f) for f in figures.values()) < 200_000 < sum(p.stat().st_size for p in htmls)
    curve = json.loads(figures["headsearch-learning-curves"])
    shown = {tr["legendgroup"] for tr in curve["data"]}
    assert shown == {str(t.number) for t in study.trials if t.intermediate_values and "duplicate_of" not in t.user_attrs}

    # The same plots again: nothing new is uploaded, the figures are replaced, not added.
    result = cli(["report", "--storage", url, "--plots", out, "--format", "json"])
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # the plot list went to stderr
    assert len(optuna.artifacts.get_all_artifact_meta(study)) == len(metas)
    assert set(get_plotly_graph_objects(_system_attrs(url, "vit-test"))) == set(figures)


def _system_attrs(url: str, name: str) -> dict:
    """A study's system attributes, through the storage's public API (where optuna-dashboard keeps figures)."""
    from headsearch.search.report import load_study_stored

    _, stored = load_study_stored(url, name)
    return stored.storage.get_study_system_attrs(stored.study_id)


def study_has_no_pruned(study) -> bool:
    return not any(t.state == TrialState.PRUNED and "pruned" in t.user_attrs for t in study.trials)


@pytest.mark.slow
def test_export_then_train_reproduces_the_trial(real, tmp_path, cli):
    """Acceptance: `headsearch train --config` on an exported trial gives the trial's metrics exactly."""
    url, study = real["url"], real["study"]
    result = cli(["export", "--storage", url, "--best", "accuracy", "--out", tmp_path / "best"])
    assert result.exit_code == 0, result.output
    (path,) = [Path(p) for p in result.stdout.split()]
    number = int(path.stem.split("-")[1])
    t = study.trials[number]
    assert t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs
    complete = [c for c in study.trials if c.state == TrialState.COMPLETE]
    assert t.values[0] == max(c.values[0] for c in complete)

    text = path.read_text()
    assert text.startswith("# headsearch export: study vit-test, trial")
    assert yaml.safe_load(text) == t.user_attrs["config"]
    assert f"--config {path}" in text and "--data-dir" in text

    run_dir = tmp_path / "retrain"
    result = cli(["train", "--task", "vit-cifar10", "--config", path, "--data-dir", real["data"], "--out", run_dir,
                     "--device", "cpu"])
    assert result.exit_code == 0, result.output
    final = json.loads((run_dir / "final.json").read_text())
    assert final["best_value"] == t.values[0]  # the objective, exactly
    assert final["best_epoch"] == t.user_attrs["best_epoch"]
    assert final["best_metrics"] == t.user_attrs["val_metrics"]
    assert final["test_metrics"] == t.user_attrs["test_metrics"]
    assert final["params"] == t.user_attrs["params"]

    # --trial and --pareto write the same kind of file; the front's duplicates are written once.
    result = cli(["export", "--storage", url, "--trial", 0, "--out", tmp_path / "one"])
    assert result.exit_code == 0 and (tmp_path / "one" / "trial-00000.yaml").is_file()
    result = cli(["export", "--storage", url, "--pareto", "--out", tmp_path / "front"])
    assert result.exit_code == 0, result.output
    rep = summarize(url, "vit-test")
    assert sorted(p.name for p in (tmp_path / "front").iterdir()) == [f"trial-{r.number:05d}.yaml" for r in rep.front]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode())


def _studies_once_up(proc: subprocess.Popen, base: str, timeout: float = 30.0):
    """The dashboard's /api/studies once the server at `base` answers (it fails the test if `proc` ends first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _get_json(f"{base}/api/studies")
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dashboard did not answer: {proc.communicate(timeout=5)}")
            time.sleep(0.3)


@pytest.mark.server
@pytest.mark.processes
@pytest.mark.floor
@pytest.mark.slow
def test_dashboard_serves_the_study(real, optuna_dashboard, cli, tmp_path):
    result = cli(["report", "--storage", real["url"], "--study", "vit-test", "--plots", tmp_path / "plots"])
    assert result.exit_code == 0, result.output
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "headsearch", "dashboard", "--storage", real["url"], "--port", str(port),
                             "--study", "vit-test"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        studies = _studies_once_up(proc, base)
        (summary,) = [s for s in studies["study_summaries"] if s["study_name"] == "vit-test"]
        detail = _get_json(f"{base}/api/studies/{summary['study_id']}")
        assert detail["objective_names"] == ["accuracy", "time"]
        assert detail["has_intermediate_values"] is True
        trials = {t["number"]: t for t in detail["trials"]}
        for t in real["study"].trials:
            got = {v["step"]: v["value"] for v in trials[t.number]["intermediate_values"]}
            assert got == t.intermediate_values
        # The figures `report --plots` saved, as the dashboard's page gets them (its own learning-curve chart
        # is for single-objective studies only: this one is the multi-objective study's).
        served = {g["id"]: json.loads(g["graph_object"]) for g in detail["plotly_graph_objects"]}
        assert {"headsearch-pareto-front", "headsearch-learning-curves"} <= set(served)
        curves = served["headsearch-learning-curves"]["data"]
        assert {tr["legendgroup"] for tr in curves} == {str(t.number) for t in real["study"].trials
                                                        if t.intermediate_values and "duplicate_of" not in t.user_attrs}
        assert len(served["headsearch-pareto-front"]["data"]) >= 1
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert f"{base}/dashboard/studies/{summary['study_id']}" in out


# ------------------------------------------------------------------------------ the page in a browser


class _Element:
    """An element of a rendered page: its tag, attributes and children (elements and text, in order)."""

    def __init__(self, tag: str, attrs: dict):
        self.tag, self.attrs, self.children = tag, attrs, []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def find(self, cls: str) -> list["_Element"]:
        """The descendants with class `cls`, in document order."""
        found = []
        for c in self.children:
            if isinstance(c, _Element):
                if cls in c.classes:
                    found.append(c)
                found += c.find(cls)
        return found

    def texts(self) -> list[str]:
        """The non-blank texts inside, stripped, in document order (scripts and styles left out)."""
        out = []
        for c in self.children:
            if isinstance(c, _Element):
                out += c.texts()
            elif c.strip():
                out.append(c.strip())
        return out


class _Page(HTMLParser):
    """The DOM Chromium dumps (`--dump-dom`), as a tree of _Element, and its elements by id."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.root = _Element("#document", {})
        self.by_id: dict[str, _Element] = {}
        self._open = [self.root]
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        el = _Element(tag, {k: v or "" for k, v in attrs})
        self._open[-1].children.append(el)
        if el.attrs.get("id"):
            self.by_id.setdefault(el.attrs["id"], el)
        if tag not in self.VOID:
            self._open.append(el)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self._open.pop()

    def handle_endtag(self, tag):
        for i in range(len(self._open) - 1, 0, -1):
            if self._open[i].tag == tag:
                del self._open[i:]
                break

    def handle_data(self, data):
        if self._open[-1].tag not in ("script", "style"):
            self._open[-1].children.append(data)


def _chromium() -> str:
    """Debian's Chromium (`apt-get install chromium`; `.ci/run` installs it when it is missing)."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        from conftest import unavailable

        unavailable("Chromium is not installed (apt-get install chromium), so the dashboard page cannot be rendered")
    return path


def _render(chromium: str, page: str, screenshot: Path, processes, size=(1400, 2900)) -> str:
    """`page` as headless Chromium renders it: the DOM after its scripts ran, and a screenshot of the window.
    Virtual time stands still while a request is pending, so the 20 s budget is 20 s of the page's own
    timers once the dashboard has answered (about 3 s of wall time here)."""
    from conftest import kill_group

    cmd = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu",  # root runs Chromium: no sandbox
           f"--user-data-dir={screenshot.parent / 'chromium-profile'}", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--hide-scrollbars", f"--window-size={size[0]},{size[1]}",
           "--virtual-time-budget=20000", f"--screenshot={screenshot}", "--dump-dom", page]
    browser = processes.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        dom, log = browser.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_group(browser.pid)
        dom, log = browser.communicate()
        pytest.fail(f"Chromium did not finish rendering {page} in 120 s: {log[-3000:]}")
    assert browser.returncode == 0 and dom.strip(), (browser.returncode, log[-3000:])
    return dom


@pytest.mark.browser
@pytest.mark.server
@pytest.mark.slow
def test_dashboard_page_draws_the_study_in_a_browser(real, optuna_dashboard, cli, processes, tmp_path):
    """The study `headsearch run` made and `report --plots` drew, on optuna-dashboard's study page as headless
    Chromium renders it from what the dashboard serves (the DOM after its scripts ran): the objectives'
    names, and headsearch's figures drawn by plotly.js (SVG) under the dashboard's own charts, the
    study's top page being where optuna-dashboard draws the figures saved with save_plotly_graph_object
    (a div `user-defined-plot:<id>` each): the Pareto front with one point per complete trial, and the
    multi-objective learning curves with one curve per trained trial, of as many points as it ran epochs."""
    from optuna_dashboard._custom_plot_data import get_plotly_graph_objects

    chromium = _chromium()
    url, study = real["url"], real["study"]
    result = cli(["report", "--storage", url, "--study", "vit-test", "--plots", tmp_path / "plots"])
    assert result.exit_code == 0, result.output
    saved = set(get_plotly_graph_objects(_system_attrs(url, "vit-test")))
    port = _free_port()
    with open(tmp_path / "dashboard.log", "w") as log:
        server = processes.start([sys.executable, "-m", "headsearch", "dashboard", "--storage", url, "--port", str(port),
                                  "--study", "vit-test"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    (summary,) = [s for s in _studies_once_up(server, base)["study_summaries"] if s["study_name"] == "vit-test"]
    shot = tmp_path / "dashboard.png"
    dom = _render(chromium, f"{base}/dashboard/studies/{summary['study_id']}", shot, processes)
    processes.stop(server, grace=10)
    (tmp_path / "dashboard.html").write_text(dom)  # beside the screenshot, to look at when this fails
    page = _Page(dom)

    # Every figure `report --plots` saved is drawn: an SVG plot in its div.
    drawn = {k.removeprefix("user-defined-plot:"): el for k, el in page.by_id.items() if k.startswith("user-defined-plot:")}
    assert set(drawn) == saved and {"headsearch-pareto-front", "headsearch-learning-curves"} <= saved, (set(drawn), saved)
    for el in drawn.values():
        assert el.find("main-svg") and el.find("gtitle"), el.texts()

    # The dashboard's own page around them: the study's name, its objectives' names (the metric names `run` set)
    # and the PNGs `report --plots` uploaded, listed as the study's artifacts.
    own = Counter(page.root.texts()) - Counter(t for el in drawn.values() for t in el.texts())
    assert any("vit-test" in t for t in own) and {"accuracy", "time"} <= set(own), sorted(own)[:80]
    assert {p.name for p in (tmp_path / "plots").glob("*.png")} <= set(own), sorted(own)[:80]

    # The Pareto front: its title and axes, one point per complete trial, the front's points in one trace.
    front = drawn["headsearch-pareto-front"]
    assert front.find("gtitle")[0].texts() == ["vit-test: Pareto front on accuracy, time"]
    # Axis titles in full, broken into lines that fit the dashboard's card (the time axis's is long).
    assert " ".join(front.find("xtitle")[0].texts()) == axis_label("accuracy", "maximize")
    assert " ".join(front.find("ytitle")[0].texts()) == axis_label("time", "minimize")
    assert len(front.find("ytitle")[0].texts()) > 1
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    points = [len(tr.find("point")) for tr in front.find("scatterlayer")[0].find("trace")]
    assert sum(points) == len(complete) and len(summarize(url, "vit-test").front) in points, points

    # The learning curves: one drawn curve per trained trial (duplicates left out), in trial order, a point per
    # epoch it ran, a line through them, dashed when pruned; each named in the legend.
    curves = drawn["headsearch-learning-curves"]
    assert curves.find("gtitle")[0].texts()[0] == "vit-test: learning curves"
    assert curves.find("xtitle")[0].texts() == ["epoch"]
    trained = [t for t in study.trials if t.intermediate_values and "duplicate_of" not in t.user_attrs]
    assert {t.state for t in trained} <= {TrialState.COMPLETE, TrialState.PRUNED}
    lines = [tr for tr in curves.find("scatterlayer")[0].find("trace") if tr.find("js-line")]
    assert [len(tr.find("point")) for tr in lines] == [len(t.intermediate_values) for t in trained]
    for tr, t in zip(lines, trained):
        (line,) = tr.find("js-line")
        assert line.attrs["d"].count("L") == len(t.intermediate_values) - 1, line.attrs["d"]
        assert ("stroke-dasharray" in line.attrs.get("style", "")) == (t.state == TrialState.PRUNED), (t.number, line.attrs)
    legend = [" ".join(e.texts()) for e in curves.find("legendtext")]
    assert [int(name.split(":")[0]) for name in legend] == [t.number for t in trained], legend

    # The screenshot: a PNG of the whole window, with something drawn in it.
    from PIL import Image

    assert shot.stat().st_size > 50_000
    with Image.open(shot) as img:
        assert (img.format, img.size) == ("PNG", (1400, 2900))
        assert len(img.convert("RGB").getcolors(maxcolors=img.width * img.height)) > 100


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("command", ["report", "export", "dashboard"])
def test_unreadable_storage_exits_2_and_creates_nothing(command, tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    extra = ["--trial", "0", "--out", tmp_path / "out"] if command == "export" else []
    cases = [
        ("foo://x", "not a storage URL"),
        (f"sqlite:///{tmp_path / 'missing' / 'x.db'}", "does not exist"),
        (f"sqlite:///{tmp_path / 'none.db'}", "no database file"),
        (f"journal:{tmp_path / 'none.log'}", "no journal file"),
    ]
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("hello\n")
    cases.append((f"sqlite:///{not_a_db}", "not a SQLite database"))
    for url, fragment in cases:
        cli.error_line(cli([command, "--storage", url, *extra]), fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert not_a_db.read_text() == "hello\n"


@pytest.mark.floor
def test_empty_optuna_database_is_not_a_study(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    optuna.storages.RDBStorage(url)  # Optuna's tables, no study
    cli.error_line(cli(["report", "--storage", url]), "holds no studies")


def _hand_made(url: str, name: str = "hand", directions=("maximize", "minimize")) -> optuna.Study:
    """A study shaped like `headsearch run`'s, with every state (no training)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name=name, directions=list(directions))
    names = ["accuracy", "time"][: len(directions)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(names)
    study.set_user_attr("headsearch", {"task": "vit-cifar10", "objectives": [{"name": n, "direction": d} for n, d in zip(names, directions)],
                                       "primary_metric": "accuracy", "epochs": 4, "seed": 0, "data": "download"})
    dist = {"heads": CategoricalDistribution([1, 2, 4]), "skip": CategoricalDistribution(["none", "output"])}

    def config(heads, skip):
        return {"task": "vit-cifar10", "seed": 0, "arch": {"enc_heads": [heads] * 4, "skip": skip, "fusion": "none"},
                "train": {"epochs": 4}, "data": {}}

    def add(state, heads, skip, values=None, curve=(), **attrs):
        ua = {"config": config(heads, skip), "arch": f"{heads}x4 skip={skip} fusion=none", **attrs}
        if state == TrialState.COMPLETE:
            ua.update(val_metrics={"accuracy": values[0], "loss": 1.0}, test_metrics={"accuracy": values[0] - 0.01},
                      best_epoch=len(curve), params=1000, best_seconds_alone=values[-1])
        study.add_trial(create_trial(state=state, params={"heads": heads, "skip": skip}, distributions=dist,
                                     values=list(values)[: len(directions)] if values else None,
                                     intermediate_values=dict(enumerate(curve, start=1)), user_attrs=ua))

    C = TrialState.COMPLETE
    add(C, 1, "none", (0.5, 10.0), (0.3, 0.4, 0.45, 0.5), epochs_run=4)  # 0: front
    add(C, 2, "none", (0.6, 20.0), (0.3, 0.5, 0.55, 0.6), epochs_run=4)  # 1: front
    add(C, 4, "none", (0.4, 30.0), (0.2, 0.3, 0.35, 0.4), epochs_run=4)  # 2: dominated by 0 and 1
    add(C, 2, "none", (0.6, 20.0), (0.3, 0.5, 0.55, 0.6), epochs_run=4, duplicate_of=1)  # 3: duplicate of 1
    add(TrialState.PRUNED, 4, "output", None, (0.1,), epochs_run=1,
        pruned={"prune": True, "rule": "median", "epoch": 1, "value": 0.1, "threshold": 0.3, "n_compared": 3, "note": ""})
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"rejected": "enc_heads[0] = 3 does not divide d_model"}))
    add(TrialState.FAIL, 1, "output", None, (0.2, 0.25), epochs_run=2, fail_reason="training diverged")
    study.enqueue_trial({"heads": 1, "skip": "output"})
    return study


@pytest.mark.floor
def test_summarize_hand_made_study_states_duplicates_and_savings(tmp_path):
    url = f"sqlite:///{tmp_path / 'hand.db'}"
    _hand_made(url)
    rep = summarize(url, None)
    # 3 is a duplicate as earlier studies recorded them (COMPLETE, with its twin's values): folded into 1
    assert rep.counts == {"complete": 4, "pruned": 1, "rejected": 1, "failed": 1, "duplicate": 0, "running": 0, "waiting": 1,
                          "over_budget": 0}
    assert [r.number for r in rep.front] == [0, 1] and rep.front[1].duplicates == [3]
    assert rep.front[0].schedule == [1, 1, 1, 1] and rep.front[0].values == {"accuracy": 0.5, "time": 10.0}
    # Trained: 0, 1, 2 (complete) and 4 (pruned after 1 of 4 epochs); not 3 (duplicate), 5 (rejected), 6 (failed).
    s = rep.savings
    assert (s.trials, s.epochs_run, s.epochs_without_pruning, s.epochs_saved) == (4, 13, 16, 3)
    assert s.saved_fraction == pytest.approx(3 / 16)
    notes = {r.number: r.note for r in rep.trials}
    assert notes[4] == "median rule at epoch 1: 0.1 < 0.3 (3 trials compared)"
    assert "does not divide" in notes[5] and notes[6] == "training diverged" and "duplicate of trial 1" in notes[3]
    assert [r.state for r in rep.trials] == ["complete"] * 4 + ["pruned", "rejected", "failed", "waiting"]
    directions = ["maximize", "minimize"]
    assert dominates(minimised([0.5, 10.0], directions), minimised([0.4, 30.0], directions))
    assert not dominates(minimised([0.6, 20.0], directions), minimised([0.5, 10.0], directions))
    assert not dominates(minimised([0.6, 20.0], directions), minimised([0.6, 20.0], directions))
    assert all(i.error or math.isclose(sum(i.importances.values()), 1.0) for i in rep.importances)


def test_single_objective_report_plots_and_importance_reasons(tmp_path):
    from headsearch.search.plots import write_plots
    from headsearch.search.report import load_study_stored

    url = f"sqlite:///{tmp_path / 'one.db'}"
    _hand_made(url, directions=("maximize",))
    study, stored = load_study_stored(url, None)
    rep = summarize(url, None, study=study)
    assert [r.number for r in rep.front] == [1]  # the best trial (its duplicate 3 folded in)
    paths, figures = write_plots(study, rep, tmp_path / "plots")
    assert rep.rung_check  # 3 trials ran to the end: the rungs' figure is drawn
    assert {p.name for p in paths} == {f"hand-{k}.png" for k in ("objective", "learning-curves", "param-importances", "anytime",
                                                                 "rungs")} | {
        f"hand-{k}.html" for k in ("objective", "learning-curves", "param-importances-accuracy", "rungs")}
    assert set(figures) == {"headsearch-objective", "headsearch-learning-curves", "headsearch-param-importances-accuracy",
                            "headsearch-rungs"}
    assert all(p.stat().st_size > 1000 for p in paths)
    ids = upload_plots(study, paths, default_artifact_dir(url), stored)
    assert len(set(ids)) == len(paths) and (tmp_path / "one-artifacts").is_dir()
    assert upload_plots(study, paths, default_artifact_dir(url), stored) == ids  # unchanged files: nothing new

    # An artifact deleted in optuna-dashboard leaves a JSON null record (Optuna's get_all_artifact_meta raises
    # on it): the other plots are still recognised, and the deleted one is uploaded again.
    stored.storage.set_study_system_attr(stored.study_id, f"artifacts:{ids[0]}", json.dumps(None))
    again = upload_plots(study, paths, default_artifact_dir(url), stored)
    assert again[1:] == ids[1:] and again[0] not in ids

    # Too few complete trials: a reason, not a crash.
    url2 = f"sqlite:///{tmp_path / 'two.db'}"
    s2 = optuna.create_study(storage=url2, study_name="tiny", directions=["maximize", "minimize"])
    s2.add_trial(create_trial(values=[0.5, 1.0], params={"h": 1}, distributions={"h": CategoricalDistribution([1, 2])}))
    rep2 = summarize(url2, None)
    assert [i.error for i in rep2.importances] == ["needs at least 2 complete trials (1 so far)"] * 2
    assert [r.number for r in rep2.front] == [0] and rep2.savings.trials == 0


def test_axis_labels_name_metrics_units_and_directions():
    assert axis_label("time", "minimize") == "time to best validation (training seconds alone on the device), lower is better"
    assert axis_label("accuracy", "maximize") == "validation accuracy, higher is better"
    assert axis_label("epochs", "minimize") == "epochs to best validation (epochs), lower is better"
    assert axis_label("params") == "parameters (count)"
    assert default_artifact_dir("sqlite:///runs/x.db") == Path("runs/x-artifacts")
    assert default_artifact_dir("journal:/tmp/j/search.log") == Path("/tmp/j/search-artifacts")
    assert default_artifact_dir("postgresql://u@h/db") == Path("headsearch-artifacts")


def test_study_selection_errors(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'two.db'}"
    _hand_made(url, "first")
    _hand_made(url, "second")
    cli.error_line(cli(["report", "--storage", url]), "several studies", "first, second")
    cli.error_line(cli(["report", "--storage", url, "--study", "nope"]),
                          "unknown study nope in", "studies there are first, second")
    cli.error_line(cli(["dashboard", "--storage", url, "--study", "nope"]), "unknown study nope")
    cli.error_line(cli(["report", "--storage", url, "--study", "first", "--format", "xml"]), "--format")
    result = cli(["report", "--storage", url, "--study", "first", "--format", "csv"])
    assert result.exit_code == 0 and result.stdout.count("\n") == 9


def test_export_bad_selection_exits_2_and_creates_nothing(tmp_path, cli):
    url = f"sqlite:///{tmp_path / 'hand.db'}"
    _hand_made(url)
    out = tmp_path / "out"
    base = ["export", "--storage", url, "--out", out]
    cli.error_line(cli(base), "exactly one of --trial N, --pareto, --best METRIC")
    cli.error_line(cli([*base, "--trial", 0, "--pareto"]), "exactly one of")
    cli.error_line(cli([*base, "--trial", 4]), "trial 4", "was pruned", "complete")
    cli.error_line(cli([*base, "--trial", 5]), "trial 5", "rejected")
    cli.error_line(cli([*base, "--trial", 6]), "trial 6", "failed")
    cli.error_line(cli([*base, "--trial", 7]), "trial 7", "has not started")
    cli.error_line(cli([*base, "--trial", 99]), "has no trial 99", "0 to 7")
    cli.error_line(cli([*base, "--best", "bleu"]), "--best bleu", "accuracy, time")
    assert not out.exists()

    # --best on an objective (time, lower is better) and on a validation metric that is not one (loss: all tie).
    result = cli([*base, "--best", "time"])
    assert result.exit_code == 0 and result.stdout.split() == [str(out / "trial-00000.yaml")]
    result = cli([*base, "--best", "loss"])
    assert result.exit_code == 0 and result.stdout.split() == [str(out / "trial-00000.yaml")]
    result = cli([*base, "--best", "accuracy"])
    assert result.stdout.split() == [str(out / "trial-00001.yaml")]  # 1 and its duplicate 3 tie: the earlier
    result = cli([*base, "--pareto"])
    assert result.stdout.split() == [str(out / "trial-00000.yaml"), str(out / "trial-00001.yaml")]
    header = (out / "trial-00001.yaml").read_text().splitlines()[:4]
    assert header[0] == "# headsearch export: study hand, trial 1 (complete)"
    assert header[3] == "# objectives: accuracy = 0.6 (maximize), time = 20 (minimize)"


def test_dashboard_without_optuna_dashboard_says_how_to_install(tmp_path, monkeypatch, cli):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "optuna_dashboard" else real_find_spec(name, *a))
    result = cli(["dashboard", "--storage", f"sqlite:///{tmp_path / 'x.db'}"])
    cli.error_line(result, "optuna-dashboard is not installed: pip install 'headsearch[dashboard]'")
    assert not (tmp_path / "x.db").exists()


def test_help_lists_the_study_commands(cli):
    result = cli(["--help"])
    for name in ("report", "export", "dashboard"):
        assert name in result.stdout
    assert "--format" in cli(["report", "--help"]).stdout


def test_the_objectives_table_reads_results_and_stored_trials(tmp_path):
    from headsearch.tasks import get_task

    task = get_task("vit-cifar10")
    assert resolve_objectives(task, None) == [Objective("accuracy", "maximize"), Objective("time", "minimize")]
    objectives = resolve_objectives(task, ["loss", "time", "epochs", "params"])
    assert [(o.name, o.direction, o.unit) for o in objectives] == [
        ("loss", "minimize", ""), ("time", "minimize", "seconds"), ("epochs", "minimize", "epochs"),
        ("params", "minimize", "parameters")]
    assert set(CONVERGENCE) == {"time", "epochs", "params"}
    # From a training result (what a trial tells Optuna) and from the trial's record (report, export).
    from types import SimpleNamespace

    result = SimpleNamespace(best_metrics={"accuracy": 0.5, "loss": 1.25}, best_seconds_alone=12.5, best_epoch=3, params=900)
    assert [o.value(result) for o in objectives] == [1.25, 12.5, 3.0, 900.0]
    study = _hand_made(f"sqlite:///{tmp_path / 'hand.db'}")
    first = study.trials[0]
    assert [o.trial_value(first) for o in objectives] == [1.0, 10.0, 4, 1000]
    assert objectives_of(study) == [Objective("accuracy", "maximize"), Objective("time", "minimize")]
    assert study.user_attrs["headsearch"]["objectives"] == [o.stored() for o in objectives_of(study)]
    assert objectives_of(study)[1].unit == "seconds" and objectives_of(study)[1].label.startswith("time to best")


def _frozen(number, state, values=None, epochs=4, alone=None, minute=0, **attrs):
    import datetime

    when = datetime.datetime(2026, 11, 26, 12, minute)
    attrs = {"epochs_run": epochs, **({"epoch_seconds_alone": alone} if alone is not None else {}), **attrs}
    return optuna.trial.FrozenTrial(number=number, state=state, value=None, values=values, datetime_start=when,
                                    datetime_complete=when, params={}, distributions={}, user_attrs=attrs,
                                    system_attrs={}, intermediate_values={}, trial_id=number)


@pytest.mark.floor
def test_the_anytime_curve_by_hand():
    """accuracy (max) x time (min), in the order the trials ended (minute), not their numbers. Scaled over
    the complete trials: t0 (0.5, 10 s) -> (1.0, 0.2), t1 (0.7, 30 s) -> (0.0, 1.0), t3 (0.6, 5 s) -> (0.5, 0.0).
    With the reference (1.1, 1.1): t0 alone 0.1 x 0.9 = 0.09; t0 and t1 0.09 + 0.11 - 0.01 = 0.19; the final
    front (t1, t3; t3 dominates t0) 0.11 + 0.66 - 0.06 = 0.71."""
    from headsearch.search.report import anytime_curve

    C, P, F = TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL
    trials = [_frozen(3, C, [0.6, 5.0], alone=1.0, minute=4),
              _frozen(1, C, [0.7, 30.0], alone=3.0, minute=2),
              _frozen(0, C, [0.5, 10.0], alone=2.5, minute=1),
              _frozen(2, P, epochs=1, alone=2.0, minute=3),
              _frozen(4, F, epochs=0, minute=5, duplicate_of=0),  # a duplicate: not trained
              _frozen(5, P, epochs=0, minute=6, rejected="16 heads do not divide 24")]  # rejected: not trained
    curve = anytime_curve(trials, ["maximize", "minimize"])
    assert [p.trials for p in curve] == [1, 2, 3, 4]
    assert [p.hypervolume for p in curve] == pytest.approx([0.09 / 0.71, 0.19 / 0.71, 0.19 / 0.71, 1.0])
    assert [p.fair_seconds for p in curve] == pytest.approx([10.0, 22.0, 24.0, 28.0])  # epochs run x seconds alone
    # A trial without a fair time leaves the curve on trials alone; no complete trial, no curve.
    trials[0] = _frozen(3, C, [0.6, 5.0], minute=4)
    assert [p.fair_seconds for p in anytime_curve(trials, ["maximize", "minimize"])] == [None] * 4
    assert anytime_curve([_frozen(0, P, epochs=1, alone=1.0)], ["maximize", "minimize"]) == []


def test_the_anytime_line_says_where_the_front_last_grew():
    from headsearch.cli.study_commands import anytime_line
    from headsearch.search.report import AnytimePoint

    curve = [AnytimePoint(n, 10.0 * n, hv) for n, hv in enumerate([0.2, 0.5, 0.5, 0.9, 1.0, 1.0, 1.0, 1.0], start=1)]
    assert anytime_line(curve) == ("anytime: front hypervolume after 2 / 4 / 6 / 8 trained trials: 0.50 / 0.90 / 1.00 / 1.00"
                                   " (of the final front's); last grew at trial 5 of 8, 50 of 80 fair seconds")


@pytest.mark.slow
def test_every_user_attribute_a_real_search_writes_is_in_the_trial_record(real):
    """headsearch.search.record names each key a trial carries; a key written and not named there is a
    record nobody documented (and a reader would guess at)."""
    from headsearch.search.record import KEYS

    written = {k for t in real["study"].trials for k in t.user_attrs}
    assert written - set(KEYS) == set()
    assert {"config", "arch", "run_dir", "worker", "rejected", "duplicate_of", "val_metrics", "epochs_run"} <= written
