"""The ds4-eval terminal UI (tooling-spec §7.5), built on textual.

Split screen: on the left the case list with states (`PEND FILL RUN SKIP STOP PASS FAIL`), the
score and the run clock; on the right the active (or selected) case's status line, a question
preview and the live output stream, thinking text dimmed, `<think>`/`</think>` hidden.

Keys: `p` pause/resume (takes effect at the next token or prefill chunk; the clock stops),
`q` / Ctrl+C stop the run (the current case becomes STOP) and print the report, Up/Down select
a case to inspect, Enter runs the selected case next (the running one is abandoned: PEND, and
SWITCHED in the trace).

The runner works in its own thread and only appends to shared buffers; the app redraws from
them on a 10 Hz timer, so a fast token stream never floods the event loop.
"""

from __future__ import annotations

import threading
import time

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from .grading import THINK_CLOSE
from .runner import FAILED, PASSED, PENDING, PREFILL, RUNNING, SHORT_STATE, SKIPPED, STOPPED, \
    ERROR, EvalRun, Listener

STATE_STYLE = {PENDING: "dim", PREFILL: "cyan", RUNNING: "yellow", SKIPPED: "dim",
               STOPPED: "bold yellow", PASSED: "bold green", FAILED: "bold red",
               ERROR: "bold red"}


def compact_count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n // 1_000_000}m"
    if n >= 10_000:
        return f"{n // 1000}k"
    return str(n)


def trim(text: str, width: int) -> str:
    text = " ".join(text.split())
    if width <= 3:
        return text[:max(width, 0)]
    return text if len(text) <= width else text[:width - 3] + "..."


class StreamBuffer:
    """The visible stream of one case: thinking and answer text, think tags hidden."""

    def __init__(self):
        self.thinking = ""
        self.answer = ""
        self._pending = ""            # a tag possibly split across tokens

    def add(self, piece: str, thinking: bool) -> None:
        text = (self._pending + piece).replace("\r", "").replace("\t", " ")
        self._pending = ""
        for tag in ("<think>", THINK_CLOSE):
            for k in range(len(tag) - 1, 0, -1):
                if text.endswith(tag[:k]):
                    self._pending, text = text[-k:], text[:-k]
                    break
            if self._pending:
                break
        if THINK_CLOSE in text:
            before, _, after = text.partition(THINK_CLOSE)
            self.thinking += before.replace("<think>", "") + "\n"
            self.answer += after.replace(THINK_CLOSE, "\n").replace("<think>", "")
        elif thinking and not self.answer:
            self.thinking += text.replace("<think>", "")
        else:
            self.answer += text.replace("<think>", "")

    def lines(self, width: int, height: int) -> list[tuple[str, bool]]:
        """The last `height` wrapped lines as (text, is_thinking)."""
        out: list[tuple[str, bool]] = []
        for body, dim in ((self.thinking, True), (self.answer, False)):
            if not body:
                continue
            for logical in body.split("\n"):
                if not logical:
                    out.append(("", dim))
                for i in range(0, len(logical), max(width, 1)):
                    out.append((logical[i:i + width], dim))
        return out[-height:] if height > 0 else []


class _TuiListener(Listener):
    def __init__(self, app: "EvalApp", pause_ms: int):
        self.app = app
        self.pause_ms = pause_ms

    def case_started(self, pos, result):
        with self.app.lock:
            self.app.streams[pos] = StreamBuffer()
            self.app.case_t0[pos] = time.monotonic()
            self.app.prefill[pos] = (0, 0)

    def prefill(self, pos, done, total):
        self.app.prefill[pos] = (done, total)

    def text(self, pos, piece, thinking):
        with self.app.lock:
            self.app.streams.setdefault(pos, StreamBuffer()).add(piece, thinking)

    def case_finished(self, pos, result):
        if result.state in (PASSED, FAILED) and self.pause_ms > 0 \
                and not self.app.run_.control.stop_requested:
            time.sleep(self.pause_ms / 1000.0)


class EvalApp(App):
    CSS = """
    #left { width: 50%; min-width: 42; max-width: 72; }
    #divider { width: 1; color: $text-muted; }
    #right { padding-left: 1; }
    #status { height: 1; }
    #preview { height: 3; color: $accent; }
    #gap { height: 1; }
    #head { height: 2; }
    """
    BINDINGS = [
        Binding("p", "pause", "pause"),
        Binding("q", "quit_report", "quit"),
        Binding("ctrl+c", "quit_report", "quit", priority=True),
        Binding("up", "select(-1)", "up", show=False),
        Binding("down", "select(1)", "down", show=False),
        Binding("enter", "run_selected", "run next", show=False),
    ]

    def __init__(self, run: EvalRun, pause_ms: int = 350):
        super().__init__()
        self.run_ = run
        self.lock = threading.Lock()
        self.streams: dict[int, StreamBuffer] = {}
        self.case_t0: dict[int, float] = {}
        self.prefill: dict[int, tuple[int, int]] = {}
        self.selected: int | None = None
        self.quitting = False
        run.listener = _TuiListener(self, pause_ms)
        self.worker_thread = threading.Thread(target=self._work, name="ds4-eval-run", daemon=True)

    def _work(self) -> None:
        try:
            self.run_.run()
        finally:
            try:
                self.call_from_thread(self._finished)
            except RuntimeError:
                pass

    def _finished(self) -> None:
        self.exit()

    def compose(self) -> ComposeResult:
        with Horizontal():
            with Vertical(id="left"):
                yield Static(id="head")
                yield Static(id="cases")
            yield Static(id="divider")
            with Vertical(id="right"):
                yield Static(id="status")
                yield Static(id="preview")
                yield Static(id="gap")
                yield Static(id="stream")

    def on_mount(self) -> None:
        self.set_interval(0.1, self.redraw)
        self.worker_thread.start()
        self.redraw()

    # -- actions
    def action_pause(self) -> None:
        self.run_.control.toggle_pause()
        self.redraw()

    def action_quit_report(self) -> None:
        if not self.quitting:
            self.quitting = True
            self.run_.control.request_stop()
            self.set_interval(0.05, self._exit_when_stopped)

    def _exit_when_stopped(self) -> None:
        if not self.worker_thread.is_alive():
            self.exit()

    def action_select(self, delta: int) -> None:
        n = len(self.run_.results)
        base = self.selected if self.selected is not None else (self.run_.active or 0)
        self.selected = (base + delta) % n
        self.redraw()

    def action_run_selected(self) -> None:
        sel = self.selected
        if sel is not None and sel != self.run_.active and \
                self.run_.results[sel].state in (PENDING, STOPPED):
            self.run_.control.request_switch(sel)

    # -- drawing
    def redraw(self) -> None:
        if not self.is_mounted:
            return
        run = self.run_
        passed, failed, total = run.counts()
        clock = int(run.control.run_seconds(run.started) // 60)
        head = Text(f"ds4-eval (p)ause (q)uit {clock // 60:02d}h:{clock % 60:02d}m")
        if run.control.paused:
            head.append("  PAUSED", style="bold red")
        head.append(f"\nscore {passed}/{total}  failed {failed}")
        self.query_one("#head", Static).update(head)
        self.query_one("#cases", Static).update(self._case_list())
        height = max(self.size.height, 1)
        self.query_one("#divider", Static).update(Text("\n".join("|" * height), style="dim"))
        shown = self.selected if self.selected is not None else run.active
        self._right_pane(shown)

    def _case_list(self) -> Text:
        run = self.run_
        left = self.query_one("#left")
        width = max(left.size.width, 42)
        rows = max(self.size.height - 3, 1)
        n = len(run.results)
        focus = self.selected if self.selected is not None else (run.active or 0)
        top = min(max(focus - rows // 2, 0), max(n - rows, 0))
        out = Text()
        for pos in range(top, min(top + rows, n)):
            r = run.results[pos]
            q = r.question
            mark = ">" if pos == self.selected else " "
            line = Text(f"{mark}{pos + 1:2d} ")
            style = STATE_STYLE.get(r.state, "")
            line.append(f"{SHORT_STATE.get(r.state, r.state):<4}", style=style)
            tail = f"{r.picked or '?'}/{q.answer}" if r.state in (PASSED, FAILED) else ""
            room = width - len(line.plain) - (18 if tail else 0) - 1
            line.append(" " + trim(f"{q.source}: {q.title}", room),
                        style="bold" if pos == run.active else "")
            if tail:
                line.append(" " * max(width - len(line.plain) - 18, 1) + f"{tail[:18]:>18}")
            out.append(line)
            out.append("\n")
        return out

    def _right_pane(self, pos: int | None) -> None:
        run = self.run_
        status = self.query_one("#status", Static)
        preview = self.query_one("#preview", Static)
        stream = self.query_one("#stream", Static)
        if pos is None:
            status.update("")
            preview.update("")
            stream.update("")
            return
        r = run.results[pos]
        q = r.question
        width = max(self.query_one("#right").size.width - 2, 10)
        p = r.progress
        elapsed = time.monotonic() - self.case_t0.get(pos, time.monotonic())
        generated = p.generated if p else r.generated
        speed = generated / elapsed if elapsed > 0 and pos == run.active else 0.0
        label = trim(q.id, 12)
        if r.state == PREFILL:
            done, total = self.prefill.get(pos, (0, 0))
            pct = int(100 * done / total) if total else 0
            line = f"Speed {speed:.2f} t/s  FILL {done}/{total} {pct}%  {q.source}/{label}"
        else:
            if r.state in (PASSED, FAILED):
                phase = SHORT_STATE[r.state]
            else:
                phase = "THINK" if p is not None and p.thinking_open else "ANS"
            limit = p.limit if p else run.settings.tokens
            shown_max = limit - run.settings.hard_budget if phase == "THINK" else limit
            line = (f"Speed {speed:.2f} t/s  {phase} {compact_count(generated)}/"
                    f"{compact_count(max(shown_max, 0))}  {q.source}/{label}")
        status.update(Text(line if len(line) <= width else line[:width - 3] + "..."))
        words = " ".join(q.user_prompt.split())
        chunks = [words[i:i + width] for i in range(0, min(len(words), 3 * width), width)]
        if len(words) > 3 * width and chunks:
            chunks[-1] = chunks[-1][:-3] + "..."
        preview.update(Text("\n".join(chunks), style="blue"))
        height = max(self.size.height - 5, 1)
        with self.lock:
            buf = self.streams.get(pos)
            lines = buf.lines(width, height) if buf else []
        body = Text()
        for i, (text, dim) in enumerate(lines):
            body.append(text, style="grey50" if dim else "")
            if i + 1 < len(lines):
                body.append("\n")
        stream.update(body)


def run_tui(run: EvalRun, pause_ms: int = 350) -> None:
    """Run the TUI until the run ends or the user quits; the caller prints the report."""
    app = EvalApp(run, pause_ms)
    try:
        app.run()
    finally:
        run.control.request_stop()
        app.worker_thread.join(timeout=30)
