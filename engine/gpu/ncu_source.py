"""`python -m ds4.engine.gpu.ncu_source FILE.csv`: a summary of Nsight Compute's source page of one kernel
(`ncu ... --section SourceCounters --page source --csv --print-source sass > FILE.csv`): the sampled warp stalls
summed over the whole kernel by reason, and the instructions that hold the most samples, each with its SASS, so a
device call can print where a kernel's time goes in a few lines."""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter


def _rows(path: str) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="", errors="replace") as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    table = list(csv.reader(lines))
    start = next((i for i, r in enumerate(table) if any("Source" == c.strip() for c in r)), None)
    if start is None:
        raise ValueError(f"{path}: no source table (a header with a 'Source' column)")
    return [c.strip() for c in table[start]], [r for r in table[start + 1:] if len(r) == len(table[start])]


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(path: str, top: int) -> str:
    head, rows = _rows(path)
    src = head.index("Source")
    total_col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    if total_col is None:
        raise ValueError(f"{path}: no 'Warp Stall Sampling (All Samples)' column")
    stall_cols = [i for i, h in enumerate(head) if h.startswith("stall_") or h.endswith("(Stall)")]
    inst_col = next((i for i, h in enumerate(head) if h.startswith("Instructions Executed")), None)
    total = sum(_num(r[total_col]) for r in rows) or 1.0
    out = [f"{len(rows)} SASS lines, {total:.0f} samples"
           + (f", {sum(_num(r[inst_col]) for r in rows):.3g} warp instructions" if inst_col is not None else "")]
    by_reason = Counter({head[i]: sum(_num(r[i]) for r in rows) for i in stall_cols})
    if by_reason:
        out.append("stalls: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(10) if v))
    ranked = sorted(range(len(rows)), key=lambda i: -_num(rows[i][total_col]))[:top]
    acc = 0.0
    for i in ranked:
        r = rows[i]
        acc += _num(r[total_col])
        why = sorted(((head[c], _num(r[c])) for c in stall_cols), key=lambda kv: -kv[1])[:2]
        why_s = " ".join(f"{k.replace('stall_', '')}={v:.0f}" for k, v in why if v)
        out.append(f"{i:6d} {100 * _num(r[total_col]) / total:5.1f}% (cum {100 * acc / total:5.1f}%)  "
                   f"{r[src].strip()[:70]:<70} {why_s}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=30, help="instructions to list (default 30)")
    args = ap.parse_args(argv)
    try:
        print(summarize(args.csv, args.top))
    except (OSError, ValueError) as e:
        print(f"ncu_source: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
