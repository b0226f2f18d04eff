"""`ds4-quality compare`: several result files in one table (CSV and Markdown) and a bar chart.

Inputs are score TSVs (`ds4-quality score`) and KLD JSONs (`ds4-quality kld --json`); each kind
gets its own columns. Rows keep the command-line order (typically f16 → q8_0 → q4 → q2).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ds4.test_vectors.formats import write_text_atomic

from .metrics import ScoreFormatError, read_scores, summarize

KLD_COLUMNS = [("mean KLD", "kld_mean"), ("±", "kld_mean_err"), ("median KLD", "kld_p50"),
               ("99% KLD", "kld_p99"), ("max KLD", "kld_max"), ("same top %", "same_top"),
               ("RMS Δp %", "dp_rms"), ("PPL(Q)/PPL(base)", "ppl_ratio"), ("PPL(Q)", "ppl_test"),
               ("PPL(base)", "ppl_base"), ("tokens", "tokens")]
SCORE_COLUMNS = ["cases", "tokens", "avg_nll", "first_match", "avg_lcp"]


class CompareError(ValueError):
    pass


def load_result(path: str) -> tuple[str, str, dict]:
    """(kind, label, flat values) for one result file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise CompareError(f"{path}: {e.strerror}") from None
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CompareError(f"{path}: malformed JSON ({e.msg})") from None
        if data.get("kind") != "ds4-quality-kld" or "stats" not in data:
            raise CompareError(f"{path}: not a ds4-quality kld result")
        return "kld", str(data.get("label") or p.stem), data["stats"]
    try:
        s = summarize(read_scores(p))
    except ScoreFormatError as e:
        raise CompareError(str(e)) from None
    return "score", p.stem, {"cases": s.cases, "tokens": s.tokens, "avg_nll": s.avg_nll,
                             "first_match": s.first_match, "avg_lcp": s.avg_lcp}


def _fmt(key: str, v) -> str:
    if key in ("same_top", "dp_rms"):
        return f"{100 * v:.3f}"
    if isinstance(v, int) or key in ("tokens", "cases", "first_match"):
        return str(int(v))
    return f"{v:.6f}"


def build_table(results: list[tuple[str, str, dict]]) -> tuple[list[str], list[list[str]]]:
    kinds = {k for k, _, _ in results}
    head = ["model"]
    if "kld" in kinds:
        head += [name for name, _ in KLD_COLUMNS]
    if "score" in kinds:
        head += [f"score {c}" for c in SCORE_COLUMNS]
    rows = []
    for kind, label, vals in results:
        row = [label]
        if "kld" in kinds:
            row += [_fmt(key, vals[key]) if kind == "kld" else "" for _, key in KLD_COLUMNS]
        if "score" in kinds:
            row += [_fmt(c, vals[c]) if kind == "score" else "" for c in SCORE_COLUMNS]
        rows.append(row)
    return head, rows


def markdown(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def bar_chart(results: list[tuple[str, str, dict]], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .kld import _save_fig_atomic

    panels = []
    kld = [(lab, v) for k, lab, v in results if k == "kld"]
    sc = [(lab, v) for k, lab, v in results if k == "score"]
    if kld:
        panels.append(("mean KLD (nats)", [l for l, _ in kld], [v["kld_mean"] for _, v in kld],
                       [v["kld_mean_err"] for _, v in kld]))
        panels.append(("same top token (%)", [l for l, _ in kld], [100 * v["same_top"] for _, v in kld],
                       [100 * v["same_top_err"] for _, v in kld]))
    if sc:
        panels.append(("avg NLL (nats/token)", [l for l, _ in sc], [v["avg_nll"] for _, v in sc], None))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), dpi=110, squeeze=False)
    for ax, (title, labels, vals, errs) in zip(axes[0], panels):
        ax.bar(range(len(vals)), vals, yerr=errs, color=[f"C{i % 10}" for i in range(len(vals))], capsize=3)
        ax.set_xticks(range(len(vals)), labels, rotation=30, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save_fig_atomic(fig, out)
    plt.close(fig)


def compare_files(files: list[str], csv_out: str | None = None, md_out: str | None = None,
                  chart: str | None = None, stdout=None) -> str:
    import sys
    results = [load_result(f) for f in files]
    head, rows = build_table(results)
    md = markdown(head, rows)
    (stdout or sys.stdout).write(md)
    if csv_out:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(head)
        w.writerows(rows)
        write_text_atomic(csv_out, buf.getvalue())
    if md_out:
        write_text_atomic(md_out, md)
    if chart:
        bar_chart(results, chart)
    return md
