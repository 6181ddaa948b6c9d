"""PNG figures for `headsearch analyze`: every axis labelled, layers and heads named."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

CLS_NOTE = "the CLS token's attention over the patch grid, on the image"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def short_name(name: str) -> str:
    """encoder.blocks.2.attn -> enc L2; decoder.blocks.0.cross_attn -> dec L0 cross."""
    parts = name.split(".")
    stack = {"encoder": "enc", "decoder": "dec"}.get(parts[0], parts[0])
    layer = parts[2] if len(parts) > 2 else "?"
    kind = {"self_attn": " self", "cross_attn": " cross"}.get(parts[-1], "")
    return f"{stack} L{layer}{kind}"


def pairwise_heatmaps(layers, metric: str, title: str, path: Path) -> Path:
    """One H x H heat map per attention layer for a pairwise diversity metric."""
    plt = _plt()
    n = len(layers)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.2 * rows), squeeze=False)
    for ax, layer in zip(axes.flat, layers):
        m = np.array(getattr(layer, metric), dtype=float)
        np.fill_diagonal(m, np.nan)  # i == j is 0 by definition; blank it so the colours span the pairs
        im = ax.imshow(m, cmap="viridis")
        ax.set_title(f"{short_name(layer.name)} ({layer.heads} heads)", fontsize=9)
        ax.set_xlabel("head j")
        ax.set_ylabel("head i")
        if layer.heads <= 16:
            ax.set_xticks(range(layer.heads))
            ax.set_yticks(range(layer.heads))
        fig.colorbar(im, ax=ax, fraction=0.046)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title)
    return _save(fig, path)


def importance_figure(names, importance, entropy, path: Path) -> Path:
    """Head importance (left) and attention entropy (right): rows = layers, columns = heads."""
    plt = _plt()
    width = max(len(v) for v in importance)
    grid = lambda vals: np.array([np.pad(np.asarray(v, float), (0, width - len(v)), constant_values=np.nan) for v in vals])  # noqa: E731
    fig, axes = plt.subplots(1, 2, figsize=(min(4 + 0.45 * width, 22) * 2, 1.2 + 0.45 * len(names)))
    for ax, data, label in ((axes[0], grid(importance), "importance (per-layer L2-normalised |dL/dξ|)"),
                            (axes[1], grid(entropy), "attention entropy (nats)")):
        im = ax.imshow(data, aspect="auto", cmap="magma")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([short_name(n) for n in names], fontsize=8)
        ax.set_xlabel("head")
        ax.set_ylabel("attention layer")
        ax.set_title(label)
        if width <= 32:
            ax.set_xticks(range(width))
        fig.colorbar(im, ax=ax, fraction=0.03)
    return _save(fig, path)


def pruning_curve_figure(curve: list[dict], metric: str, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    xs = [100 * p["fraction"] for p in curve]
    ax.plot(xs, [p[metric] for p in curve], marker="o")
    ax.set_xlabel("heads pruned (% of all heads, least important first)")
    ax.set_ylabel(f"validation {metric}")
    ax.set_title("How many heads are needed")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _image_panel(ax, image: np.ndarray, label: str) -> None:
    ax.imshow(image)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_ylabel(label, fontsize=9)


def _overlay(ax, image: np.ndarray, attn: np.ndarray) -> None:
    ax.imshow(image)
    h, w = image.shape[:2]
    ax.imshow(attn, cmap="jet", alpha=0.5, extent=(-0.5, w - 0.5, h - 0.5, -0.5), interpolation="bilinear")
    ax.set_xticks([])
    ax.set_yticks([])


def vit_attention_figures(maps, out_dir: Path, max_heads: int = 8) -> list[Path]:
    """Per sample: rows = layers, columns = the image, each head's CLS attention, and the rollout.
    With fusion, a second figure puts the soft-attention weights beside the self-attention weights."""
    plt = _plt()
    paths = []
    for s in range(len(maps.images)):
        layers = len(maps.cls_attention)
        heads = max(min(m.shape[1], max_heads) for m in maps.cls_attention)
        fig, axes = plt.subplots(layers, heads + 2, figsize=(1.6 * (heads + 2), 1.7 * layers), squeeze=False)
        for l, attn in enumerate(maps.cls_attention):
            _image_panel(axes[l, 0], maps.images[s], f"layer {l}")
            for h in range(heads):
                ax = axes[l, h + 1]
                if h < attn.shape[1]:
                    _overlay(ax, maps.images[s], attn[s, h])
                    if l == 0 or attn.shape[1] != maps.cls_attention[0].shape[1]:
                        ax.set_title(f"head {h}", fontsize=8)
                else:
                    ax.axis("off")
            ax = axes[l, heads + 1]
            if l == layers - 1:
                _overlay(ax, maps.images[s], maps.rollout[s])
                ax.set_title("rollout", fontsize=8)
            else:
                ax.axis("off")
        fig.suptitle(f"sample {s}: label {maps.labels[s]}, predicted {maps.predictions[s]} — {CLS_NOTE}", fontsize=9)
        paths.append(_save(fig, out_dir / f"attention_sample{s}.png"))
        if any(m is not None for m in maps.soft_attention):
            fig, axes = plt.subplots(layers, 3, figsize=(5.2, 1.8 * layers), squeeze=False)
            for l in range(layers):
                _image_panel(axes[l, 0], maps.images[s], f"layer {l}")
                _overlay(axes[l, 1], maps.images[s], maps.cls_attention[l][s].mean(0))
                _overlay(axes[l, 2], maps.images[s], maps.soft_attention[l][s].mean(0))
            axes[0, 1].set_title("self-attention", fontsize=9)
            axes[0, 2].set_title("soft attention", fontsize=9)
            fig.suptitle(f"sample {s} ({maps.labels[s]}): heads averaged", fontsize=9)
            paths.append(_save(fig, out_dir / f"soft_vs_self_sample{s}.png"))
    return paths


def cross_attention_figures(maps, out_dir: Path) -> list[Path]:
    """Per sentence: one panel per decoder layer (heads averaged), output tokens x source tokens."""
    plt = _plt()
    paths = []
    for s, m in enumerate(maps):
        n = len(m.layers)
        fig, axes = plt.subplots(1, n, figsize=(0.45 * len(m.source_tokens) * n + 2.5 * n, 0.4 * len(m.output_tokens) + 2.2), squeeze=False)
        for l, (ax, w) in enumerate(zip(axes[0], m.layers)):
            data = w.mean(0)[: len(m.output_tokens)]
            im = ax.imshow(data, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(m.source_tokens)))
            ax.set_xticklabels(m.source_tokens, rotation=60, ha="right", fontsize=8)
            ax.set_yticks(range(len(m.output_tokens)))
            ax.set_yticklabels(m.output_tokens, fontsize=8)
            ax.set_xlabel("source token")
            ax.set_ylabel("output token")
            ax.set_title(f"decoder layer {l} cross-attention ({w.shape[0]} heads averaged)", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.046)
        paths.append(_save(fig, out_dir / f"cross_attention_sample{s}.png"))
    return paths
