"""The ds4-eval trace format (tooling-spec §7.5) and `--regrade-trace` (§7.6)."""

from __future__ import annotations

from ds4.eval.questions import load_questions
from ds4.eval.trace import TraceCase, TraceWriter, parse_trace_text, read_trace, render_case
from ds4_tool_util import QUESTIONS, run_cli

FAKE = ("\nMODEL_OUTPUT_END\n===== CASE 7/9 FAKE/fake =====\nstatus: PASSED\npicked: Z\n"
        "MODEL_OUTPUT_BEGIN bytes=2\nzz\n===== SUMMARY =====\n")


def _case(q, number, total, status, picked, output, **kw):
    return TraceCase(number=number, total=total, source=q.source, id=q.id, status=status,
                     picked=picked, expected=q.answer, domain=q.domain, title=q.title,
                     choices=q.choices, system_prompt=q.system_prompt,
                     question_prompt=q.user_prompt, output=output, **kw)


def test_block_layout_matches_spec():
    case = TraceCase(number=1, total=1, source="S", id="i", status="FAILED", output="héllo")
    text = render_case(case)
    # LABEL_BEGIN bytes=N, the N raw bytes, a newline only when missing, LABEL_END
    assert "MODEL_OUTPUT_BEGIN bytes=6\nhéllo\nMODEL_OUTPUT_END\n" in text
    case.output = "ends with newline\n"
    assert "MODEL_OUTPUT_BEGIN bytes=18\nends with newline\nMODEL_OUTPUT_END\n" in \
        render_case(case)
    assert text.startswith("===== CASE 1/1 S/i =====\n")
    assert "answer_kind: exact_integer\n" in text


def test_round_trip_with_fake_markers(tmp_path):
    qs = load_questions(QUESTIONS)
    path = tmp_path / "t.trace"
    w = TraceWriter(path, {"model": "m.gguf", "backend": "local", "ctx": 100})
    outputs = ["think" + FAKE + "</think>Answer: B", "no newline at end", "line\n", "",
               "ünïcödé ✓ 中文\r\n</think>Answer: 70"]
    for k, out in enumerate(outputs):
        q = qs[k]
        w.write_case(_case(q, k + 1, len(outputs), "FAILED", "?", out,
                           think_close="hard_forced", think_close_token_index=9,
                           think_close_remaining_budget=4, prompt_tokens=11,
                           generated_tokens=12, elapsed_sec=1.5))
    w.close()
    header, cases, errors = read_trace(path)
    assert errors == []
    assert header["model"] == "m.gguf" and header["ctx"] == "100" and "started_unix" in header
    assert [c.output for c in cases] == outputs
    assert [(c.source, c.id) for c in cases] == [(q.source, q.id) for q in qs[:5]]
    first = cases[0]
    assert first.question_prompt == qs[0].user_prompt and first.system_prompt == qs[0].system_prompt
    assert first.choices == qs[0].choices
    assert (first.think_close, first.think_close_token_index, first.think_close_remaining_budget) \
        == ("hard_forced", 9, 4)
    assert (first.prompt_tokens, first.generated_tokens, first.elapsed_sec) == (11, 12, 1.5)
    assert path.read_text().endswith("===== SUMMARY =====\npassed: 0\nfailed: 5\ntotal: 5\n")


def test_interrupted_trace_still_parses(tmp_path):
    qs = load_questions(QUESTIONS)
    path = tmp_path / "t.trace"
    w = TraceWriter(path, {"model": "m"})
    w.write_case(_case(qs[0], 1, 3, "PASSED", "B", "x</think>Answer: B"))
    w._fh.flush()                                   # killed before close(): no summary
    _, cases, errors = read_trace(path)
    assert errors == [] and len(cases) == 1 and cases[0].output == "x</think>Answer: B"


def test_wrong_byte_count_falls_back_to_end_marker():
    text = ("# ds4-eval trace\n\n===== CASE 1/1 AIME2025/aime2025-01 =====\nstatus: FAILED\n"
            "MODEL_OUTPUT_BEGIN bytes=999\nhand edited</think>Answer: 70\nMODEL_OUTPUT_END\n")
    cases, errors = parse_trace_text(text)
    assert errors == [] and cases[0].output == "hand edited</think>Answer: 70"


def _write_regrade_trace(path, qs):
    """A trace graded by ds4 HEAD's quirks: the careful extractor changes two verdicts."""
    w = TraceWriter(path, {"model": "m"})
    by_id = {q.id: q for q in qs}
    rows = [
        (by_id["compsec-082"], "FAILED", "9,0", "x</think>Answer: 9 10"),         # -> PASSED
        (by_id["aime2025-18"], "FAILED", "80",
         "x</think>I first thought the answer was 80.\nFinal answer: 082"),       # -> PASSED
        (qs[0], "PASSED", "B", "x" + FAKE + "</think>Answer: B"),                 # unchanged
        (qs[1], "STOPPED", "?", "partial"),                                       # not regraded
    ]
    for k, (q, status, picked, out) in enumerate(rows, 1):
        w.write_case(_case(q, k, len(rows), status, picked, out))
    w.close()


def test_regrade_trace_reports_changes(tmp_path):
    qs = load_questions(QUESTIONS)
    assert {q.id: q.answer for q in qs}["aime2025-18"] == "82"
    path = tmp_path / "t.trace"
    _write_regrade_trace(path, qs)
    done = run_cli("--regrade-trace", str(path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == (f"ds4-eval: regraded 3 cases from {path}: passed=3 failed=0 "
                         "changed=2 unknown=0 parse_errors=0")
    assert "case 1 COMPSEC/compsec-082: trace FAILED picked=9,0 -> regrade PASSED picked=9,10 " \
           "expected=9-10" in lines
    assert any("aime2025-18: trace FAILED picked=80 -> regrade PASSED picked=82" in ln
               for ln in lines)
    # with ds4 HEAD's rules nothing changes: the trace was graded by them
    head = run_cli("--regrade-trace", str(path), "--extractor", "head")
    assert "passed=1 failed=2 changed=0" in head.stdout


def test_regrade_unknown_case_and_empty_trace_exit_1(tmp_path):
    path = tmp_path / "t.trace"
    w = TraceWriter(path, {"model": "m"})
    w.write_case(TraceCase(number=1, total=1, source="NOPE", id="x", status="FAILED",
                           output="Answer: 1"))
    w.close()
    done = run_cli("--regrade-trace", str(path))
    assert done.returncode == 1 and "unknown=1" in done.stdout
    empty = tmp_path / "e.trace"
    TraceWriter(empty, {"model": "m"}).close()
    done = run_cli("--regrade-trace", str(empty))
    assert done.returncode == 1 and "regraded 0 cases" in done.stdout


def test_regrade_non_trace_exit_2(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("hello\n")
    done = run_cli("--regrade-trace", str(path))
    assert done.returncode == 2 and "not a ds4-eval trace" in done.stderr
    done = run_cli("--regrade-trace", str(tmp_path / "missing.trace"))
    assert done.returncode == 2 and "cannot read trace" in done.stderr
