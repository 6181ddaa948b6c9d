"""`headsearch analyze RUN_DIR`: diversity, importance, ablation, pruning curve and attention maps of a trained run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


from headsearch.errors import HeadsearchError
from headsearch.io import write_atomic
from headsearch.jsonsafe import json_safe
from headsearch.tasks import DataSource, PatchAttention, TokenAttention, get_task, resolve_config

ANALYSIS_DIR = "analysis"


def load_run(run_dir: Path, source: DataSource, device, samples: int | None = None):
    """(task, cfg, bound, model) for a run directory written by `headsearch train` or a search trial."""
    import torch

    from headsearch.config import load_yaml, path_problem
    from headsearch.training.rundir import load_checkpoint
    from headsearch.training.trainer import CHECKPOINT

    run_dir = Path(run_dir)
    if problem := path_problem(run_dir, "folder"):
        raise HeadsearchError(f"run directory {run_dir} {problem}: pass a folder written by headsearch train or run")
    if not (run_dir / "config.yaml").is_file() or not (run_dir / CHECKPOINT).is_file():
        raise HeadsearchError(
            f"{run_dir} is not a run directory: expected config.yaml and {CHECKPOINT} (written by headsearch train or run)"
        )
    if problem := path_problem(run_dir / CHECKPOINT, "file"):  # e.g. unreadable: not to be called "corrupt" below
        raise HeadsearchError(f"{run_dir / CHECKPOINT} {problem}: fix its permissions or restore it")
    d = load_yaml(run_dir / "config.yaml")
    task = get_task(str(d.get("task")))
    cfg = resolve_config(task, config=d)
    task.check_source(source)
    bound = task.setup(cfg, source, device, run_dir=run_dir).with_eval_limit(samples)
    model = bound.build_model().to(device)
    try:
        state = load_checkpoint(run_dir / CHECKPOINT)
    except Exception as e:  # safetensors raises its own error type for a truncated or corrupt file
        raise HeadsearchError(f"{run_dir / CHECKPOINT} is truncated or corrupt ({' '.join(str(e).split())[:120]}):"
                              " retrain the run, or restore the file") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        # torch's first line only names the model; the next ones say which tensor differs.
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        detail = "; ".join(lines[1:3]) or lines[0]
        raise HeadsearchError(f"{run_dir / CHECKPOINT} does not match {run_dir / 'config.yaml'}: {detail}") from None
    model.eval()
    torch.manual_seed(cfg.seed)
    return task, cfg, bound, model


def analyze_run(run_dir: Path, source: DataSource, out_dir: Path | None = None, *, samples: int = 256,
                ablate: bool = True, device: str | None = None, progress=None) -> dict[str, Any]:
    """Compute everything and write analysis.json and PNG figures into `out_dir` (default RUN_DIR/analysis).
    Returns the analysis dict; its "figures" and "analysis_json" name the files written."""
    from headsearch.analysis import figures
    from headsearch.analysis.diversity import METRICS, analysis_batches, head_diversity
    from headsearch.analysis.importance import ablation, head_importance, pruning_curve
    from headsearch.training.runtime import resolve_device

    step = progress or (lambda message: None)
    dev = resolve_device(device)
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / ANALYSIS_DIR
    if out_dir.exists() and not out_dir.is_dir():
        raise HeadsearchError(f"--out {out_dir} is a file: pass a folder for analysis.json and the figures")
    task, cfg, bound, model = load_run(Path(run_dir), source, dev, samples)
    out_dir.mkdir(parents=True, exist_ok=True)
    metric = task.primary.name

    step("diversity")
    batches = analysis_batches(bound, "val", samples)
    diversity = head_diversity(model, batches)
    step("importance")
    importance = head_importance(model, batches, bound.summed_loss)

    evaluate = lambda: bound.evaluate(model, "val")  # noqa: E731  (ablation and pruning_curve run it under no_grad)
    ablated = None
    if ablate:
        step("ablation")
        ablated = ablation(model, evaluate, metric)
    step("pruning curve")
    curve = pruning_curve(model, importance, evaluate, metric)

    step("figures")
    paths = [
        figures.pairwise_heatmaps(diversity, "query_orthogonality", "query orthogonality  Σ|Q_i^T Q_j| / N  (high = less diverse)", out_dir / "query_orthogonality.png"),
        figures.pairwise_heatmaps(diversity, "context_nonorthogonality_normalized", "context non-orthogonality, normalised to [0, 1] (high = less diverse)", out_dir / "context_nonorthogonality.png"),
        figures.pairwise_heatmaps(diversity, "output_dissimilarity", "output dissimilarity  -cos(O_i, O_j)  (high = more diverse)", out_dir / "output_dissimilarity.png"),
        figures.importance_figure(importance.names, importance.importance, importance.entropy, out_dir / "head_importance.png"),
        figures.pruning_curve_figure(curve, metric, out_dir / "pruning_curve.png"),
    ]
    paths += attention_figures(bound.attention_views(model), out_dir)

    layers = [{"name": layer.name, "heads": layer.heads, "scalars": layer.scalars(),
               **{key: getattr(layer, key) for key in METRICS},
               "importance": importance.importance[i], "importance_raw": importance.raw[i],
               "entropy": importance.entropy[i],
               **({"ablation": ablated["per_head"][i]} if ablated is not None else {})}
              for i, layer in enumerate(diversity)]
    result = json_safe({
        "run_dir": str(Path(run_dir).resolve()), "task": task.name, "metric": metric, "split": "val",
        "samples": samples, "arch": cfg.arch.to_dict(), "layers": layers,
        "baseline": ablated["baseline"] if ablated else curve[0][metric],
        "pruning_curve": curve, "figures": [str(p) for p in paths],
    })
    write_atomic(out_dir / "analysis.json", json.dumps(result, indent=1) + "\n")
    result["analysis_json"] = str(out_dir / "analysis.json")
    return result


def attention_figures(views: list, out_dir: Path) -> list[Path]:
    """The figures of a task's attention views: patch-grid maps for image models, token-to-token maps."""
    from headsearch.analysis import figures, maps

    patches = [v for v in views if isinstance(v, PatchAttention)]
    tokens = [v for v in views if isinstance(v, TokenAttention)]
    paths = []
    for view in patches:
        paths += figures.vit_attention_figures(maps.patch_maps(view), out_dir)
    paths += figures.cross_attention_figures(tokens, out_dir)
    return paths
