"""`ds4-eval`: the capability regression harness (tooling-spec §7).

    ds4-eval                                 # all 92 cases on the default model, TUI on a TTY
    ds4-eval -m model.gguf --plain --questions 5 --tokens 4000 --trace run.trace
    ds4-eval --base-url http://127.0.0.1:8000/v1 --only 76-92 --nothink
    ds4-eval --regrade-trace run.trace       # re-extract answers, no model
    ds4-eval --self-test-extractors
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ds4.paths import default_model

from . import grading
from .questions import QuestionsError, default_questions_path, find_case, load_questions, \
    parse_only, select_questions
from .report import render_report, report_dict, write_json_atomic
from .runner import ERROR, FAILED, MAX_CONTEXT, PASSED, SKIPPED, EvalRun, GenSettings, Listener
from .trace import TraceError, TraceWriter, read_trace


class UsageError(Exception):
    """A user mistake: one line on stderr, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds4-eval", description="Run the ds4 capability question set against the local "
        "engine or an OpenAI-compatible server, grade the answers, and report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("backend")
    g.add_argument("-m", "--model", help="GGUF model for the local engine (default: the "
                   "embedded default model, $DS4_MODEL overrides)")
    g.add_argument("--backend", choices=("cpu", "cuda"), help="local engine backend "
                   "(default: cuda when it can run, else cpu)")
    g.add_argument("--base-url", help="use an OpenAI-compatible server instead, e.g. "
                   "http://127.0.0.1:8000/v1")
    g.add_argument("--api-model", help="model name to request from --base-url (default: the "
                   "first one the server lists)")
    g.add_argument("--api-key", help="API key for --base-url (default $OPENAI_API_KEY)")
    g.add_argument("--extra-body", help="JSON object merged into every --base-url request")
    d = p.add_argument_group("questions")
    d.add_argument("--data-dir", help="shared data directory (default $DS4_DATA_DIR, else "
                   "../shared/data)")
    d.add_argument("--questions-file", help="questions.jsonl to use instead of the data dir's")
    d.add_argument("--questions", type=int, metavar="N", help="run only the first N cases")
    d.add_argument("--only", metavar="I,J,K-L", help="run only these 1-based case indices")
    s = p.add_argument_group("generation")
    s.add_argument("-n", "--tokens", type=int, default=16000,
                   help="max generated tokens per question")
    think = s.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const="high",
                       default="high", help="thinking mode (default)")
    think.add_argument("--nothink", dest="think", action="store_const", const="none",
                       help="answer without thinking")
    s.add_argument("--temp", type=float, default=1.0, help="temperature; 0 = greedy argmax")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--min-p", type=float, default=0.05)
    s.add_argument("--seed", type=int, help="sampling seed (default: time ^ pid<<32 ^ clock)")
    s.add_argument("--soft-limit-reply-budget", type=int, metavar="N",
                   help="from this many remaining tokens, emit </think> as soon as it ranks in "
                   "the top --soft-limit-think-close-rank (default 1024, or tokens/2 if smaller)")
    s.add_argument("--hard-limit-reply-budget", type=int, metavar="N",
                   help="at this many remaining tokens, force </think> (default 512, or "
                   "tokens/4 if smaller)")
    s.add_argument("--soft-limit-think-close-rank", type=int, default=3, metavar="K")
    from ds4.engine import power
    power.add_power_argument(s)
    o = p.add_argument_group("output")
    o.add_argument("--plain", action="store_true", help="plain streamed log instead of the TUI")
    o.add_argument("--pause-ms", type=int, default=350, help="TUI pause after each graded case")
    o.add_argument("--trace", metavar="FILE", help="write the full trace of every case")
    o.add_argument("--report-json", metavar="FILE", help="write the final report as JSON")
    o.add_argument("--extractor", choices=grading.EXTRACTORS, default="careful",
                   help="answer extraction rules: careful (ours), pr185, head (ds4 8d57664)")
    from ds4.steering import apply as steering
    steering.add_arguments(p)
    t = p.add_argument_group("tools")
    t.add_argument("--regrade-trace", metavar="FILE",
                   help="re-extract and re-grade the answers in a trace; no model is loaded")
    t.add_argument("--self-test-extractors", action="store_true",
                   help="run the built-in extractor table and exit")
    return p


def resolve_settings(args) -> GenSettings:
    if args.tokens <= 0:
        raise UsageError("--tokens must be > 0")
    if args.tokens > MAX_CONTEXT:
        raise UsageError(f"--tokens must be <= {MAX_CONTEXT}")
    hard = args.hard_limit_reply_budget
    soft = args.soft_limit_reply_budget
    if hard is None:
        hard = min(512, max(1, args.tokens // 4))
    if soft is None:
        soft = max(hard, min(1024, args.tokens // 2))
    for name, value in (("--hard-limit-reply-budget", hard), ("--soft-limit-reply-budget", soft),
                        ("--soft-limit-think-close-rank", args.soft_limit_think_close_rank),
                        ("--pause-ms", args.pause_ms + 1)):
        if value <= 0:
            raise UsageError(f"{name} must be > 0")
    if hard >= args.tokens:
        raise UsageError(f"--hard-limit-reply-budget ({hard}) must be < --tokens ({args.tokens})")
    if soft < hard:
        raise UsageError(f"--soft-limit-reply-budget ({soft}) must be >= "
                         f"--hard-limit-reply-budget ({hard})")
    if args.temp != args.temp or args.temp < 0:
        raise UsageError("--temp must be >= 0")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError("--top-p must be in (0, 1]")
    if not 0.0 <= args.min_p <= 1.0:
        raise UsageError("--min-p must be in [0, 1]")
    if args.seed is None:
        from ds4.engine.sampling import time_seed
        seed = time_seed()
    else:
        seed = args.seed
    return GenSettings(tokens=args.tokens, think=args.think, temperature=args.temp,
                       top_p=args.top_p, min_p=args.min_p, seed=seed & 0xFFFFFFFFFFFFFFFF,
                       soft_budget=soft, hard_budget=hard,
                       close_rank=args.soft_limit_think_close_rank)


def load_selected(args):
    path = args.questions_file or default_questions_path(args.data_dir)
    questions = load_questions(path)
    only = parse_only(args.only) if args.only else None
    if args.questions is not None and args.questions < 1:
        raise UsageError("--questions must be > 0")
    return questions, select_questions(questions, args.questions, only), path


# ------------------------------------------------------------------------------------------------

def self_test() -> int:
    from .selftest import CASES, n_expectations, run_self_test
    failures = run_self_test()
    for f in failures:
        print(f"ds4-eval: extractor self-test FAILED: {f}")
    if failures:
        print(f"ds4-eval: {len(failures)} of {n_expectations()} extractor expectations failed")
        return 1
    print(f"ds4-eval: answer extractor self-tests passed ({len(CASES)} cases, "
          f"{n_expectations()} expectations)")
    return 0


def regrade(args) -> int:
    questions, _, qpath = load_selected(args)
    _, cases, errors = read_trace(args.regrade_trace)
    total = passed = failed = changed = unknown = 0
    for err in errors:
        print(f"ds4-eval: trace parse error: {err}", file=sys.stderr)
    for k, case in enumerate(cases, 1):
        if case.status not in (PASSED, FAILED):
            continue        # skipped, stopped, switched or errored: no complete answer
        q = find_case(questions, case.source, case.id)
        if q is None:
            unknown += 1
            print(f"case {k} {case.source}/{case.id}: not in {qpath}")
            continue
        total += 1
        picked, ok = grading.grade(q, case.output, args.extractor)
        passed += ok
        failed += not ok
        new_status = PASSED if ok else FAILED
        if new_status != case.status or picked != case.picked:
            changed += 1
            print(f"case {k} {case.source}/{case.id}: trace {case.status} picked={case.picked} "
                  f"-> regrade {new_status} picked={picked} expected={q.answer}")
    print(f"ds4-eval: regraded {total} cases from {args.regrade_trace}: passed={passed} "
          f"failed={failed} changed={changed} unknown={unknown} parse_errors={len(errors)}")
    return 1 if unknown or errors or total == 0 else 0


# ------------------------------------------------------------------------------------------------

class PlainPrinter(Listener):
    """Plain mode (§7.5): case header, the raw stream, then the verdict."""

    def __init__(self, run_total: int, out=None):
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self.total = run_total
        self.ctx = 0

    def _style(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.tty else text

    def case_started(self, pos, result):
        q = result.question
        self.out.write(f"\n[{pos + 1}/{self.total}] " + self._style(f"{q.source}/{q.domain}", "1")
                       + " " + self._style(q.title, "36") + "\n")
        self.out.flush()

    def text(self, pos, piece, thinking):
        self.out.write(self._style(piece, "2") if thinking and self.tty else piece)
        self.out.flush()

    def case_finished(self, pos, result):
        q = result.question
        if result.state == SKIPPED:
            self.out.write(f"\n[{pos + 1}/{self.total}] SKIPPED {q.label} "
                           f"prompt={result.prompt_tokens} ctx={self.ctx}\n")
        elif result.state in (PASSED, FAILED):
            word = "PASSED" if result.state == PASSED else "FAIL"
            self.out.write(f"\n{word} got {result.picked} expected {q.answer} "
                           f"({result.elapsed:.1f}s, {result.generated} tokens)\n")
        elif result.state == ERROR:
            self.out.write(f"\nERROR {result.error}\n")
        else:
            self.out.write(f"\n{result.state}\n")
        self.out.flush()

    def log(self, message):
        print(f"ds4-eval: {message}", file=sys.stderr)


def make_backend(args):
    from .backends import LocalBackend, OpenAIBackend, parse_extra_body
    if args.base_url:
        if args.dir_steering_file or args.dir_steering_attn or args.dir_steering_ffn:
            raise UsageError("--dir-steering-* apply to the local engine, not --base-url")
        if args.power < 100:
            raise UsageError("--power throttles the local engine, not --base-url")
        return OpenAIBackend(args.base_url, args.api_model, args.api_key,
                             parse_extra_body(args.extra_body))
    backend = LocalBackend(args.model or str(default_model()), args.backend)
    from ds4.steering import apply as steering
    try:
        backend.hooks = steering.hooks_from_args(args, backend.model.config)
    except ValueError as exc:          # SteeringFileError: a one-line user mistake
        raise UsageError(str(exc)) from None
    return backend


def size_context(run: EvalRun, settings: GenSettings) -> int:
    """ctx = largest selected prompt + --tokens (§7.3); 0 when the backend cannot count."""
    counts = {}
    for pos, q in enumerate(run.questions):
        n = run.backend.count_prompt_tokens(q, settings.think)
        if n is None:
            return 0
        counts[pos] = n
    run.prompt_tokens = counts
    ctx = max(counts.values()) + settings.tokens
    if ctx > MAX_CONTEXT:
        raise UsageError(f"context {ctx} (largest prompt {max(counts.values())} + --tokens "
                         f"{settings.tokens}) exceeds {MAX_CONTEXT} tokens")
    return ctx


def run_eval(args) -> int:
    settings = resolve_settings(args)
    _, selected, qpath = load_selected(args)
    backend = make_backend(args)
    use_tui = not args.plain and sys.stdout.isatty() and sys.stdin.isatty()
    if use_tui:
        size = os.get_terminal_size(sys.stdout.fileno())
        use_tui = size.columns >= 90 and size.lines >= 18
    run = EvalRun(selected, backend, settings, extractor=args.extractor)
    run.ctx = size_context(run, settings)
    if run.ctx:
        print(f"ds4-eval: context {run.ctx} tokens (largest prompt "
              f"{max(run.prompt_tokens.values())} + budget {settings.tokens})", file=sys.stderr)
    from ds4.engine import interrupt, power
    throttle = power.install(args.power)   # the local session throttles between layers
    backend.prepare(run.ctx)
    kv_bytes = getattr(backend, "kv_bytes", lambda: 0)()
    if kv_bytes:
        print(f"ds4-eval: session KV buffers {kv_bytes / 2**20:.1f} MiB", file=sys.stderr)
    if args.trace:
        run.trace = TraceWriter(args.trace, {
            "model": backend.model_name, "backend": backend.name, "ctx": run.ctx,
            "max_tokens": settings.tokens,
            "max_prompt_tokens": max(run.prompt_tokens.values()) if run.prompt_tokens else 0,
            "questions": len(selected), "questions_file": qpath,
            "temperature": f"{settings.temperature:.6g}", "top_p": f"{settings.top_p:.6g}",
            "min_p": f"{settings.min_p:.6g}", "seed": settings.seed,
            "think_mode_requested": settings.think,
            "soft_limit_reply_budget": settings.soft_budget,
            "hard_limit_reply_budget": settings.hard_budget,
            "soft_limit_think_close_rank": settings.close_rank, "extractor": args.extractor})
    if use_tui:
        from .tui import run_tui
        run_tui(run, pause_ms=args.pause_ms)
    else:
        printer = PlainPrinter(len(selected))
        printer.ctx = run.ctx
        run.listener = printer

        # Ctrl+C, SIGTERM, SIGHUP: the case in flight is STOPPED and the report follows. The stop is
        # always requested as a flag, which the backend checks at its next token or prefill chunk. It is
        # also raised, to cut a blocking read short, except where the exception would be swallowed and
        # printed (in a finalizer or numba's compiler: ds4.engine.interrupt).
        def stop(signum, frame):
            run.control.request_stop()
            if not interrupt.in_swallowing_frame(frame):
                raise KeyboardInterrupt
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop)
        try:
            run.run()
        except KeyboardInterrupt:      # outside a case (the runner catches it inside)
            if run.trace is not None:
                run.trace.close()
    runtime = run.control.run_seconds(run.started)
    sys.stdout.write("\n" + render_report(run.results, runtime))
    sys.stdout.flush()
    if throttle is not None:
        print(f"ds4-eval: --power {args.power}: busy fraction {throttle.busy_fraction:.2f} "
              f"({throttle.busy_s:.1f} s busy, {throttle.slept_s:.1f} s slept)", file=sys.stderr)
    if args.report_json:
        write_json_atomic(args.report_json, report_dict(run.results, runtime, {
            "model": backend.model_name, "backend": backend.name, "ctx": run.ctx,
            "tokens": settings.tokens, "think": settings.think,
            "temperature": settings.temperature, "top_p": settings.top_p,
            "min_p": settings.min_p, "seed": settings.seed, "extractor": args.extractor,
            "questions_file": str(qpath)}))
    _, failed, _ = run.counts()
    return 1 if failed else 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .backends import BackendError
    try:
        if args.self_test_extractors:
            return self_test()
        if args.regrade_trace:
            return regrade(args)
        return run_eval(args)
    except (UsageError, QuestionsError, TraceError, BackendError) as exc:
        print(f"ds4-eval: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ds4-eval: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return 1


if __name__ == "__main__":
    sys.exit(main())
