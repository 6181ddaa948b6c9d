"""Plots of a study for `headsearch report --plots`: PNG files (matplotlib, Agg) for papers, and plotly
figures that optuna-dashboard shows in the study's page.

- the Pareto front on the objectives (Optuna's `plot_pareto_front`; front highlighted, dominated complete
  trials grey); a single-objective study gets its history instead (Optuna's `plot_optimization_history`);
- learning curves: each trial's intermediate values (the primary validation metric per epoch), pruned
  trials dashed and ending with an x at the pruning epoch (drawn here: optuna-dashboard 0.21 charts
  intermediate values of single-objective studies only, and no Optuna plot marks where a trial was pruned);
- parameter importances, one chart per objective (Optuna's `plot_param_importances`, with the same
  evaluator and target as `report`'s numbers);
- the rung check (when the report has its rows): Spearman's rho between each epoch's values and the final
  ones of the trials that ran to the end, the pruner's rungs marked (`headsearch.search.rungcheck`).

`publish_plots` writes the PNGs and a self-contained HTML file per figure into a folder, uploads the PNGs
as artifacts of the study (`headsearch.search.artifacts.upload_plots`: a few hundred KB, not again while
unchanged) and saves each plotly figure in the study with `optuna_dashboard.save_plotly_graph_object`
under a fixed id (a few KB of JSON, replaced on the next report). Axis labels come from the objectives
table (`headsearch.search.objectives.axis_label`).
"""
from __future__ import annotations

import re
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headsearch.errors import HeadsearchError
from headsearch.search.artifacts import upload_plots
from headsearch.search.objectives import axis_label
from headsearch.search.report import StudyReport, importance_evaluator, trial_state

GREY = "#b0b0b0"
FRONT = "#d62728"
STATE_STYLE = {"complete": "-", "pruned": "--", "failed": ":", "running": "-", "waiting": "-", "duplicate": ":", "over_budget": ":"}
PLOTLY_DASH = {"complete": "solid", "pruned": "dash", "failed": "dot", "running": "solid", "waiting": "solid", "duplicate": "dot", "over_budget": "dot"}


def check_plot_libraries() -> None:
    """Fail before anything is written when matplotlib or plotly is missing."""
    missing = []
    for mod in ("matplotlib", "plotly"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise HeadsearchError(f"{' and '.join(missing)} not installed: pip install 'headsearch[plots]'")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "study"


@dataclass
class PublishedPlots:
    """What `publish_plots` did: the files written, the PNGs' artifact ids, the figures saved in the study."""

    files: list[Path]
    artifacts: dict[Path, str] = field(default_factory=dict)  # PNG -> artifact id
    dashboard: list[str] = field(default_factory=list)  # graph-object ids saved in the study
    dashboard_note: str | None = None  # why no figure was saved in the study


def write_plots(study, report: StudyReport, out_dir: Path) -> tuple[list[Path], dict[str, Any]]:
    """Write the PNGs and one HTML file per plotly figure into `out_dir`; return the paths and the figures
    (graph-object id -> plotly figure)."""
    check_plot_libraries()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise HeadsearchError(f"--plots {out_dir} is a file: pass a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / _safe(report.study)
    paths: list[Path] = [_pareto(report, prefix) if len(report.objectives) >= 2 else _history(report, prefix)]
    curves = _curve_rows(study, report)  # read once, drawn twice
    paths.append(_curves(curves, prefix))
    paths.append(_importances(report, prefix))
    paths.append(_anytime(report, prefix))
    if report.rung_check:
        paths.append(_rungs(report, prefix))
    figures = plotly_figures(study, report, curves)
    for graph_id, fig in figures.items():
        paths.append(_save_html(fig, prefix.with_name(f"{prefix.name}-{graph_id.removeprefix('headsearch-')}.html"), graph_id))
    return paths, figures


def publish_plots(study, report: StudyReport, out_dir: Path, artifact_dir: Path, stored) -> PublishedPlots:
    """`report --plots`: write the files, upload the PNGs as artifacts, save the figures in the study
    (`stored`: the `StudyStorage` the study was opened on)."""
    paths, figures = write_plots(study, report, out_dir)
    pngs = [p for p in paths if p.suffix == ".png"]
    done = PublishedPlots(files=paths, artifacts=dict(zip(pngs, upload_plots(study, pngs, artifact_dir, stored))))
    try:
        from optuna_dashboard import save_plotly_graph_object
    except ImportError:
        done.dashboard_note = "optuna-dashboard is not installed: no figure saved in the study (pip install 'headsearch[dashboard]')"
        return done
    for graph_id, fig in figures.items():
        done.dashboard.append(save_plotly_graph_object(study, fig, graph_object_id=graph_id))
    return done


def plotly_figures(study, report: StudyReport, curves) -> dict[str, Any]:
    """The interactive figures, by graph-object id (a valid HTML id: the dashboard keys them by it);
    `curves`: `_curve_rows` of the study (read once by `write_plots`, drawn here and in its PNG)."""
    import optuna.visualization as ov

    objectives = report.objectives
    figures: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental-feature and few-trials warnings of Optuna's plots
        if len(objectives) >= 2:
            names = [_wrapped(axis_label(o.name, o.direction), "<br>") for o in objectives]
            if len(objectives) <= 3:
                fig = ov.plot_pareto_front(study, target_names=names)
            else:  # Optuna draws up to 3 axes: the first two, the front still on all objectives
                fig = ov.plot_pareto_front(study, targets=lambda t: (t.values[0], t.values[1]), target_names=names[:2])
            fig.update_layout(title=f"{report.study}: Pareto front on {', '.join(o.name for o in objectives)}")
            figures["headsearch-pareto-front"] = fig
        else:
            o = objectives[0]
            fig = ov.plot_optimization_history(study, target_name=axis_label(o.name, o.direction))
            fig.update_layout(title=f"{report.study}: {o.name} per trial")
            figures["headsearch-objective"] = fig
        figures["headsearch-learning-curves"] = _curves_figure(curves)
        if report.rung_check:
            figures["headsearch-rungs"] = _rungs_figure(report)
        for i, (o, imp) in enumerate(zip(objectives, report.importances)):
            if imp.error or not imp.importances:
                continue
            sign = -1.0 if o.direction == "maximize" else 1.0  # as `report` computes them (lower is better)
            fig = ov.plot_param_importances(study, evaluator=importance_evaluator(),
                                            target=lambda t, i=i, sign=sign: sign * t.values[i], target_name=o.name)
            fig.update_layout(title=f"{report.study}: parameter importances for {o.name}")
            figures[f"headsearch-param-importances-{_safe(o.name)}"] = fig
    return figures


# -- data -----------------------------------------------------------------------------------

def _complete_points(report: StudyReport) -> list[dict[str, Any]]:
    """Complete trials (duplicates left out: they sit on their twin's point), from the report's rows."""
    front = {r.number: r.duplicates for r in report.front}
    return [{"number": r.number, "values": [r.values[o.name] for o in report.objectives], "arch": r.arch,
             "front": r.number in front, "label": str(r.number) + "".join(f"={d}" for d in front.get(r.number, []))}
            for r in report.trials if r.state == "complete" and r.duplicate_of is None]


LABEL_WIDTH = 45  # characters of an axis label per line: the time axis's label is longer than a figure is tall


def _wrapped(label: str, newline: str = "\n") -> str:
    """An axis label broken into lines that fit beside a figure (matplotlib: "\n"; plotly: "<br>")."""
    return newline.join(textwrap.wrap(label, LABEL_WIDTH)) or label


def _figure(size=(7.5, 5.0)):
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def _save_png(fig, path: Path) -> Path:
    # No date in the metadata: the same study gives the same bytes (uploads are de-duplicated on content).
    fig.savefig(path, dpi=120, metadata={"Software": None})
    return path


def _save_html(fig, path: Path, div_id: str) -> Path:
    # Self-contained (plotly.js inlined): artifacts and offline machines need no CDN. A fixed div id
    # keeps the bytes identical for an unchanged study.
    fig.write_html(str(path), include_plotlyjs=True, full_html=True, div_id=div_id)
    return path


# -- the Pareto front -----------------------------------------------------------------------

def _pareto(report: StudyReport, prefix: Path) -> Path:
    ox, oy = report.objectives[0], report.objectives[1]
    pts = _complete_points(report)
    title = f"{report.study}: Pareto front ({ox.name} vs {oy.name}, {len(pts)} complete trials, duplicates merged)"
    more = len(report.objectives) > 2
    if more:
        title += f"; front on all {len(report.objectives)} objectives"
    front = sorted((p for p in pts if p["front"]), key=lambda p: (p["values"][0], p["values"][1]))
    rest = [p for p in pts if not p["front"]]

    fig = _figure()
    ax = fig.add_subplot()
    if rest:
        ax.scatter([p["values"][0] for p in rest], [p["values"][1] for p in rest], c=GREY, s=30, label="dominated")
    if front:
        ax.scatter([p["values"][0] for p in front], [p["values"][1] for p in front], c=FRONT, s=60, zorder=3,
                   label="Pareto front")
        if not more:
            ax.plot([p["values"][0] for p in front], [p["values"][1] for p in front], c=FRONT, lw=1, alpha=0.6)
    for p in pts:
        ax.annotate(p["label"], (p["values"][0], p["values"][1]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8, color="black" if p["front"] else "dimgrey")
    ax.set_xlabel(_wrapped(axis_label(ox.name, ox.direction)))
    ax.set_ylabel(_wrapped(axis_label(oy.name, oy.direction)))
    ax.set_title(title, fontsize=10)
    if pts:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no complete trials yet", ha="center", va="center", transform=ax.transAxes)
    return _save_png(fig, prefix.with_name(prefix.name + "-pareto-front.png"))


def _history(report: StudyReport, prefix: Path) -> Path:
    """One objective: its value per trial, the best highlighted."""
    o = report.objectives[0]
    pts = _complete_points(report)
    title = f"{report.study}: {o.name} per complete trial (best highlighted)"
    fig = _figure()
    ax = fig.add_subplot()
    for p in pts:
        ax.scatter([p["number"]], [p["values"][0]], c=FRONT if p["front"] else GREY, s=60 if p["front"] else 30)
        ax.annotate(p["label"], (p["number"], p["values"][0]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if not pts:
        ax.text(0.5, 0.5, "no complete trials yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("trial number")
    ax.set_ylabel(_wrapped(axis_label(o.name, o.direction)))
    ax.set_title(title, fontsize=10)
    return _save_png(fig, prefix.with_name(prefix.name + "-objective.png"))


# -- the anytime curve ----------------------------------------------------------------------

def _anytime(report: StudyReport, prefix: Path) -> Path:
    """The front's hypervolume (of the final front's) against trained trials and, where every trial has a
    fair time, against the fair seconds spent: still rising at the end means more trials would still help."""
    curve = report.anytime
    timed = bool(curve) and curve[-1].fair_seconds is not None
    fig = _figure(size=(11.0, 4.5) if timed else (7.5, 4.5))
    axes = fig.subplots(1, 2 if timed else 1, squeeze=False)[0]
    hv = [p.hypervolume for p in curve]
    axes[0].step([p.trials for p in curve], hv, where="post", c=FRONT)
    axes[0].set_xlabel("trained trials (in the order they ended)")
    if timed:
        axes[1].step([p.fair_seconds for p in curve], hv, where="post", c=FRONT)
        axes[1].set_xlabel("fair seconds trained (summed over workers)")
    for ax in axes:
        ax.set_ylabel("front hypervolume / final front's")
        ax.set_ylim(0, 1.05)
    if not curve:
        axes[0].text(0.5, 0.5, "no complete trials yet", ha="center", va="center", transform=axes[0].transAxes)
    fig.suptitle(f"{report.study}: the front's hypervolume as trials came in", fontsize=10)
    return _save_png(fig, prefix.with_name(prefix.name + "-anytime.png"))


# -- the rung check -------------------------------------------------------------------------

def _rung_rows(report: StudyReport) -> tuple[list, list, str, str]:
    """The rung figure's rows with a rho, those at a rung, its title and y label (`headsearch.search.rungcheck`)."""
    rows = [r for r in report.rung_check if r.rho is not None]
    n = max(r.n for r in report.rung_check)
    metric = report.primary_metric or "value"
    title = (f"{report.study}: do early ranks predict final ones? ({n} trials that ran to the end)\n"
             f"Spearman's rho of each epoch's best {metric} so far with the final {metric}; rungs marked")
    return rows, [r for r in rows if r.is_rung], title, f"Spearman's rho with the final {metric}"


def _rungs(report: StudyReport, prefix: Path) -> Path:
    """Spearman's rho against epoch, the pruner's rungs marked: a rung where rho is low prunes by chance."""
    from matplotlib.ticker import MaxNLocator

    rows, rungs, title, ylabel = _rung_rows(report)
    fig = _figure((7.5, 4.5))
    ax = fig.add_subplot()
    ax.axhline(0.0, color=GREY, lw=1)
    ax.plot([r.epoch for r in rows], [r.rho for r in rows], color="C0", marker=".", label="every epoch")
    if rungs:
        ax.scatter([r.epoch for r in rungs], [r.rho for r in rungs], color=FRONT, s=60, zorder=3, label="rung")
        for r in rungs:
            ax.annotate(f"{r.rho:.2f}", (r.epoch, r.rho), textcoords="offset points", xytext=(5, 6), fontsize=8)
        ax.legend(loc="lower right", fontsize=8)
    if not rows:
        ax.text(0.5, 0.5, "rho not known at any epoch (constant values)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return _save_png(fig, prefix.with_name(prefix.name + "-rungs.png"))


def _rungs_figure(report: StudyReport):
    """The rung check as a plotly figure (for the dashboard and the HTML file)."""
    import plotly.graph_objects as go

    rows, rungs, title, ylabel = _rung_rows(report)
    g = go.Figure()
    g.add_trace(go.Scatter(x=[r.epoch for r in rows], y=[r.rho for r in rows], mode="lines+markers", name="every epoch",
                           hovertext=[f"epoch {r.epoch}: rho {r.rho:.3f} over {r.n} trials" for r in rows], hoverinfo="text"))
    if rungs:
        g.add_trace(go.Scatter(x=[r.epoch for r in rungs], y=[r.rho for r in rungs], mode="markers", name="rung",
                               marker=dict(size=12, color=FRONT), hoverinfo="text",
                               hovertext=[f"rung at epoch {r.epoch}: rho {r.rho:.3f} over {r.n} trials" for r in rungs]))
    g.update_layout(title=title.replace("\n", "<br>"), xaxis_title="epoch", yaxis_title=ylabel, yaxis_range=[-1.05, 1.05],
                    template="plotly_white")
    return g


# -- learning curves ------------------------------------------------------------------------

def _curve_rows(study, report: StudyReport) -> tuple[list[dict[str, Any]], str, str]:
    """Each trial's intermediate values (duplicates left out), the title and the y label."""
    metric = report.primary_metric or "intermediate value"
    direction = next((o.direction for o in report.objectives if o.name == report.primary_metric), None)
    curves = []
    for t in study.get_trials(deepcopy=False):
        if not t.intermediate_values or t.user_attrs.get("duplicate_of") is not None:
            continue
        steps = sorted(t.intermediate_values)
        curves.append({"number": t.number, "state": trial_state(t), "arch": t.user_attrs.get("arch", ""),
                       "x": steps, "y": [t.intermediate_values[s] for s in steps],
                       "pruned": t.user_attrs.get("pruned")})
    title = f"{report.study}: learning curves\nvalidation {metric} per epoch; pruned trials dashed, x = where pruned"
    ylabel = axis_label(metric, direction) if report.primary_metric else "intermediate value"
    return curves, title, ylabel


def _curves(rows: tuple[list[dict[str, Any]], str, str], prefix: Path) -> Path:
    curves, title, ylabel = rows
    fig = _figure((8.5, 5.0))
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(curves))]
    for c, color in zip(curves, colors):
        label = f"{c['number']}: {c['arch']} ({c['state']})" if len(curves) <= 20 else None
        ax.plot(c["x"], c["y"], ls=STATE_STYLE.get(c["state"], "-"), color=color, lw=1.4, marker=".", ms=4, label=label)
        if c["state"] == "pruned":
            ax.plot([c["x"][-1]], [c["y"][-1]], marker="x", color=color, ms=9, mew=2, ls="none")
        ax.annotate(str(c["number"]), (c["x"][-1], c["y"][-1]), textcoords="offset points", xytext=(5, 0),
                    fontsize=7, color=color)
    if not curves:
        ax.text(0.5, 0.5, "no intermediate values yet", ha="center", va="center", transform=ax.transAxes)
    elif len(curves) <= 20:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), title="trial: architecture (state)",
                  title_fontsize=7)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    epochs = sorted({x for c in curves for x in c["x"]})
    if epochs and len(epochs) <= 30:
        ax.set_xticks(epochs)
    return _save_png(fig, prefix.with_name(prefix.name + "-learning-curves.png"))


def _curves_figure(rows: tuple[list[dict[str, Any]], str, str]):
    """The learning curves as a plotly figure (for the dashboard and the HTML file)."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative

    curves, title, ylabel = rows
    palette = qualitative.Plotly
    g = go.Figure()
    for i, c in enumerate(curves):
        color = palette[i % len(palette)]
        hover = [f"trial {c['number']} ({c['state']})<br>{c['arch']}<br>epoch {x}: {y:.4g}" for x, y in zip(c["x"], c["y"])]
        g.add_trace(go.Scatter(x=c["x"], y=c["y"], mode="lines+markers", name=f"{c['number']}: {c['arch']} ({c['state']})",
                               line=dict(dash=PLOTLY_DASH.get(c["state"], "solid"), color=color), hovertext=hover, hoverinfo="text",
                               legendgroup=str(c["number"])))
        if c["state"] == "pruned":
            g.add_trace(go.Scatter(x=[c["x"][-1]], y=[c["y"][-1]], mode="markers", showlegend=False,
                                   marker=dict(symbol="x", size=12, color=color),
                                   legendgroup=str(c["number"]), hoverinfo="text",
                                   hovertext=[f"trial {c['number']} pruned at epoch {c['x'][-1]}"]))
    g.update_layout(title=title.replace("\n", "<br>"), xaxis_title="epoch", yaxis_title=ylabel, template="plotly_white")
    return g


# -- parameter importances ------------------------------------------------------------------

def _importances(report: StudyReport, prefix: Path) -> Path:
    imps = report.importances
    n = max(1, len(imps))
    title = f"{report.study}: parameter importances per objective (PED-ANOVA, normalised)"
    fig = _figure((7.5, 2.2 + 2.0 * n))
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, imp in zip(axes, imps):
        ax.set_title(f"{imp.objective}", fontsize=9)
        if imp.error or not imp.importances:
            ax.text(0.5, 0.5, f"not computed: {imp.error}", ha="center", va="center", transform=ax.transAxes,
                    fontsize=8, wrap=True)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        items = sorted(imp.importances.items(), key=lambda kv: kv[1])
        ax.barh([k for k, _ in items], [v for _, v in items], color="C0")
        ax.set_xlabel(f"importance for {imp.objective} (fraction of total)")
        ax.set_xlim(0, max(1e-9, max(v for _, v in items)) * 1.1)
    fig.suptitle(title, fontsize=10)
    return _save_png(fig, prefix.with_name(prefix.name + "-param-importances.png"))


def write_compare_curves(result: dict[str, Any], path: Path) -> Path:
    """`headsearch compare`'s figure: per config, the mean validation curve over its seeds with a band of
    one standard deviation (the seeds that reached each epoch), from `compare.comparison`'s result."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    fig = _figure((7, 4.2))
    ax = fig.subplots()
    for i, c in enumerate(result["configs"]):
        curves = [{int(e): v for e, v in r["curve"].items()} for r in c["runs"] if r.get("curve")]  # JSON keys are str
        if not curves:
            continue
        epochs = sorted({e for curve in curves for e in curve})
        values = [[float(curve[e]) for curve in curves if e in curve] for e in epochs]
        mean = np.array([np.mean(v) for v in values])
        std = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values])
        color = f"C{i % 10}"
        ax.plot(epochs, mean, color=color, label=f"{c['name']} ({len(curves)} seeds)")
        ax.fill_between(epochs, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(result.get("curve_metric", "validation metric").replace("_", " ") + " (mean ± std over seeds)")
    ax.set_title(f"{result['study']}: validation curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    tmp = _save_png(fig, path.with_name(path.name + ".tmp.png"))
    tmp.replace(path)  # whole or absent
    return path
