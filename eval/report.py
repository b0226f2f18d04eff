"""ds4-eval's final report (tooling-spec §7.5): the summary line, the per-case table, per-source
totals, and the same data as JSON (`--report-json`)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

from ds4.atomic import atomic_write

from .runner import ERROR, FAILED, PASSED, SKIPPED, STOPPED, CaseResult


def hhmm(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60:02d}h:{minutes % 60:02d}m"


def per_source(results: list[CaseResult]) -> "OrderedDict[str, dict]":
    totals: OrderedDict[str, dict] = OrderedDict()
    for r in results:
        t = totals.setdefault(r.question.source, {"total": 0, "passed": 0, "failed": 0,
                                                   "skipped": 0, "unfinished": 0})
        t["total"] += 1
        if r.state == PASSED:
            t["passed"] += 1
        elif r.state in (FAILED, ERROR):
            t["failed"] += 1
        elif r.state == SKIPPED:
            t["skipped"] += 1
        else:
            t["unfinished"] += 1
    return totals


def render_report(results: list[CaseResult], runtime: float) -> str:
    passed = sum(r.state == PASSED for r in results)
    failed = sum(r.state in (FAILED, ERROR) for r in results)
    head = f"ds4-eval: {passed}/{len(results)} passed"
    if failed:
        head += f", {failed} failed"
    lines = [head + f", runtime {hhmm(runtime)}", "",
             "#   state    prompt      gen    total given    correct  test"]
    for i, r in enumerate(results, 1):
        lines.append("%3d %-8s %8d %8d %8d %-8s %-8s %s/%s" % (
            i, r.state, r.prompt_tokens, r.generated, r.total_tokens, r.picked or "-",
            r.question.answer, r.question.source, r.question.id))
    lines += ["", "source             passed   failed  skipped  unfinished  total    score"]
    for source, t in per_source(results).items():
        graded = t["passed"] + t["failed"]
        score = f"{100.0 * t['passed'] / graded:5.1f}%" if graded else "    -"
        lines.append(f"{source[:18]:<18} {t['passed']:6d} {t['failed']:8d} {t['skipped']:8d} "
                     f"{t['unfinished']:11d} {t['total']:6d}   {score}")
    return "\n".join(lines) + "\n"


def report_dict(results: list[CaseResult], runtime: float, meta: dict) -> dict:
    return {
        "meta": meta,
        "runtime_sec": round(runtime, 3),
        "passed": sum(r.state == PASSED for r in results),
        "failed": sum(r.state in (FAILED, ERROR) for r in results),
        "stopped": sum(r.state == STOPPED for r in results),
        "total": len(results),
        "per_source": per_source(results),
        "cases": [{
            "position": i, "index": r.question.index, "id": r.question.id,
            "source": r.question.source, "domain": r.question.domain, "state": r.state,
            "prompt_tokens": r.prompt_tokens, "generated_tokens": r.generated,
            "given": r.picked or None, "correct": r.question.answer,
            "passed": r.state == PASSED, "elapsed_sec": round(r.elapsed, 3),
            "think_close": r.progress.think_close if r.progress else "none",
            "error": r.error or None,
        } for i, r in enumerate(results, 1)],
    }


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write to a temp file in the same folder, then rename (never a half-written file)."""
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
