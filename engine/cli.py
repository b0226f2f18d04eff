"""`ds4`: run a DeepSeek V4 GGUF from the command line (runtime-spec §4).

    ds4 -p "What is 2+2?"                 one-shot chat generation (streams to stdout)
    ds4                                   interactive REPL (multi-turn; /help for commands)
    ds4 --dump-tokens -p TEXT             tokenize TEXT as written and print the ids
    ds4 --dump-logprobs out.json -p TEXT  greedy continuation with top-k logprobs (JSON)

The default model is the one `make setup` builds (models/ds4-tiny.gguf, random weights: the
numerics are real, the text is not); `-m` points at any DS4 GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from ds4.atomic import atomic_write
from ds4.engine.chat import (
    DEFAULT_SYSTEM,
    MAX_PREFIX,
    THINK_MAX_MIN_CONTEXT,
    ThinkMode,
    chat_append_assistant_prefix,
    encode_chat_prompt,
)
from ds4.engine import interrupt, power
from ds4.engine.generate import Utf8Stream, generate, logprob_steps
from ds4.engine.sampling import (
    DEFAULT_MIN_P,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    TOP_K_MAX,
    Sampler,
)
from ds4.gguf_tools.constants import BOS_TEXT
from ds4.paths import default_model
from ds4.steering import apply as steering

DEFAULT_CTX = 32768
DEFAULT_TOKENS = 50000
LOGPROBS_TOP_K_MAX = 128
HISTORY_FILE = Path.home() / ".ds4_history"
HISTORY_LEN = 512
GREY, RESET = "\x1b[90m", "\x1b[0m"


class CliError(Exception):
    """A user mistake: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise CliError(message)


def _ranged(kind, lo, hi, name):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} expects a number, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi) or value != value:
            raise argparse.ArgumentTypeError(f"{name} must be in [{lo}, {hi}], got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ds4", description="Run a DeepSeek V4 GGUF: one-shot (-p), interactive (no -p), or dumps.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-m", "--model", default=None,
                   help=f"DS4 GGUF to load (default: $DS4_MODEL or {default_model()})")
    p.add_argument("-c", "--ctx", type=_ranged(int, 1, 1 << 30, "--ctx"), default=DEFAULT_CTX, help="context size in tokens")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="one-shot prompt text (without -p/--prompt-file: interactive)")
    src.add_argument("--prompt-file", help="read the one-shot prompt from a file")
    p.add_argument("-sys", "--system", default=DEFAULT_SYSTEM, help='system prompt ("" disables)')
    p.add_argument("-n", "--tokens", type=_ranged(int, 0, None, "--tokens"), default=DEFAULT_TOKENS,
                   help="maximum tokens to generate")
    p.add_argument("--temp", type=_ranged(float, 0.0, 100.0, "--temp"), default=DEFAULT_TEMPERATURE,
                   help="temperature; 0 = greedy")
    p.add_argument("--top-p", type=_ranged(float, 0.0, 1.0, "--top-p"), default=DEFAULT_TOP_P)
    p.add_argument("--top-k", type=_ranged(int, 0, TOP_K_MAX, "--top-k"), default=0, help="0 = off")
    p.add_argument("--min-p", type=_ranged(float, 0.0, 1.0, "--min-p"), default=DEFAULT_MIN_P)
    p.add_argument("--seed", type=_ranged(int, 1, (1 << 64) - 1, "--seed"), default=None, help="RNG seed (default: time based)")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const=ThinkMode.HIGH, help="thinking mode (default)")
    think.add_argument("--think-max", dest="think", action="store_const", const=ThinkMode.MAX,
                       help=f"Think-Max (needs --ctx >= {THINK_MAX_MIN_CONTEXT}, else HIGH)")
    think.add_argument("--nothink", dest="think", action="store_const", const=ThinkMode.NONE, help="no thinking")
    p.set_defaults(think=ThinkMode.HIGH)
    p.add_argument("--raw", action="store_true", help="feed the prompt as-is: BOS + its tokens, no chat template")
    p.add_argument("--dump-tokens", action="store_true", help="tokenize the prompt text as written, print, exit")
    p.add_argument("--dump-logprobs", metavar="FILE", help="write a greedy continuation with top-k logprobs (JSON)")
    p.add_argument("--logprobs-top-k", type=_ranged(int, 1, LOGPROBS_TOP_K_MAX, "--logprobs-top-k"), default=20)
    p.add_argument("--dump-logits", metavar="FILE", help="write the logits after prefill (JSON)")
    p.add_argument("--inspect", action="store_true", help="print a model summary and exit")
    p.add_argument("--backend", choices=["cpu", "cuda"], default=None, help="engine backend (default: cuda if built, else cpu)")
    p.add_argument("--cpu", dest="backend", action="store_const", const="cpu", help="same as --backend cpu")
    p.add_argument("--cuda", dest="backend", action="store_const", const="cuda", help="same as --backend cuda")
    p.add_argument("-t", "--threads", type=_ranged(int, 1, 4096, "--threads"), default=None, help="CPU threads (default: all)")
    p.add_argument("--no-rounding-sim", action="store_true",
                   help="turn off the official FP8 KV / FP4 indexer rounding (compare with transformers)")
    power.add_power_argument(p)
    steering.add_arguments(p)
    return p


# ---------------------------------------------------------------------------------------------
# loading


def _model_path(args) -> Path:
    return Path(args.model) if args.model else default_model()


def _missing_model(path: Path) -> CliError:
    hint = " (run `make setup` to build the default model)" if not os.environ.get("DS4_MODEL") and path == default_model() else ""
    return CliError(f"model file not found: {path}{hint}")


def load_tokenizer(path: Path):
    """The tokenizer of a GGUF, reading only its metadata (no tensor is touched)."""
    from ds4.engine.tokenizer import Tokenizer
    from ds4.gguf_tools.reader import GGUFError, open_gguf

    if not path.is_file():
        raise _missing_model(path)
    try:
        f = open_gguf(path)
    except GGUFError as e:
        raise CliError(str(e)) from None
    try:
        if not f.tokens or not f.merges:
            raise CliError(f"{path}: no tokenizer in this GGUF (tokenizer.ggml.tokens/merges missing)")
        return Tokenizer(f.tokens, f.merges)
    except ValueError as e:
        raise CliError(f"{path}: {e}") from None
    finally:
        f.close()


def load_model(args):
    from ds4.engine.model import Model, ModelError
    from ds4.gguf_tools.reader import GGUFError

    path = _model_path(args)
    if not path.is_file():
        raise _missing_model(path)
    sim = not args.no_rounding_sim
    try:
        return Model.load(path, fp8_kv=sim, indexer_qat=sim)
    except (GGUFError, ModelError, ValueError) as e:
        raise CliError(str(e)) from None


def _gpu_session_class():
    """(Session class of the CUDA engine or None, why not)."""
    try:
        from ds4.engine import gpu
    except ImportError as e:
        return None, str(e)
    if not gpu.available():
        return None, gpu.unavailable_reason() or "CUDA unavailable"
    try:
        from ds4.engine.gpu.session import Session  # type: ignore[import-not-found]

        return Session, None
    except ImportError:
        return None, "this build has CUDA kernels but no CUDA engine session yet"
    except ValueError as e:  # a DS4_GPU_* switch with an unknown value: say which, do not fall back silently
        raise CliError(str(e)) from None


def open_session(model, ctx: int, backend: str | None, hooks=None):
    """A session on the chosen backend (default: CUDA when it can run, else CPU), with the engine
    hooks (steering) and the --power throttle between layers when one is installed."""
    session = None
    if backend in (None, "cuda"):
        cls, why = _gpu_session_class()
        if cls is not None:
            session = cls(model, ctx=ctx) if hooks is None else cls(model, ctx=ctx, hooks=hooks)
        elif backend == "cuda":
            raise CliError(f"--backend cuda: {why}; use --backend cpu")
    if session is None:
        from ds4.engine.session import Session

        try:
            session = Session(model, ctx=ctx, hooks=hooks)
        except ValueError as e:
            raise CliError(str(e)) from None
    power.attach(session)
    return session


def steering_hooks(args, model):
    """Hooks for --dir-steering-* (None without a file or with every scale 0)."""
    from ds4.steering.format import SteeringFileError

    try:
        return steering.hooks_from_args(args, model.config)
    except (SteeringFileError, ValueError) as e:
        raise CliError(str(e)) from None


class PrefillProgress:
    """A tqdm bar on stderr while a session prefills (hidden when stderr is not a terminal)."""

    def __init__(self, session):
        self.session = session
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="prefill", unit="tok", leave=False, disable=None, file=sys.stderr)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        if hasattr(self.session, "progress"):
            self.session.progress = self
        return self

    def __exit__(self, *exc):
        self.close()
        if hasattr(self.session, "progress"):
            self.session.progress = None


# ---------------------------------------------------------------------------------------------
# prompt construction (§4.2)


def read_prompt(args) -> str | None:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise CliError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
    return None


def resolve_think(mode: ThinkMode, ctx: int, warn=True) -> ThinkMode:
    if mode == ThinkMode.MAX and ctx < THINK_MAX_MIN_CONTEXT:
        if warn:
            print(f"ds4: --think-max needs --ctx >= {THINK_MAX_MIN_CONTEXT}; using --think", file=sys.stderr)
        return ThinkMode.HIGH
    return mode


def prompt_tokens(tok, text: str, system: str, mode: ThinkMode, raw: bool) -> list[int]:
    """A pre-rendered prompt (starting with BOS) is tokenized as chat text; --raw is BOS + BPE;
    otherwise the engine chat template."""
    if text.startswith(BOS_TEXT):
        return tok.encode_chat(text)
    if raw:
        return [tok.bos_id] + tok.encode(text)
    return encode_chat_prompt(tok, system, text, mode)


# ---------------------------------------------------------------------------------------------
# dumps


def dump_tokens(tok, text: str, out) -> None:
    """§4.4: the id list, then one line per token: `%6d  <raw vocab string>`."""
    ids = tok.encode_chat(text)
    out.write("[" + ", ".join(str(i) for i in ids) + "]\n")
    for i in ids:
        out.write(f"{i:6d}  {tok.token_text(i)}\n")


def _g9(x: float) -> str:
    if not np.isfinite(x):
        return "null"
    return "%.9g" % x


def json_token_text(data: bytes) -> str:
    """JSON string of token bytes; invalid UTF-8 writes every byte >= 0x80 as \\u00XX."""
    try:
        return json.dumps(data.decode("utf-8"), ensure_ascii=False)
    except UnicodeDecodeError:
        parts = []
        for b in data:
            parts.append("\\u%04x" % b if b >= 0x80 else json.dumps(chr(b))[1:-1])
        return '"' + "".join(parts) + '"'


def _token_json(tok, token_id: int) -> str:
    data = tok.decode_token(token_id)
    return '{"id":%d,"text":%s,"bytes":[%s]}' % (token_id, json_token_text(data), ",".join(str(b) for b in data))


def _write_atomic(path: str, text: str) -> None:
    try:
        atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror}") from None


def logprobs_json(tok, steps: list[dict], n_prompt: int, ctx: int, top_k: int) -> str:
    lines = ['{', '  "source":"ds4",', f'  "prompt_tokens":{n_prompt},', f'  "ctx":{ctx},', f'  "top_k":{top_k},',
             '  "steps":[']
    for k, s in enumerate(steps):
        tops = ",".join('{"token":%s,"logit":%s,"logprob":%s}' % (_token_json(tok, i), _g9(lg), _g9(lp))
                        for i, lg, lp in s["top"])
        sep = "," if k + 1 < len(steps) else ""
        lines.append('    {"step":%d,"selected":%s,"top_logprobs":[%s]}%s'
                     % (s["step"], _token_json(tok, s["selected"]), tops, sep))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def logits_json(tok, logits: np.ndarray, model_path: Path, backend: str, n_prompt: int, ctx: int, quant_bits: int) -> str:
    logits = np.asarray(logits, dtype=np.float32)
    best = int(np.argmax(np.where(np.isfinite(logits), logits, -np.inf)))
    head = ('{"source":"ds4","model":%s,"backend":%s,"mt":false,"quant_bits":%d,"prompt_tokens":%d,"ctx":%d,'
            '"vocab":%d,"argmax_token":%s,"argmax_logit":%s,"logits":[\n'
            % (json.dumps(str(model_path)), json.dumps(backend), quant_bits, n_prompt, ctx, len(logits),
               _token_json(tok, best), _g9(float(logits[best]))))
    rows = [",".join(_g9(float(v)) for v in logits[i:i + 8]) for i in range(0, len(logits), 8)]
    return head + ",\n".join(rows) + "\n]}\n"


def _quant_bits(model) -> int:
    """Bits of the routed-expert weights (the bulk of the model), for --dump-logits."""
    from ds4.gguf_tools.constants import QuantType

    bits = {QuantType.F32: 32, QuantType.F16: 16, QuantType.BF16: 16, QuantType.Q8_0: 8, QuantType.Q4_K: 4,
            QuantType.Q2_K: 2, QuantType.IQ2_XXS: 2}
    try:
        info = model.file.tensors["blk.0.ffn_gate_exps.weight"]
        return bits.get(QuantType(info.qtype), 0)
    except (AttributeError, KeyError, ValueError):
        return 0


def inspect(model, path: Path, out) -> None:
    cfg = model.config
    out.write(f"model: {path} ({path.stat().st_size / 2**20:.1f} MiB)\n")
    for name in ("n_layer", "n_embd", "n_head", "head_dim", "vocab_size", "n_expert", "n_expert_used", "expert_ffn",
                 "sliding_window", "compress_ratios", "n_hc"):
        if hasattr(cfg, name):
            out.write(f"  {name:16s} {getattr(cfg, name)}\n")
    tensors = getattr(model.file, "tensors", {}) or {}
    if tensors:
        kinds: dict[str, int] = {}
        for info in tensors.values():
            kinds[info.type_name] = kinds.get(info.type_name, 0) + 1
        out.write(f"  tensors          {len(tensors)} (" + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + ")\n")
    from ds4.engine.session import kv_bytes_per_token

    raw = cfg.n_layer * cfg.sliding_window * cfg.head_dim * 4
    out.write(f"  kv per token     {kv_bytes_per_token(cfg):.1f} bytes (compressed rows, f32), "
              f"plus a raw window of {raw / 2**20:.2f} MiB\n")


# ---------------------------------------------------------------------------------------------
# streaming output


class Printer:
    """Streams generated tokens: reasoning grey (on a terminal), think tags hidden, a newline after
    `</think>`, partial UTF-8 held until complete."""

    def __init__(self, tok, thinking: bool, out=None, color: bool | None = None):
        self.tok = tok
        self.out = out or sys.stdout
        self.color = self.out.isatty() if color is None else color
        self.in_think = thinking
        self.stream = Utf8Stream()
        self.grey = False  # an ANSI grey span is open

    def _write(self, text: str) -> None:
        if text:
            if self.in_think and self.color and not self.grey:
                self.out.write(GREY)
                self.grey = True
            self.out.write(text)
            self.out.flush()

    def _end_grey(self) -> None:
        if self.grey:
            self.out.write(RESET)
            self.grey = False

    def __call__(self, token: int) -> None:
        if token == self.tok.think_open_id:
            self._write(self.stream.flush())
            self.in_think = True
            return
        if token == self.tok.think_close_id:
            self._write(self.stream.flush())
            self._end_grey()
            self.in_think = False
            self.out.write("\n")
            self.out.flush()
            return
        self._write(self.stream.push(self.tok.decode_token(token)))

    def finish(self) -> None:
        self._write(self.stream.flush())
        self._end_grey()
        self.out.write("\n")
        self.out.flush()


def _sampler(args) -> Sampler:
    return Sampler(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)


def _budget(args, ctx: int, n_prompt: int) -> int:
    if n_prompt >= ctx:
        raise CliError(f"prompt is {n_prompt} tokens, the context is {ctx} (raise --ctx)")
    return min(args.tokens, ctx - n_prompt - 1)


def _timing(gen) -> None:
    print(f"ds4: prefill: {gen.prefill_tps:.2f} t/s, generation: {gen.decode_tps:.2f} t/s", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# modes


def run_one_shot(args, model, text: str) -> int:
    tok = model.tokenizer
    mode = resolve_think(args.think, args.ctx)
    ids = prompt_tokens(tok, text, args.system, mode, args.raw)
    budget = _budget(args, args.ctx, len(ids))
    session = open_session(model, args.ctx, args.backend, args.hooks)
    if args.dump_logits:
        with PrefillProgress(session):
            logits = session.sync(ids)
        _write_atomic(args.dump_logits, logits_json(tok, logits, _model_path(args), args.backend or "cpu", len(ids),
                                                    args.ctx, _quant_bits(model)))
        if not args.dump_logprobs:
            return 0
    if args.dump_logprobs:
        with PrefillProgress(session):
            steps = logprob_steps(session, ids, budget, args.logprobs_top_k, tok.eos_id)
        _write_atomic(args.dump_logprobs, logprobs_json(tok, steps, len(ids), args.ctx, args.logprobs_top_k))
        return 0
    printer = Printer(tok, thinking=mode.enabled and not args.raw and not text.startswith(BOS_TEXT))
    with PrefillProgress(session):
        gen = generate(session, ids, budget, _sampler(args), on_token=printer, eos_id=tok.eos_id)
    printer.finish()
    _timing(gen)
    return 130 if gen.finish_reason == "interrupted" else 0


REPL_HELP = """commands:
  /help          this help
  /think         thinking mode (reasoning, then the answer)
  /think-max     Think-Max (only with --ctx >= %d)
  /nothink       answer directly
  /ctx N         new context size (restarts the session)
  /read FILE     send the file's content as the next user message
  /quit, /exit   leave
Ctrl+C stops the current generation.""" % THINK_MAX_MIN_CONTEXT


def _setup_history():
    try:
        import readline
    except ImportError:
        return None
    try:
        readline.read_history_file(HISTORY_FILE)
    except OSError:
        pass
    readline.set_history_length(HISTORY_LEN)
    return readline


def run_repl(args, model) -> int:
    tok = model.tokenizer
    mode = resolve_think(args.think, args.ctx)
    ctx = args.ctx
    readline = _setup_history() if sys.stdin.isatty() else None
    max_ids = tok.encode(MAX_PREFIX)
    system_ids = tok.encode(args.system) if args.system else []

    def head() -> list[int]:
        return [tok.bos_id] + (max_ids if mode == ThinkMode.MAX else []) + system_ids

    turns: list[int] = []  # everything after the head: user turns, answers, EOS
    session = open_session(model, ctx, args.backend, args.hooks)
    sampler = _sampler(args)
    print("ds4 interactive: /help for commands, /quit to leave", file=sys.stderr)
    while True:
        try:
            line = input("ds4> ")
            power.pause()  # time spent waiting for the user is not busy time
        except EOFError:
            print(file=sys.stderr)
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, rest = text.partition(" ")
            rest = rest.strip()
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/help":
                print(REPL_HELP)
            elif cmd == "/think":
                mode = ThinkMode.HIGH
            elif cmd == "/nothink":
                mode = ThinkMode.NONE
            elif cmd == "/think-max":
                if ctx >= THINK_MAX_MIN_CONTEXT:
                    mode = ThinkMode.MAX
                else:
                    print(f"ds4: Think-Max needs /ctx >= {THINK_MAX_MIN_CONTEXT}", file=sys.stderr)
            elif cmd == "/ctx":
                try:
                    new_ctx = int(rest)
                    if new_ctx < 1:
                        raise ValueError
                except ValueError:
                    print("ds4: /ctx needs a positive number", file=sys.stderr)
                    continue
                ctx = new_ctx
                session = open_session(model, ctx, args.backend, args.hooks)
                if mode == ThinkMode.MAX and ctx < THINK_MAX_MIN_CONTEXT:
                    mode = ThinkMode.HIGH
                print(f"ds4: context {ctx}", file=sys.stderr)
            elif cmd == "/read":
                try:
                    text = Path(rest).read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as e:
                    print(f"ds4: cannot read {rest!r}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
                    continue
                _repl_turn(args, tok, session, sampler, head, turns, text, mode, ctx)
            else:
                print(f"ds4: unknown command {cmd} (/help)", file=sys.stderr)
            continue
        _repl_turn(args, tok, session, sampler, head, turns, text, mode, ctx)
    if readline is not None:
        try:
            readline.write_history_file(HISTORY_FILE)
        except OSError:
            pass
    return 0


def _repl_turn(args, tok, session, sampler, head, turns: list[int], text: str, mode: ThinkMode, ctx: int) -> None:
    turn = [tok.user_id] + tok.encode(text)
    chat_append_assistant_prefix(tok, turn, mode)
    ids = head() + turns + turn
    if len(ids) >= ctx:
        print(f"ds4: the conversation is {len(ids)} tokens, the context is {ctx} (/ctx N)", file=sys.stderr)
        return
    sampler.reseed(args.seed)
    printer = Printer(tok, thinking=mode.enabled)
    with PrefillProgress(session):
        gen = generate(session, ids, min(args.tokens, ctx - len(ids) - 1), sampler, on_token=printer,
                       eos_id=tok.eos_id)
    printer.finish()
    if gen.finish_reason == "interrupted" and not gen.tokens:
        return  # roll the turn back; the next sync rebuilds from the common prefix
    turns += turn + gen.tokens + [tok.eos_id]
    _timing(gen)


# ---------------------------------------------------------------------------------------------


def _run(argv) -> int:
    args = build_parser().parse_args(argv)
    text = read_prompt(args)
    if args.dump_tokens:
        if text is None:
            raise CliError("--dump-tokens needs -p TEXT or --prompt-file FILE")
        dump_tokens(load_tokenizer(_model_path(args)), text, sys.stdout)
        return 0
    if args.threads:
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    model = load_model(args)
    if args.inspect:
        inspect(model, _model_path(args), sys.stdout)
        return 0
    args.hooks = steering_hooks(args, model)
    power.install(args.power)
    if (args.dump_logprobs or args.dump_logits) and text is None:
        raise CliError("--dump-logprobs/--dump-logits need -p TEXT or --prompt-file FILE")
    if text is not None:
        return run_one_shot(args, model, text)
    return run_repl(args, model)


def main(argv=None) -> int:
    previous = interrupt.install()  # a Ctrl+C is never swallowed by a finalizer: generate() raises it at the next token
    try:
        return _run(sys.argv[1:] if argv is None else argv)
    except CliError as e:
        print(f"ds4: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        try:
            sys.stdout.close()
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        interrupt.restore(previous)


if __name__ == "__main__":
    sys.exit(main())
