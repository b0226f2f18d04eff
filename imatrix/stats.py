"""Human report of an imatrix: tokens seen, expert coverage per layer, and a heat-map of expert usage."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ds4.atomic import save_figure_atomic

from ds4.imatrix.format import Imatrix

_ROUTED = re.compile(r"^blk\.(\d+)\.ffn_gate_exps\.weight$")


def routing_counts(im: Imatrix) -> np.ndarray | None:
    """[n_layer, n_expert] routing counts from the gate entries (GGUF files keep counts; a legacy .dat
    does not, and gives None)."""
    layers = {}
    for name, entry in im.entries.items():
        m = _ROUTED.match(name)
        if m:
            layers[int(m.group(1))] = entry.counts
    if not layers or all(c.size == 1 for c in layers.values()):
        return None
    n_layer = max(layers) + 1
    n_expert = max(c.size for c in layers.values())
    out = np.zeros((n_layer, n_expert), np.float64)
    for layer, c in layers.items():
        out[layer, : c.size] = c
    return out


def summary_lines(im: Imatrix) -> list[str]:
    lines = []
    kind = "partial (interrupted) " if im.partial else ""
    lines.append(f"{kind}imatrix: {len(im.entries)} entries, {im.tokens} tokens, {im.chunks} chunks"
                 + (f", dataset {im.datasets[0]}" if im.datasets else ""))
    counts = routing_counts(im)
    if counts is None:
        lines.append("no per-expert counts in this file (legacy .dat keeps importance only)")
        return lines
    lines.append(f"{'layer':>5} {'routed':>10} {'never':>6} {'min':>8} {'median':>8} {'max':>8}")
    for layer, row in enumerate(counts):
        total = row.sum()
        lines.append(f"{layer:>5} {int(total):>10} {int((row == 0).sum()):>6} {int(row.min()):>8} "
                     f"{int(np.median(row)):>8} {int(row.max()):>8}")
    never = int((counts == 0).sum())
    lines.append(f"experts never routed: {never} of {counts.size} (layer × expert)")
    return lines


def plot_heatmap(im: Imatrix, path: str | os.PathLike, title: str | None = None) -> Path:
    """PNG heat-map of routing share per layer (rows) and expert (columns); unseen experts stand out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = routing_counts(im)
    if counts is None:
        raise ValueError("the heat-map needs per-expert counts (a GGUF imatrix, or a fresh collection)")
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    n_layer, n_expert = counts.shape
    fig, ax = plt.subplots(figsize=(min(max(7.0, 4 + n_expert / 16), 24), 1.8 + n_layer * 0.22))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="red")
    img = ax.imshow(np.ma.masked_where(counts == 0, share), aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title or f"expert routing share per layer ({im.tokens} tokens; red = never routed)", fontsize=10)
    fig.colorbar(img, ax=ax, label="share of the layer's routed slots")
    fig.tight_layout()
    path = Path(path)
    save_figure_atomic(fig, path, format="png", dpi=100)
    plt.close(fig)
    return path
