"""Steering sweeps (tooling-spec §8.3): greedy generations for each eval prompt at a list of FFN scales,
scored by a metric (response length in tokens by default), reported as a table, CSV and a chart."""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4.atomic import atomic_write, save_figure_atomic
from ds4.steering.apply import Steering, SteeringDirection, make_hooks
from ds4.steering.build import render_prompt
from ds4.steering.format import DirectionSet
from ds4.steering.run import Generation, generate_greedy

DEFAULT_SCALES = (-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0)
METRICS = {
    "tokens": lambda g: len(g.tokens),
    "words": lambda g: len(g.text.split()),
    "chars": lambda g: len(g.text),
}


@dataclass
class SweepRow:
    prompt: str
    scale: float
    value: float
    stopped: bool
    text: str


def parse_scales(text: str) -> list[float]:
    try:
        scales = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--scales must be a comma list of numbers, got {text!r}") from None
    if not scales:
        raise ValueError("--scales is empty")
    if any(not -100.0 <= s <= 100.0 for s in scales):
        raise ValueError("steering scales must be in [-100, 100]")
    return scales


def run_sweep(model, directions: DirectionSet, prompts: list[str], scales: list[float], *, tokens: int = 160,
              ctx: int = 4096, attn_scale: float = 0.0, thinking: bool = False, system: str = "",
              metric: str = "tokens", progress: bool = True, on_row=None) -> list[SweepRow]:
    from tqdm import tqdm

    score = METRICS[metric]
    rows = []
    bar = tqdm(total=len(prompts) * len(scales), unit="gen", disable=not progress, desc="sweep", dynamic_ncols=True)
    try:
        for prompt in prompts:
            ids = model.tokenizer.encode_chat(render_prompt(prompt, system, thinking))
            for s in scales:
                steering = Steering([SteeringDirection(directions, attn_scale, s)])
                hooks = make_hooks(steering) if steering.active() else None
                gen: Generation = generate_greedy(model, ids, tokens, hooks, ctx)
                row = SweepRow(prompt, s, float(score(gen)), gen.stopped, gen.text)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                bar.update(1)
    finally:
        bar.close()
    return rows


def table_text(rows: list[SweepRow], metric: str = "tokens") -> str:
    """Prompts as rows, scales as columns, plus the mean per scale."""
    scales = sorted({r.scale for r in rows})
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    value = {(r.prompt, r.scale): r.value for r in rows}
    width = max(8, *(len(f"{s:g}") + 2 for s in scales))
    head = f"{'prompt':<42}" + "".join(f"{f'ffn {s:g}':>{width + 4}}" for s in scales)
    lines = [f"metric: {metric} per response", head, "-" * len(head)]
    for p in prompts:
        short = p if len(p) <= 40 else p[:37] + "..."
        lines.append(f"{short:<42}" + "".join(f"{value.get((p, s), float('nan')):>{width + 4}.0f}" for s in scales))
    lines.append("-" * len(head))
    means = [np.mean([value[(p, s)] for p in prompts if (p, s) in value]) for s in scales]
    lines.append(f"{'mean':<42}" + "".join(f"{m:>{width + 4}.1f}" for m in means))
    return "\n".join(lines)


def write_csv(path: str | os.PathLike, rows: list[SweepRow], metric: str = "tokens") -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["prompt", "ffn_scale", metric, "stopped", "text"])
    for r in rows:
        w.writerow([r.prompt, f"{r.scale:g}", f"{r.value:g}", int(r.stopped), r.text])
    atomic_write(path, lambda p: p.write_text(buf.getvalue(), encoding="utf-8"))


def plot_sweep(path: str | os.PathLike, rows: list[SweepRow], metric: str = "tokens", title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({r.scale for r in rows})
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for p in prompts:
        pts = sorted((r.scale, r.value) for r in rows if r.prompt == p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", alpha=0.45, lw=1,
                label=p if len(p) <= 40 else p[:37] + "...")
    means = [np.mean([r.value for r in rows if r.scale == s]) for s in scales]
    ax.plot(scales, means, color="black", lw=2.5, marker="s", label="mean")
    ax.axvline(0.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("FFN steering scale (negative amplifies the direction, positive removes it)")
    ax.set_ylabel(f"response length ({metric})")
    ax.set_title(title or "steering sweep")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    save_figure_atomic(fig, path, format="png", dpi=100)
    plt.close(fig)
    return path
