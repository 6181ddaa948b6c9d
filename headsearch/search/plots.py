"""Plots of a study for `headsearch report --plots`: PNG (matplotlib, Agg) and HTML (plotly).

- the Pareto front on the first two objectives (front highlighted, dominated complete trials grey,
  points labelled with trial numbers); a single-objective study gets its objective per trial instead;
- learning curves: each trial's intermediate values (the primary validation metric per epoch),
  pruned trials dashed and ending with an x at the pruning epoch;
- parameter importances: one bar chart per objective.

`headsearch.search.artifacts.upload_plots` stores the files as Optuna artifacts of the study, so
optuna-dashboard shows them (it charts intermediate values of single-objective studies only; this
learning-curve plot covers multi-objective ones). Axis labels come from the objectives table
(`headsearch.search.objectives.axis_label`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from headsearch.errors import HeadsearchError
from headsearch.search.objectives import axis_label
from headsearch.search.report import StudyReport

GREY = "#b0b0b0"
FRONT = "#d62728"
STATE_STYLE = {"complete": "-", "pruned": "--", "failed": ":", "running": "-", "waiting": "-"}
PLOTLY_DASH = {"complete": "solid", "pruned": "dash", "failed": "dot", "running": "solid", "waiting": "solid"}


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


def write_plots(study, report: StudyReport, out_dir: Path) -> list[Path]:
    """Write PNG and HTML plots of `study` into `out_dir`; return the paths written."""
    check_plot_libraries()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise HeadsearchError(f"--plots {out_dir} is a file: pass a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / _safe(report.study)
    paths: list[Path] = []
    if len(report.objectives) >= 2:
        paths += _pareto(study, report, prefix)
    else:
        paths += _history(study, report, prefix)
    paths += _curves(study, report, prefix)
    paths += _importances(report, prefix)
    return paths


# -- data -----------------------------------------------------------------------------------

def _complete_points(study, report: StudyReport) -> list[dict[str, Any]]:
    """Complete trials (duplicates left out: they sit on their twin's point)."""
    from optuna.trial import TrialState

    front = {r.number: r.duplicates for r in report.front}
    pts = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.values is None or t.user_attrs.get("duplicate_of") is not None:
            continue
        dups = front.get(t.number, [])
        pts.append({"number": t.number, "values": list(t.values), "arch": t.user_attrs.get("arch", ""),
                    "front": t.number in front, "label": str(t.number) + "".join(f"={d}" for d in dups)})
    return pts


def _hover(p: dict[str, Any], report: StudyReport) -> str:
    vals = "<br>".join(f"{o.name}: {v:.4g}" for o, v in zip(report.objectives, p["values"]))
    return f"trial {p['number']}<br>{p['arch']}<br>{vals}"


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

def _pareto(study, report: StudyReport, prefix: Path) -> list[Path]:
    import plotly.graph_objects as go

    ox, oy = report.objectives[0], report.objectives[1]
    pts = _complete_points(study, report)
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
    ax.set_xlabel(axis_label(ox.name, ox.direction))
    ax.set_ylabel(axis_label(oy.name, oy.direction))
    ax.set_title(title, fontsize=10)
    if pts:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no complete trials yet", ha="center", va="center", transform=ax.transAxes)
    png = _save_png(fig, prefix.with_name(prefix.name + "-pareto-front.png"))

    g = go.Figure()
    for group, color, name, size in ((rest, GREY, "dominated", 8), (front, FRONT, "Pareto front", 12)):
        g.add_trace(go.Scatter(
            x=[p["values"][0] for p in group], y=[p["values"][1] for p in group],
            mode="markers+text" if group else "markers", text=[p["label"] for p in group],
            textposition="top right", marker=dict(color=color, size=size), name=name,
            hovertext=[_hover(p, report) for p in group], hoverinfo="text",
            line=dict(color=color) if group is front else None,
        ))
    if front and not more:
        g.data[-1].mode = "markers+text+lines"
    g.update_layout(title=title, xaxis_title=axis_label(ox.name, ox.direction),
                    yaxis_title=axis_label(oy.name, oy.direction), template="plotly_white")
    html = _save_html(g, prefix.with_name(prefix.name + "-pareto-front.html"), "headsearch-pareto-front")
    return [png, html]


def _history(study, report: StudyReport, prefix: Path) -> list[Path]:
    """One objective: its value per trial, the best highlighted."""
    import plotly.graph_objects as go

    o = report.objectives[0]
    pts = _complete_points(study, report)
    title = f"{report.study}: {o.name} per complete trial (best highlighted)"
    fig = _figure()
    ax = fig.add_subplot()
    for p in pts:
        ax.scatter([p["number"]], [p["values"][0]], c=FRONT if p["front"] else GREY, s=60 if p["front"] else 30)
        ax.annotate(p["label"], (p["number"], p["values"][0]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if not pts:
        ax.text(0.5, 0.5, "no complete trials yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("trial number")
    ax.set_ylabel(axis_label(o.name, o.direction))
    ax.set_title(title, fontsize=10)
    png = _save_png(fig, prefix.with_name(prefix.name + "-objective.png"))
    g = go.Figure(go.Scatter(
        x=[p["number"] for p in pts], y=[p["values"][0] for p in pts], mode="markers+text",
        text=[p["label"] for p in pts], textposition="top right",
        marker=dict(color=[FRONT if p["front"] else GREY for p in pts], size=[12 if p["front"] else 8 for p in pts]),
        hovertext=[_hover(p, report) for p in pts], hoverinfo="text", name=o.name))
    g.update_layout(title=title, xaxis_title="trial number", yaxis_title=axis_label(o.name, o.direction),
                    template="plotly_white")
    html = _save_html(g, prefix.with_name(prefix.name + "-objective.html"), "headsearch-objective")
    return [png, html]


# -- learning curves ------------------------------------------------------------------------

def _curves(study, report: StudyReport, prefix: Path) -> list[Path]:
    import plotly.graph_objects as go

    from headsearch.search.report import trial_state

    metric = report.primary_metric or "intermediate value"
    direction = None
    for o in report.objectives:
        if o.name == report.primary_metric:
            direction = o.direction
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
    png = _save_png(fig, prefix.with_name(prefix.name + "-learning-curves.png"))

    from plotly.colors import qualitative

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
    html = _save_html(g, prefix.with_name(prefix.name + "-learning-curves.html"), "headsearch-learning-curves")
    return [png, html]


# -- parameter importances ------------------------------------------------------------------

def _importances(report: StudyReport, prefix: Path) -> list[Path]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

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
    png = _save_png(fig, prefix.with_name(prefix.name + "-param-importances.png"))

    g = make_subplots(rows=n, cols=1, subplot_titles=[i.objective for i in imps] or ["-"])
    for row, imp in enumerate(imps, start=1):
        if imp.error or not imp.importances:
            g.add_annotation(text=f"not computed: {imp.error}", showarrow=False, row=row, col=1,
                             xref=f"x{row if row > 1 else ''} domain", yref=f"y{row if row > 1 else ''} domain", x=0.5, y=0.5)
            continue
        items = sorted(imp.importances.items(), key=lambda kv: kv[1])
        g.add_trace(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h", name=imp.objective,
                           showlegend=False), row=row, col=1)
        g.update_xaxes(title_text=f"importance for {imp.objective} (fraction of total)", row=row, col=1)
    g.update_layout(title=title, template="plotly_white", height=250 + 220 * n)
    html = _save_html(g, prefix.with_name(prefix.name + "-param-importances.html"), "headsearch-param-importances")
    return [png, html]


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
