"""The ds4-eval run loop: scheduling, pause/stop/switch control, grading and the trace.

The runner is shared by the plain mode and the TUI. It owns one `CaseResult` per selected
question and calls a backend (local engine or OpenAI-compatible HTTP, see backends.py) for one
case at a time. Control comes from another thread (the TUI, or Ctrl+C in plain mode) through
`RunControl`: the backend calls `control.checkpoint()` between tokens, which blocks while paused
and raises `CaseInterrupted` when the user stops the run or switches to another case.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .grading import THINK_CLOSE, grade
from .questions import Question
from .trace import TraceCase, TraceWriter

# Case states shown in the report (§7.5) and their TUI abbreviations.
PENDING, PREFILL, RUNNING = "PENDING", "PREFILL", "RUNNING"
PASSED, FAILED, SKIPPED, STOPPED, ERROR = "PASSED", "FAILED", "SKIPPED", "STOPPED", "ERROR"
SHORT_STATE = {PENDING: "PEND", PREFILL: "FILL", RUNNING: "RUN", SKIPPED: "SKIP",
               STOPPED: "STOP", PASSED: "PASS", FAILED: "FAIL", ERROR: "ERR"}
THINK_MODES = ("none", "high", "max")
MAX_CONTEXT = 1_000_000


class CaseInterrupted(Exception):
    """Raised inside a backend's token loop: reason is 'stop' or 'switch'."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class GenSettings:
    """Generation settings shared by every case (§7.3)."""
    tokens: int = 16000
    think: str = "high"                 # none | high (ds4-eval never requests max)
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.05
    seed: int = 0
    soft_budget: int = 1024             # --soft-limit-reply-budget
    hard_budget: int = 512              # --hard-limit-reply-budget
    close_rank: int = 3                 # --soft-limit-think-close-rank

    def case_seed(self, index: int) -> int:
        """Per-case seed (splitmix64 of seed+index): a case samples the same whatever runs
        before it, so `--only` reproduces a full run's case."""
        z = (self.seed + 0x9E3779B97F4A7C15 * index) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) or 1


@dataclass
class CaseProgress:
    """What a backend has produced so far for one case; survives an interruption."""
    limit: int = 0
    prompt_tokens: int = 0
    prefill_done: int = 0
    generated: int = 0
    text: str = ""
    thinking_open: bool = False
    think_close: str = "none"           # none | natural | soft_forced | hard_forced
    think_close_token_index: int = 0
    think_close_remaining_budget: int = 0
    think_close_rank: int = 0
    finish: str = ""

    def note_close(self, kind: str, rank: int = 0) -> None:
        """Record the first `</think>` (call after appending its text)."""
        if self.thinking_open and THINK_CLOSE in self.text:
            self.thinking_open = False
            if self.think_close == "none":
                self.think_close = kind
                self.think_close_token_index = self.generated
                self.think_close_remaining_budget = self.limit - self.generated + 1
                self.think_close_rank = rank


@dataclass
class CaseResult:
    question: Question
    state: str = PENDING
    picked: str = ""
    prompt_tokens: int = 0
    generated: int = 0
    elapsed: float = 0.0
    output: str = ""
    error: str = ""
    progress: CaseProgress | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated


class RunControl:
    """Pause / stop / switch requests from the UI thread, checked by the backend per token."""

    def __init__(self):
        self._lock = threading.Condition()
        self.paused = False
        self.stop_requested = False
        self.switch_to: int | None = None       # position in the run's case list
        self.paused_seconds = 0.0
        self._paused_at = 0.0

    def toggle_pause(self) -> bool:
        with self._lock:
            self.paused = not self.paused
            if self.paused:
                self._paused_at = time.monotonic()
            else:
                self.paused_seconds += time.monotonic() - self._paused_at
            self._lock.notify_all()
            return self.paused

    def request_stop(self) -> None:
        with self._lock:
            self.stop_requested = True
            self._lock.notify_all()

    def request_switch(self, position: int) -> None:
        with self._lock:
            self.switch_to = position
            self._lock.notify_all()

    def checkpoint(self) -> None:
        with self._lock:
            waited = False
            while self.paused and not self.stop_requested and self.switch_to is None:
                self._lock.wait(0.2)
                waited = True
            if waited:          # a user pause is not busy time for the --power throttle
                from ds4.engine import power
                power.pause()
            if self.stop_requested:
                raise CaseInterrupted("stop")
            if self.switch_to is not None:
                raise CaseInterrupted("switch")

    def run_seconds(self, started: float) -> float:
        now = time.monotonic()
        paused = self.paused_seconds + (now - self._paused_at if self.paused else 0.0)
        return now - started - paused


class Listener:
    """Callbacks from the runner thread; the plain printer and the TUI implement them."""

    def case_started(self, pos: int, result: CaseResult) -> None: ...
    def prefill(self, pos: int, done: int, total: int) -> None: ...
    def text(self, pos: int, piece: str, thinking: bool) -> None: ...
    def case_finished(self, pos: int, result: CaseResult) -> None: ...
    def log(self, message: str) -> None: ...


@dataclass
class EvalRun:
    questions: list[Question]
    backend: object
    settings: GenSettings
    extractor: str = "careful"
    trace: TraceWriter | None = None
    listener: Listener = field(default_factory=Listener)
    control: RunControl = field(default_factory=RunControl)
    ctx: int = 0
    prompt_tokens: dict = field(default_factory=dict)   # position -> prompt token count

    def __post_init__(self):
        self.results = [CaseResult(q) for q in self.questions]
        self.started = time.monotonic()
        self.active: int | None = None

    # -- scheduling (§7.5): start at case 1; after a case, the next PENDING case after it
    # (wrapping); an Enter request overrides.
    def _next_position(self, after: int | None) -> int | None:
        if self.control.switch_to is not None:
            pos, self.control.switch_to = self.control.switch_to, None
            if self.results[pos].state in (PENDING, STOPPED):
                return pos
        n = len(self.results)
        start = 0 if after is None else after + 1
        for k in range(n):
            pos = (start + k) % n
            if self.results[pos].state == PENDING:
                return pos
        return None

    def run(self) -> list[CaseResult]:
        pos = None
        try:
            while not self.control.stop_requested:
                nxt = self._next_position(pos)
                if nxt is None:
                    break
                pos = nxt
                self._run_case(pos)
        finally:
            self.active = None
            if self.trace is not None:
                self.trace.close()
        return self.results

    def _run_case(self, pos: int) -> None:
        result = self.results[pos]
        q = result.question
        s = self.settings
        prompt_tokens = self.prompt_tokens.get(pos)
        if self.ctx and prompt_tokens is not None and prompt_tokens >= self.ctx:
            result.state, result.prompt_tokens = SKIPPED, prompt_tokens
            self.listener.case_finished(pos, result)
            self._write_trace(pos, result, None)
            return
        limit = s.tokens if not self.ctx or prompt_tokens is None else \
            min(s.tokens, self.ctx - prompt_tokens)
        progress = CaseProgress(limit=limit, thinking_open=s.think != "none")
        result.progress = progress
        result.state, result.output, result.error = PREFILL, "", ""
        self.active = pos
        self.listener.case_started(pos, result)
        t0 = time.monotonic()
        paused0 = self.control.paused_seconds
        switched = False
        try:
            self.backend.generate(q, s, pos, progress, self.control, self._make_sink(pos, result))
            result.output = progress.text
            result.picked, passed = grade(q, progress.text, self.extractor)
            result.state = PASSED if passed else FAILED
        except CaseInterrupted as exc:
            result.output = progress.text
            if exc.reason == "switch":
                result.state, switched = PENDING, True
            else:
                result.state = STOPPED
        except KeyboardInterrupt:
            result.output = progress.text
            result.state = STOPPED
            self.control.request_stop()
        except Exception as exc:      # a backend failure is one case's ERROR, not a crash
            result.output = progress.text
            result.state, result.error = ERROR, f"{type(exc).__name__}: {exc}"
        result.prompt_tokens = progress.prompt_tokens
        result.generated = progress.generated
        result.elapsed = time.monotonic() - t0 - (self.control.paused_seconds - paused0)
        self.active = None
        self._write_trace(pos, result, "SWITCHED" if switched else None)
        self.listener.case_finished(pos, result)

    def _make_sink(self, pos: int, result: CaseResult):
        listener = self.listener

        class Sink:
            def prefill(self, done: int, total: int) -> None:
                listener.prefill(pos, done, total)

            def started(self) -> None:
                result.state = RUNNING

            def text(self, piece: str, thinking: bool) -> None:
                listener.text(pos, piece, thinking)

        return Sink()

    def _write_trace(self, pos: int, result: CaseResult, status: str | None) -> None:
        if self.trace is None:
            return
        q, s, p = result.question, self.settings, result.progress
        case = TraceCase(
            number=pos + 1, total=len(self.results), source=q.source, id=q.id,
            status=status or result.state, picked=result.picked or "?", expected=q.answer,
            domain=q.domain, title=q.title, timestamp_unix=int(time.time()),
            prompt_tokens=result.prompt_tokens, generated_tokens=result.generated,
            elapsed_sec=result.elapsed, temperature=s.temperature, top_p=s.top_p, min_p=s.min_p,
            think_mode_effective=s.think, error=result.error, choices=q.choices,
            system_prompt=q.system_prompt, question_prompt=q.user_prompt, output=result.output,
            extra={"case_index": q.index, "case_seed": s.case_seed(q.index),
                   "extractor": self.extractor},
        )
        if p is not None:
            case.think_close = p.think_close
            case.think_close_token_index = p.think_close_token_index
            case.think_close_remaining_budget = p.think_close_remaining_budget
            case.think_close_rank = p.think_close_rank
            if p.finish:
                case.extra["finish"] = p.finish
        self.trace.write_case(case)

    # -- summaries
    def counts(self) -> tuple[int, int, int]:
        passed = sum(r.state == PASSED for r in self.results)
        failed = sum(r.state in (FAILED, ERROR) for r in self.results)
        return passed, failed, len(self.results)
