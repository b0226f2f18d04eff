"""The ds4-eval TUI driven headless with textual's Pilot over the real local engine: pause,
selection, Enter to run a case next (the running one is SWITCHED), quit with a valid trace."""

from __future__ import annotations

import asyncio
import time

import pytest

from ds4.eval.backends import LocalBackend
from ds4.eval.cli import size_context
from ds4.eval.questions import load_questions
from ds4.eval.runner import EvalRun, GenSettings
from ds4.eval.trace import TraceWriter, read_trace
from ds4.eval.tui import EvalApp, StreamBuffer
from ds4_tool_util import QUESTIONS


@pytest.fixture(scope="module")
def backend(eval_model):
    return LocalBackend(str(eval_model))


def _run(backend, trace_path, tokens=400, n=4):
    qs = load_questions(QUESTIONS)[:n]
    settings = GenSettings(tokens=tokens, think="high", temperature=0, soft_budget=20,
                           hard_budget=10, seed=3)
    run = EvalRun(qs, backend, settings)
    run.ctx = size_context(run, settings)
    backend.prepare(run.ctx)
    run.trace = TraceWriter(trace_path, {"model": "tiny", "backend": "local"})
    return run


async def _wait(pilot, predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.05)


def test_pause_select_switch_quit(backend, tmp_path):
    # Each case runs to its token limit on the random model (~4 ms/token here): 4000 tokens keep
    # case 1 running until q even when a loaded machine starves the UI loop of the GIL.
    run = _run(backend, tmp_path / "tui.trace", tokens=4000)

    async def drive():
        app = EvalApp(run, pause_ms=0)
        async with app.run_test(size=(120, 30)) as pilot:
            await _wait(pilot, lambda: run.results[0].progress is not None
                        and run.results[0].progress.generated > 2)
            await pilot.press("p")
            await pilot.pause(0.3)
            assert run.control.paused
            frozen = run.results[0].progress.generated
            await pilot.pause(0.5)
            assert run.results[0].progress.generated <= frozen + 1   # one token may be in flight
            app.redraw()
            assert "PAUSED" in str(app.query_one("#head").render())
            assert "RUN" in str(app.query_one("#cases").render()).splitlines()[0]

            await pilot.press("down")
            await pilot.press("down")
            assert app.selected == 2
            app.redraw()
            listing = str(app.query_one("#cases").render()).splitlines()
            assert listing[2].startswith(">")
            status = str(app.query_one("#status").render())
            assert status.startswith("Speed") and run.questions[2].source in status
            await pilot.press("up")
            assert app.selected == 1
            await pilot.press("enter")          # run case 2 next; case 1 is abandoned
            await pilot.press("p")              # resume
            # Case 1 now runs before case 0. On a loaded machine the poll may first see it after it
            # has finished (its progress stays), and case 0 may already be running again.
            await _wait(pilot, lambda: run.results[1].progress is not None
                        and run.results[1].progress.generated > 1)
            assert run.results[0].state in ("PENDING", "RUNNING")
            await pilot.press("q")
            await _wait(pilot, lambda: not app.worker_thread.is_alive())
        return app

    asyncio.run(drive())
    states = [r.state for r in run.results]
    assert states[1] == "STOPPED" and states[0] == "PENDING"
    _, cases, errors = read_trace(tmp_path / "tui.trace")
    assert errors == []
    assert [(c.number, c.status) for c in cases] == [(1, "SWITCHED"), (2, "STOPPED")]
    assert (tmp_path / "tui.trace").read_text().endswith("total: 2\n")


def test_run_to_completion_exits(backend, tmp_path):
    run = _run(backend, tmp_path / "done.trace", tokens=12, n=2)

    async def drive():
        app = EvalApp(run, pause_ms=10)
        async with app.run_test(size=(100, 20)) as pilot:
            await _wait(pilot, lambda: not app.worker_thread.is_alive(), timeout=60)
            await pilot.pause(0.2)
            app.redraw()
            rows = str(app.query_one("#cases").render()).splitlines()[:2]
            for row, result in zip(rows, run.results):
                assert row[4:8] == ("PASS" if result.state == "PASSED" else "FAIL")
                assert row.rstrip().endswith(f"{result.picked}/{result.question.answer}")

    asyncio.run(drive())
    assert [r.state in ("PASSED", "FAILED") for r in run.results] == [True, True]


def test_stream_buffer_hides_think_tags_split_across_tokens():
    buf = StreamBuffer()
    for piece in ["reason", "ing </th", "ink>Ans", "wer: B\tok\r"]:
        buf.add(piece, thinking="</think>" not in (buf.thinking + buf.answer))
    assert buf.thinking == "reasoning \n"
    assert buf.answer == "Answer: B ok"
    lines = buf.lines(width=5, height=3)
    assert [t for t, _ in lines] == ["Answe", "r: B ", "ok"]
    assert all(not dim for _, dim in lines)
