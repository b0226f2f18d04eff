"""ds4-eval end to end on the local engine: plain mode, report, trace, JSON report, regrading the
trace it wrote, the think budget, context sizing, and Ctrl+C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from ds4.eval.grading import grade
from ds4.eval.questions import load_questions
from ds4.eval.trace import read_trace
from ds4_tool_util import BIN, QUESTIONS, greedy_oracle, run_cli

REPORT_HEADER = "#   state    prompt      gen    total given    correct  test"


@pytest.fixture(scope="module")
def two_question_run(eval_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    trace, report = out / "run.trace", out / "report.json"
    t0 = time.monotonic()
    done = run_cli("-m", str(eval_model), "--plain", "--questions", "2", "--tokens", "32",
                   "--seed", "7", "--trace", str(trace), "--report-json", str(report))
    wall = time.monotonic() - t0
    print(f"\ntwo-question end-to-end run: {wall:.1f} s wall")
    return done, trace, report, wall


def test_plain_run_report(two_question_run):
    done, _, _, _ = two_question_run
    assert done.returncode in (0, 1), done.stderr
    out = done.stdout
    qs = load_questions(QUESTIONS)[:2]
    assert f"[1/2] {qs[0].source}/{qs[0].domain} {qs[0].title}" in out
    assert f"[2/2] {qs[1].source}/{qs[1].domain} {qs[1].title}" in out
    verdicts = [ln for ln in out.splitlines() if ln.startswith(("PASSED got", "FAIL got"))]
    assert len(verdicts) == 2 and all("32 tokens" in v or "tokens)" in v for v in verdicts)
    assert REPORT_HEADER in out
    rows = out.split(REPORT_HEADER + "\n", 1)[1].splitlines()[:2]
    for k, (row, q) in enumerate(zip(rows, qs), 1):
        assert row.startswith(f"{k:3d} ")
        assert row.endswith(f"{q.source}/{q.id}")
    summary = next(ln for ln in out.splitlines() if ln.startswith("ds4-eval: "))
    passed = sum(ln.startswith("PASSED") for ln in verdicts)
    assert summary.startswith(f"ds4-eval: {passed}/2 passed")
    assert done.returncode == (0 if passed == 2 else 1)
    assert "ds4-eval: context" in done.stderr


def test_trace_and_json_report_agree(two_question_run):
    done, trace, report, _ = two_question_run
    header, cases, errors = read_trace(trace)
    assert errors == [] and len(cases) == 2
    assert header["backend"] == "local" and header["max_tokens"] == "32"
    assert header["seed"] == "7" and header["think_mode_requested"] == "high"
    assert int(header["ctx"]) == int(header["max_prompt_tokens"]) + 32
    data = json.loads(report.read_text())
    assert data["total"] == 2 and len(data["cases"]) == 2
    qs = load_questions(QUESTIONS)[:2]
    for case, row, q in zip(cases, data["cases"], qs):
        assert (case.source, case.id) == (q.source, q.id) == (row["source"], row["id"])
        assert case.status == row["state"] in ("PASSED", "FAILED")
        assert case.prompt_tokens == row["prompt_tokens"] > 0
        assert case.generated_tokens == row["generated_tokens"]
        assert 0 < case.generated_tokens <= 32
        # the recorded verdict is what the grader says about the recorded output
        picked, ok = grade(q, case.output)
        assert case.picked == picked == (row["given"] or "?")
        assert ok == (case.status == "PASSED")
        assert case.question_prompt == q.user_prompt
    assert data["per_source"]["GPQA Diamond"]["total"] == 1


def test_think_budget_closes_thinking(two_question_run):
    _, trace, _, _ = two_question_run
    _, cases, _ = read_trace(trace)
    for case in cases:
        # --tokens 32 → hard budget 8: thinking must be closed by generated token 25 at latest
        assert case.think_close in ("natural", "soft_forced", "hard_forced")
        assert "</think>" in case.output
        assert 1 <= case.think_close_token_index <= 32 - 8 + 1
        if case.think_close == "hard_forced":
            assert case.think_close_remaining_budget == 8
        if case.think_close == "soft_forced":
            assert 1 <= case.think_close_rank <= 3


def test_regrade_reads_back_the_run(two_question_run):
    _, trace, _, _ = two_question_run
    done = run_cli("--regrade-trace", str(trace))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "regraded 2 cases" in done.stdout and "changed=0 unknown=0 parse_errors=0" in done.stdout


def test_nothink_greedy_matches_engine_oracle(eval_model):
    """In process: the runner's greedy no-think output is the engine's own argmax decode."""
    from ds4.engine.chat import ThinkMode, encode_chat_prompt
    from ds4.engine.session import Session
    from ds4.eval.backends import LocalBackend
    from ds4.eval.cli import size_context
    from ds4.eval.runner import EvalRun, GenSettings

    q = load_questions(QUESTIONS)[2]
    backend = LocalBackend(str(eval_model))
    settings = GenSettings(tokens=12, think="none", temperature=0, seed=1, soft_budget=6,
                           hard_budget=3)
    run = EvalRun([q], backend, settings)
    run.ctx = size_context(run, settings)
    backend.prepare(run.ctx)
    result = run.run()[0]
    tok = backend.tokenizer
    ids = encode_chat_prompt(tok, q.system_prompt, q.user_prompt, ThinkMode.NONE)
    out = greedy_oracle(Session(backend.model, ctx=len(ids) + 14), ids, 12, tok.eos_id)
    assert result.output == tok.decode(out).decode("utf-8", "replace")
    assert result.generated == len(out) and result.prompt_tokens == len(ids)
    assert result.progress.think_close == "none"
    assert result.state in ("PASSED", "FAILED")


def test_context_over_one_million_is_refused(eval_model):
    done = run_cli("-m", str(eval_model), "--plain", "--questions", "1", "--tokens", "1000000",
                   "--hard-limit-reply-budget", "10")
    assert done.returncode == 2
    assert "exceeds 1000000 tokens" in done.stderr and "Traceback" not in done.stderr


# cold (an empty numba cache: ~55 s of compiling on 2 cores) runs with make test-slow
@pytest.mark.parametrize("numba_cache", ["warm", pytest.param("cold", marks=pytest.mark.slow)])
def test_ctrl_c_prints_report_and_keeps_trace_valid(eval_model, tmp_path, numba_cache):
    """Cold: an empty numba cache, so Ctrl+C lands while the first case compiles the engine's kernels (a
    KeyboardInterrupt raised there was swallowed by llvmlite's ctypes callbacks and the run went on)."""
    trace = tmp_path / "int.trace"
    env = dict(os.environ)
    if numba_cache == "cold":
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    proc = subprocess.Popen(
        [str(BIN / "ds4-eval"), "-m", str(eval_model), "--plain", "--questions", "3", "--tokens",
         "5000", "--trace", str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    head = ""
    while "[1/3]" not in head:           # the first case has started (header printed)
        line = proc.stdout.readline()
        assert line, "ds4-eval ended before the first case started"
        head += line
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    out = head + out
    assert "Traceback" not in err
    assert REPORT_HEADER in out and "STOPPED" in out
    _, cases, errors = read_trace(trace)
    assert errors == [] and cases and cases[-1].status == "STOPPED"
    assert trace.read_text().rstrip().endswith("total: %d" % len(cases))


def test_directional_steering_changes_the_local_run(eval_model, tmp_path):
    """--dir-steering-* reach the engine through hooks: a strong FFN direction changes the greedy
    output, a zero scale does not read the file and changes nothing."""
    import numpy as np

    from ds4.engine.model import Model
    from ds4.eval.cli import build_parser, make_backend, size_context
    from ds4.eval.runner import EvalRun, GenSettings

    cfg = Model.load(eval_model).config
    direction = np.random.default_rng(0).standard_normal((cfg.n_layer, cfg.n_embd))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    path = tmp_path / "dir.f32"
    direction.astype("<f4").tofile(path)
    q = load_questions(QUESTIONS)[2]
    outputs = []
    for extra in ([], ["--dir-steering-file", str(path), "--dir-steering-ffn", "0"],
                  ["--dir-steering-file", str(path), "--dir-steering-ffn", "-2",
                   "--dir-steering-attn", "-2"]):
        args = build_parser().parse_args(["-m", str(eval_model), "--backend", "cpu", *extra])
        backend = make_backend(args)
        settings = GenSettings(tokens=10, think="none", temperature=0, soft_budget=4,
                               hard_budget=2)
        run = EvalRun([q], backend, settings)
        run.ctx = size_context(run, settings)
        backend.prepare(run.ctx)
        outputs.append(run.run()[0].output)
    assert outputs[0] == outputs[1]
    assert outputs[2] != outputs[0]
