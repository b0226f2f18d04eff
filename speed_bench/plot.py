"""Charts and comparisons of ds4-bench CSVs.

`plot_runs`: prefill t/s (top panel) and generation t/s (bottom panel) against context size, one
line per run, legends from the CSV header (model + backend) or the file name. A single run gets
the classic one-panel, two-axis layout of tooling-spec §6.3 (blue prefill left, red generation right).

`compare_runs`: per-frontier ratios B/A of prefill and generation t/s over the frontiers both
runs measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .csvio import BenchRun

PREFILL_COLOR = "#2563eb"
GEN_COLOR = "#dc2626"


def _k_label(x: float, _pos=None) -> str:
    if x >= 1000 and x % 1024 == 0:
        return f"{int(x // 1024)}k"
    if x >= 1000:
        return f"{x / 1000:g}k"
    return f"{int(x)}"


def title_from_name(stem: str) -> str:
    """`m2_ultra` → `M2 Ultra t/s` (words like m3 upper-cased, the rest capitalised)."""
    words = [w for w in stem.replace("-", "_").split("_") if w]
    out = []
    for w in words:
        if (len(w) <= 3 and any(c.isdigit() for c in w)) or w.lower() in ("cpu", "gpu", "cuda", "kv"):
            out.append(w.upper())
        else:
            out.append(w.capitalize())
    return " ".join(out) + " t/s"


def plot_runs(runs: list[BenchRun], out: str | os.PathLike, title: str | None = None,
              width: int = 960, height: int = 540) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from ds4.quality.kld import _save_fig_atomic

    for r in runs:
        if len(r.rows) < 2:
            raise ValueError(f"{r.path or r.label}: a chart needs at least 2 rows")
    dpi = 100
    if title is None:
        title = title_from_name(runs[0].path.stem) if len(runs) == 1 and runs[0].path else "ds4-bench t/s"
    if len(runs) == 1:
        run = runs[0]
        rows = sorted(run.rows, key=lambda r: r.ctx_tokens)
        ctx = [r.ctx_tokens for r in rows]
        fig, ax = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
        ax.plot(ctx, [r.prefill_tps for r in rows], color=PREFILL_COLOR, lw=3, marker="o", ms=4, label="prefill")
        ax.set_ylabel("prefill t/s", color=PREFILL_COLOR)
        ax.set_ylim(0, max(r.prefill_tps for r in rows) * 1.05 or 1)
        ax2 = ax.twinx()
        ax2.plot(ctx, [r.gen_tps for r in rows], color=GEN_COLOR, lw=3, marker="o", ms=4, label="generation")
        ax2.set_ylabel("generation t/s", color=GEN_COLOR)
        ax2.set_ylim(0, max(r.gen_tps for r in rows) * 1.05 or 1)
        ax.set_xlim(0, ctx[-1])
        ax.grid(axis="y", alpha=0.3)
        ax.set_xlabel("ctx size")
        ax.xaxis.set_major_formatter(FuncFormatter(_k_label))
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right")
        ax.set_title(f"{title}\n{run.label}", fontsize=11)
    else:
        fig, (ax_p, ax_g) = plt.subplots(2, 1, sharex=True, figsize=(width / dpi, height * 1.5 / dpi), dpi=dpi)
        xmax = 0
        for i, run in enumerate(runs):
            rows = sorted(run.rows, key=lambda r: r.ctx_tokens)
            ctx = [r.ctx_tokens for r in rows]
            xmax = max(xmax, ctx[-1])
            color = f"C{i % 10}"
            ax_p.plot(ctx, [r.prefill_tps for r in rows], color=color, lw=2, marker="o", ms=3, label=run.label)
            ax_g.plot(ctx, [r.gen_tps for r in rows], color=color, lw=2, marker="o", ms=3, label=run.label)
        for ax, name in ((ax_p, "prefill t/s"), (ax_g, "generation t/s")):
            ax.set_ylabel(name)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=9)
        ax_g.set_xlim(0, xmax)
        ax_g.set_xlabel("ctx size")
        ax_g.xaxis.set_major_formatter(FuncFormatter(_k_label))
        ax_p.set_title(title)
    fig.tight_layout()
    _save_fig_atomic(fig, out)
    plt.close(fig)


@dataclass
class RatioRow:
    ctx_tokens: int
    prefill_a: float
    prefill_b: float
    gen_a: float
    gen_b: float

    @property
    def prefill_ratio(self) -> float:
        return self.prefill_b / self.prefill_a if self.prefill_a else float("nan")

    @property
    def gen_ratio(self) -> float:
        return self.gen_b / self.gen_a if self.gen_a else float("nan")


def compare_runs(a: BenchRun, b: BenchRun) -> list[RatioRow]:
    by_ctx = {r.ctx_tokens: r for r in b.rows}
    out = [RatioRow(r.ctx_tokens, r.prefill_tps, by_ctx[r.ctx_tokens].prefill_tps, r.gen_tps,
                    by_ctx[r.ctx_tokens].gen_tps)
           for r in sorted(a.rows, key=lambda r: r.ctx_tokens) if r.ctx_tokens in by_ctx]
    if not out:
        raise ValueError("the two runs share no frontier (ctx_tokens)")
    return out


def format_comparison(a: BenchRun, b: BenchRun, rows: list[RatioRow], markdown: bool = False) -> str:
    la, lb = a.label, b.label
    head = ["ctx", "prefill A", "prefill B", "B/A", "gen A", "gen B", "B/A"]
    body = [[f"{r.ctx_tokens}", f"{r.prefill_a:.2f}", f"{r.prefill_b:.2f}", f"{r.prefill_ratio:.3f}",
             f"{r.gen_a:.2f}", f"{r.gen_b:.2f}", f"{r.gen_ratio:.3f}"] for r in rows]
    import statistics
    gm = lambda xs: statistics.geometric_mean([x for x in xs if x > 0]) if any(x > 0 for x in xs) else float("nan")  # noqa: E731
    foot = ["geomean", "", "", f"{gm([r.prefill_ratio for r in rows]):.3f}", "", "",
            f"{gm([r.gen_ratio for r in rows]):.3f}"]
    lines = [f"A: {la}" + (f"  [{a.path}]" if a.path else ""), f"B: {lb}" + (f"  [{b.path}]" if b.path else ""), ""]
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---:|" * len(head))
        for row in body + [foot]:
            lines.append("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(x[i]) for x in [head] + body + [foot]) for i in range(len(head))]
        for row in [head] + body + [foot]:
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    return "\n".join(lines) + "\n"
