"""`ds4-server`: a minimal OpenAI-compatible HTTP server over the ds4 engine (runtime-spec §5).

    ds4-server -m model.gguf --ctx 32768 --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages":[{"role":"user","content":"Hi"}]}'

What it serves (the subset of ds4_server.c that chat clients and ds4-eval need):

* `GET /v1/models`, `GET /v1/models/<id>`;
* `POST /v1/chat/completions`, streaming (SSE `chat.completion.chunk`s: role, `reasoning_content`
  deltas until `</think>`, `content` deltas, finish, optional usage chunk, `[DONE]`) and not;
* `POST /v1/completions` (the legacy text endpoint, raw output);
* `OPTIONS` → 204; anything else 404; errors as `{"error":{"message","type"}}`.

Prompts are rendered exactly as ds4's server does (ds4.engine.chat.render_chat, then rendered-
chat tokenization), thinking controls follow §5.4 (`thinking`, `think`, `reasoning_effort`, the
`deepseek-chat` / `deepseek-reasoner` aliases), and — as in ds4 — thinking mode ignores the
client's sampling knobs (T=1, top_p=1, min_p=0.05) unless `--client-sampling` is given.

One process, one model, one live session (one KV timeline, reused when a request extends it):
connections are served by threads, generation runs one request at a time under a lock.
Not implemented: tool-call parsing (DSML → `tool_calls`), Responses and Anthropic endpoints,
the disk KV cache, `--trace`.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ds4.engine.chat import ThinkMode, render_chat, render_completion_prompt, \
    think_mode_for_context

THINK_CLOSE = "</think>"
THINK_OPEN = "<think>"
DEFAULT_MODEL_ID = "deepseek-v4-flash"
MAX_BODY = 64 << 20
THINKING_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.05}


class RequestError(Exception):
    def __init__(self, status: int, message: str, **extra):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


# ---------------------------------------------------------------------------------------------
# request → generation parameters


def _number(body: dict, key: str, default, kind=float):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{key} must be a number")
    return kind(value)


def resolve_think_mode(body: dict, ctx: int) -> ThinkMode:
    """§5.4: explicit controls first, then model aliases; MAX needs a large context."""
    enabled: bool | None = None
    effort: ThinkMode | None = None
    thinking = body.get("thinking")
    if isinstance(thinking, bool):
        enabled = thinking
    elif isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        enabled = thinking["type"] == "enabled"
    if isinstance(body.get("think"), bool):
        enabled = body["think"]
    name = body.get("reasoning_effort")
    if name is not None:
        if name == "max":
            effort = ThinkMode.MAX
        elif name in ("xhigh", "high", "medium", "low", "minimal"):
            effort = ThinkMode.HIGH
        elif name == "none":
            effort = ThinkMode.NONE
        else:
            raise RequestError(400, f"unsupported reasoning_effort {name!r}")
    if enabled is None and effort is None:
        model = body.get("model")
        if model == "deepseek-chat":
            enabled = False
        elif model == "deepseek-reasoner":
            enabled = True
    if enabled is False or effort == ThinkMode.NONE:
        return ThinkMode.NONE
    return think_mode_for_context(effort or ThinkMode.HIGH, ctx)


def parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError(400, "stop must be a string or an array of strings")
    return [s for s in items if s]


class Job:
    """One parsed request, ready to run."""

    def __init__(self, kind: str, body: dict, prompt_text: str, think: ThinkMode,
                 default_max: int):
        self.kind = kind                       # chat | completion
        self.body = body
        self.prompt_text = prompt_text
        self.think = think
        self.model = body.get("model") if isinstance(body.get("model"), str) else DEFAULT_MODEL_ID
        self.stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = default_max
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(400, "max_tokens must be a positive integer")
        self.max_tokens = max_tokens
        self.temperature = _number(body, "temperature", 1.0)
        self.top_p = _number(body, "top_p", 1.0)
        self.min_p = _number(body, "min_p", 0.05)
        self.top_k = _number(body, "top_k", 0, int)
        self.seed = _number(body, "seed", 0, int)
        self.stop = parse_stop(body)


# ---------------------------------------------------------------------------------------------
# generation


class Engine:
    """The model, its tokenizer and the one live session, used by one request at a time."""

    def __init__(self, model_path: str, ctx: int, max_tokens: int, client_sampling: bool = False,
                 backend: str | None = None, steering_args=None):
        from ds4.engine.cli import CliError, open_session
        from ds4.engine.model import Model
        self.model = Model.load(model_path)
        self.tokenizer = self.model.tokenizer
        self.ctx = ctx
        self.max_tokens = max_tokens
        self.client_sampling = client_sampling
        hooks = None
        if steering_args is not None:
            from ds4.steering import apply as steering
            hooks = steering.hooks_from_args(steering_args, self.model.config)
        if hooks is not None:           # steering edits sublayer outputs through CPU hooks
            if backend == "cuda":
                raise CliError("directional steering needs --backend cpu")
            from ds4.engine.session import Session
            self.session = Session(self.model, ctx=ctx, hooks=hooks)
        else:
            self.session = open_session(self.model, ctx, backend)
        self.lock = threading.Lock()
        self.seq = 0
        self.shutting_down = False

    def sampler_for(self, job: Job):
        from ds4.engine.sampling import Sampler
        knobs = {"temperature": job.temperature, "top_k": job.top_k, "top_p": job.top_p,
                 "min_p": job.min_p}
        if job.think.enabled and not self.client_sampling:
            knobs = dict(THINKING_SAMPLING)
        seed = job.seed if job.seed > 0 else \
            ((int(time.time()) << 32) ^ (self.seq << 1) ^ id(job)) & 0xFFFFFFFFFFFFFFFF
        return Sampler(seed=seed, **knobs)

    def run(self, job: Job, prompt: list[int], emit) -> dict:
        """Generate for `job`; `emit(kind, text)` receives reasoning/content deltas as they
        become safe to send. Returns the parsed result with usage."""
        tok = self.tokenizer
        live = list(getattr(self.session, "tokens", []))
        cached = len(live) if live and prompt[:len(live)] == live else 0
        logits = self.session.sync(prompt)
        limit = min(job.max_tokens, self.ctx - len(prompt))
        sampler = self.sampler_for(job)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        splitter = StreamSplitter(job.think.enabled and job.kind == "chat", job.stop)
        generated, finish = 0, "length"
        while generated < limit:
            if self.shutting_down:
                finish = "error"
                break
            token = sampler.sample(logits)
            if token == tok.eos_id:
                finish = "stop"
                break
            generated += 1
            if splitter.feed(decoder.decode(tok.decode_token(token)), emit):
                finish = "stop"
                break
            if generated < limit:
                logits = self.session.decode(token)
        if finish != "stop" or not splitter.stopped:
            splitter.feed(decoder.decode(b"", final=True), emit)
        splitter.flush(emit)
        return {"finish": finish, "raw": splitter.raw, "prompt_tokens": len(prompt),
                "completion_tokens": generated, "cached_tokens": cached}


class StreamSplitter:
    """Turns the raw generated text into safe-to-send reasoning/content deltas (§5.7 holding
    rules: a possible `</think>` prefix and `max_stop_len - 1` bytes are held back)."""

    def __init__(self, thinking: bool, stops: list[str]):
        self.thinking = thinking
        self.stops = stops
        self.raw = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.stopped = False

    def _parts(self) -> tuple[str, str, bool]:
        if not self.thinking:
            return "", self.raw, True
        cut = self.raw.find(THINK_CLOSE)
        if cut < 0:
            body = self.raw[len(THINK_OPEN):] if self.raw.startswith(THINK_OPEN) else self.raw
            return body, "", False
        body = self.raw[:cut]
        body = body[len(THINK_OPEN):] if body.startswith(THINK_OPEN) else body
        return body, self.raw[cut + len(THINK_CLOSE):], True

    def _hold(self, text: str, closed: bool) -> int:
        hold = 0
        if not closed:
            for k in range(min(len(THINK_CLOSE) - 1, len(text)), 0, -1):
                if text.endswith(THINK_CLOSE[:k]):
                    hold = k
                    break
        if self.stops:
            hold = max(hold, min(len(text), max(len(s) for s in self.stops) - 1))
        return hold

    def feed(self, piece: str, emit) -> bool:
        """Add text; emit what is safe. True when a stop sequence ended the output."""
        self.raw += piece
        if self.stops:
            hits = [i for i in (self.raw.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.raw = self.raw[:min(hits)]
                self.stopped = True
                return True
        self._emit(emit, final=False)
        return False

    def flush(self, emit) -> None:
        self._emit(emit, final=True)

    def _emit(self, emit, final: bool) -> None:
        reasoning, content, closed = self._parts()
        if not closed:
            end = len(reasoning) if final else len(reasoning) - self._hold(reasoning, False)
            if end > self.sent_reasoning:
                emit("reasoning", reasoning[self.sent_reasoning:end])
                self.sent_reasoning = end
            return
        if len(reasoning) > self.sent_reasoning:
            emit("reasoning", reasoning[self.sent_reasoning:])
            self.sent_reasoning = len(reasoning)
        end = len(content) if final else len(content) - self._hold(content, True)
        if end > self.sent_content:
            emit("content", content[self.sent_content:end])
            self.sent_content = end


def parse_message(raw: str, thinking: bool) -> tuple[str, str | None]:
    """(content, reasoning) of a generated chat message (§5.5, tool calls aside)."""
    if not thinking:
        return raw, None
    cut = raw.find(THINK_CLOSE)
    if cut < 0:
        return raw, None
    reasoning = raw[:cut]
    if reasoning.startswith(THINK_OPEN):
        reasoning = reasoning[len(THINK_OPEN):]
    return raw[cut + len(THINK_CLOSE):], reasoning


def usage(result: dict) -> dict:
    p, g, c = result["prompt_tokens"], result["completion_tokens"], result["cached_tokens"]
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g,
            "prompt_tokens_details": {"cached_tokens": c, "cache_write_tokens": p - c}}


# ---------------------------------------------------------------------------------------------
# HTTP


def model_object(engine: Engine) -> dict:
    return {"id": DEFAULT_MODEL_ID, "object": "model", "created": 1767225600, "owned_by": "ds4",
            "name": "DeepSeek V4 Flash", "context_length": engine.ctx,
            "top_provider": {"context_length": engine.ctx,
                             "max_completion_tokens": min(engine.max_tokens, engine.ctx),
                             "is_moderated": False},
            "supported_parameters": ["max_tokens", "temperature", "top_p", "top_k", "min_p",
                                     "stop", "seed", "stream", "reasoning_effort"]}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "ds4-server"
    engine: Engine = None           # set on the subclass made by make_server
    cors = False
    quiet = False

    def log_message(self, fmt, *args):
        if not self.quiet:
            sys.stderr.write("ds4-server: %s %s\n" % (self.address_string(), fmt % args))

    # -- plumbing
    def _headers(self, status: int, ctype: str | None, length: int | None) -> None:
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")
        if self.cors:
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "*")
        self.end_headers()

    def _json(self, status: int, obj: dict) -> None:
        data = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        self._headers(status, "application/json", len(data))
        self.wfile.write(data)
        self.close_connection = True

    def _error(self, err: RequestError) -> None:
        self._json(err.status, {"error": {"message": err.message,
                                          "type": "invalid_request_error", **err.extra}})

    def _sse(self, obj) -> None:
        text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                           separators=(",", ":"))
        self.wfile.write(f"data: {text}\n\n".encode())
        self.wfile.flush()

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY:
            raise RequestError(400, "invalid JSON request")
        try:
            body = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError(400, "invalid JSON request") from None
        if not isinstance(body, dict):
            raise RequestError(400, "invalid JSON request")
        return body

    # -- routes
    def do_OPTIONS(self):
        self._headers(204, None, 0)
        self.close_connection = True

    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/models":
            self._json(200, {"object": "list", "data": [model_object(self.engine)]})
        elif path.startswith("/v1/models/"):
            obj = model_object(self.engine)
            obj["id"] = path[len("/v1/models/"):]
            self._json(200, obj)
        else:
            self._error(RequestError(404, "unknown endpoint"))

    def do_POST(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if self.engine.shutting_down:
                raise RequestError(503, "server shutting down")
            if path == "/v1/chat/completions":
                job = self._chat_job(self._body())
            elif path == "/v1/completions":
                job = self._completion_job(self._body())
            else:
                raise RequestError(404, "unknown endpoint")
            prompt = self.engine.tokenizer.encode_chat(job.prompt_text)
            if len(prompt) >= self.engine.ctx:
                raise RequestError(
                    400, f"Prompt has {len(prompt)} tokens, but the configured context size is "
                    f"{self.engine.ctx} tokens", param="messages" if job.kind == "chat"
                    else "prompt", code="context_length_exceeded",
                    n_prompt_tokens=len(prompt), n_ctx=self.engine.ctx)
        except RequestError as err:
            self._error(err)
            return
        with self.engine.lock:
            self.engine.seq += 1
            rid = self.engine.seq
            if job.stream:
                self._stream(job, prompt, rid)
            else:
                self._complete(job, prompt, rid)

    def _chat_job(self, body: dict) -> Job:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or \
                not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "missing messages")
        think = resolve_think_mode(body, self.engine.ctx)
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        try:
            text = render_chat(messages, tools=tools or None, think=think)
        except (TypeError, ValueError, AttributeError) as exc:
            raise RequestError(400, f"cannot render messages ({exc})") from None
        return Job("chat", body, text, think, self.engine.max_tokens)

    def _completion_job(self, body: dict) -> Job:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = next((p for p in prompt if isinstance(p, str)), None)
        if not isinstance(prompt, str):
            raise RequestError(400, "missing prompt")
        think = resolve_think_mode(body, self.engine.ctx)
        return Job("completion", body, render_completion_prompt(prompt, think), think,
                   self.engine.max_tokens)

    def _complete(self, job: Job, prompt: list[int], rid: int) -> None:
        try:
            result = self.engine.run(job, prompt, lambda kind, text: None)
        except Exception as exc:   # engine failure: report it, keep serving
            self._json(500, {"error": {"message": f"generation failed: {exc}",
                                       "type": "server_error"}})
            return
        created = int(time.time())
        if job.kind == "completion":
            self._json(200, {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                             "model": job.model, "choices": [{"text": result["raw"], "index": 0,
                                                               "finish_reason": result["finish"]}],
                             "usage": usage(result)})
            return
        content, reasoning = parse_message(result["raw"], job.think.enabled)
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        self._json(200, {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                         "model": job.model, "choices": [{"index": 0, "message": message,
                                                          "finish_reason": result["finish"]}],
                         "usage": usage(result)})

    def _stream(self, job: Job, prompt: list[int], rid: int) -> None:
        created = int(time.time())
        chat = job.kind == "chat"
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": job.model}
        self._headers(200, "text/event-stream", None)
        self.close_connection = True

        def chunk(delta: dict | None, finish=None, text=None) -> dict:
            if chat:
                return {**base, "choices": [{"index": 0, "delta": delta,
                                             "finish_reason": finish}]}
            return {**base, "choices": [{"text": text, "index": 0, "finish_reason": finish}]}

        def emit(kind: str, text: str) -> None:
            if not chat:
                self._sse(chunk(None, text=text))
            elif kind == "reasoning":
                self._sse(chunk({"reasoning_content": text}))
            else:
                self._sse(chunk({"content": text}))

        try:
            if chat:
                self._sse(chunk({"role": "assistant"}))
            result = self.engine.run(job, prompt, emit)
            self._sse(chunk({}, result["finish"], text=""))
            if job.include_usage:
                self._sse({**base, "choices": [], "usage": usage(result)})
            self._sse("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            pass                         # the client went away (e.g. ds4-eval switched case)
        except Exception as exc:
            try:
                self.wfile.write(("event: error\ndata: " + json.dumps(
                    {"error": {"message": str(exc), "type": "server_error"}}) + "\n\n").encode())
            except OSError:
                pass


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8000, cors: bool = False,
                quiet: bool = False) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"engine": engine, "cors": cors, "quiet": quiet})
    host = "127.0.0.1" if host == "localhost" else host
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def build_parser() -> argparse.ArgumentParser:
    from ds4.paths import default_model
    p = argparse.ArgumentParser(prog="ds4-server", description="OpenAI-compatible chat "
                                "completions server over the ds4 engine.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-m", "--model", default=str(default_model()), help="GGUF model")
    p.add_argument("-c", "--ctx", type=int, default=32768, help="context size (tokens)")
    p.add_argument("-n", "--tokens", type=int, default=393216,
                   help="default max_tokens of a request")
    p.add_argument("--backend", choices=("cpu", "cuda"),
                   help="engine backend (default: cuda when it can run, else cpu)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--cors", action="store_true", help="add permissive CORS headers")
    p.add_argument("--client-sampling", action="store_true",
                   help="honour the client's temperature/top_p/min_p in thinking mode too "
                   "(ds4 forces T=1, top_p=1, min_p=0.05 there)")
    p.add_argument("--quiet", action="store_true", help="do not log requests")
    from ds4.steering import apply as steering
    steering.add_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.ctx < 2:
        print("ds4-server: --ctx must be >= 2", file=sys.stderr)
        return 2
    if args.tokens < 1 or not 0 <= args.port <= 65535:
        print("ds4-server: --tokens must be > 0 and --port in 0..65535", file=sys.stderr)
        return 2
    if not os.path.isfile(args.model):
        print(f"ds4-server: {args.model}: no such model file", file=sys.stderr)
        return 2
    from ds4.engine.cli import CliError
    from ds4.steering.format import SteeringFileError
    try:
        engine = Engine(args.model, args.ctx, args.tokens, args.client_sampling, args.backend,
                        steering_args=args)
    except (CliError, SteeringFileError) as exc:
        print(f"ds4-server: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"ds4-server: {args.model}: cannot load model ({exc})", file=sys.stderr)
        return 2
    try:
        server = make_server(engine, args.host, args.port, args.cors, args.quiet)
    except OSError as exc:
        print(f"ds4-server: cannot listen on {args.host}:{args.port} ({exc.strerror})",
              file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"ds4-server: listening on http://{host}:{port}/v1 (ctx {args.ctx})", file=sys.stderr,
          flush=True)

    def stop(signum, frame):
        if engine.shutting_down:
            os._exit(130)
        engine.shutting_down = True
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
