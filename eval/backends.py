"""ds4-eval backends: the local engine and any OpenAI-compatible chat-completions server.

Both expose the same small interface used by runner.EvalRun:

* `name`, `model` — written to the trace header;
* `count_prompt_tokens(question, think)` — prompt length for context sizing (None if unknown);
* `prepare(ctx)` — allocate what the run needs (the local engine's one reused session);
* `generate(question, settings, pos, progress, control, sink)` — run one case, updating
  `progress` (text, token counts, think-close record) as tokens arrive, calling
  `control.checkpoint()` between tokens and `sink.text(...)` for the live stream.

The local backend implements the §7.3 loop exactly, token by token: hard and soft `</think>`
cut-off, greedy at temperature 0, ds4 sampling otherwise. An HTTP server cannot be steered per
token, so the OpenAI backend asks for `--tokens` tokens and records only natural think closes.
"""

from __future__ import annotations

import codecs
import json
import os

import numpy as np

from .grading import THINK_CLOSE
from .runner import CaseInterrupted, CaseProgress, GenSettings, RunControl


class BackendError(RuntimeError):
    """The backend cannot be used at all (bad model path, unreachable server): exit 2."""


def _think_mode(think: str):
    from ds4.engine.chat import ThinkMode
    return {"none": ThinkMode.NONE, "high": ThinkMode.HIGH, "max": ThinkMode.MAX}[think]


def close_rank(logits: np.ndarray, token: int, k: int) -> int:
    """1-based rank of `token` among the top-k raw logits, 0 when it is not in the top k.
    Ties count in the token's favour (only strictly larger logits rank above it)."""
    above = int(np.count_nonzero(logits > logits[token]))
    return above + 1 if above < k else 0


def think_close_decision(progress: CaseProgress, settings: GenSettings, logits: np.ndarray,
                         close_id: int | None) -> tuple[str, int]:
    """(kind, rank) when `</think>` must be emitted instead of sampling, else ("", 0) (§7.3)."""
    if close_id is None or not progress.thinking_open:
        return "", 0
    remaining = progress.limit - progress.generated
    if remaining <= settings.hard_budget:
        return "hard_forced", 0
    if remaining <= settings.soft_budget:
        rank = close_rank(logits, close_id, settings.close_rank)
        if rank:
            return "soft_forced", rank
    return "", 0


class EngineTimeline:
    """The one reused KV timeline of a local run: reuse the common prefix with the previous
    prompt, rebuild otherwise, then decode token by token. Uses ds4.engine.session.Session."""

    def __init__(self, model, ctx: int, backend: str | None = None, hooks=None):
        from ds4.engine.cli import CliError, open_session
        if hooks is not None:       # steering edits sublayer outputs: the CPU engine's hooks
            if backend == "cuda":
                raise BackendError("directional steering needs --backend cpu")
            from ds4.engine import power
            from ds4.engine.session import Session
            self.session = Session(model, ctx=ctx, hooks=hooks)
            power.attach(self.session)      # --power: throttle between layers (open_session does too)
            return
        try:
            self.session = open_session(model, ctx, backend)
        except CliError as exc:
            raise BackendError(str(exc)) from None

    def prefill(self, tokens: list[int], progress_cb) -> np.ndarray:
        if hasattr(self.session, "progress"):
            self.session.progress = progress_cb
        try:
            return np.asarray(self.session.sync(tokens))
        finally:
            if hasattr(self.session, "progress"):
                self.session.progress = None

    def step(self, token: int) -> np.ndarray:
        return np.asarray(self.session.decode(token))


class LocalBackend:
    """The in-process engine (`-m model.gguf`)."""

    def __init__(self, model_path: str, engine_backend: str | None = None):
        from ds4.engine.model import Model
        self.engine_backend = engine_backend      # cpu | cuda | None (cuda when it can run)
        self.model_path = str(model_path)
        if not os.path.exists(self.model_path):
            raise BackendError(f"{self.model_path}: no such model file")
        try:
            self.model = Model.load(self.model_path)
            self.tokenizer = self.model.tokenizer
        except (OSError, ValueError) as exc:
            raise BackendError(f"{self.model_path}: cannot load model ({exc})") from None
        self.name = "local"
        self.model_name = os.path.basename(self.model_path)
        self.timeline: EngineTimeline | None = None
        self.hooks = None                          # e.g. directional steering (ds4.steering)
        self._prompt_cache: dict = {}

    def prompt_tokens(self, question, think: str) -> list[int]:
        key = (question.index, question.id, think)
        ids = self._prompt_cache.get(key)
        if ids is None:
            from ds4.engine.chat import encode_chat_prompt
            ids = encode_chat_prompt(self.tokenizer, question.system_prompt, question.user_prompt,
                                     _think_mode(think))
            self._prompt_cache[key] = ids
        return ids

    def count_prompt_tokens(self, question, think: str) -> int:
        return len(self.prompt_tokens(question, think))

    def prepare(self, ctx: int) -> None:
        self.timeline = EngineTimeline(self.model, ctx, self.engine_backend, self.hooks)

    def kv_bytes(self) -> int:
        session = self.timeline.session if self.timeline else None
        return session.kv_bytes() if hasattr(session, "kv_bytes") else 0

    def generate(self, question, settings: GenSettings, pos: int, progress: CaseProgress,
                 control: RunControl, sink) -> None:
        from ds4.engine.sampling import Sampler
        tok = self.tokenizer
        prompt = self.prompt_tokens(question, settings.think)
        progress.prompt_tokens = len(prompt)
        close = tok.encode_chat(THINK_CLOSE)
        close_id = close[0] if len(close) == 1 else None

        def on_prefill(done: int, total: int) -> None:
            progress.prefill_done = done
            sink.prefill(done, total)
            control.checkpoint()

        control.checkpoint()
        from ds4.engine import power
        power.pause()       # grading and UI time between cases is not the engine's busy time
        logits = self.timeline.prefill(prompt, on_prefill)
        sink.started()
        sampler = Sampler(temperature=settings.temperature, top_k=0, top_p=settings.top_p,
                          min_p=settings.min_p, seed=settings.case_seed(question.index))
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while progress.generated < progress.limit:
            control.checkpoint()
            forced, rank = think_close_decision(progress, settings, logits, close_id)
            if forced == "hard_forced" and close_id is None:
                ids = close                     # </think> is several tokens: emit them all
            else:
                ids = [close_id] if forced else [sampler.sample(logits)]
            if ids[0] == tok.eos_id:
                progress.finish = "stop"
                break
            for t in ids:
                progress.generated += 1
                piece = decoder.decode(tok.decode_token(t))
                thinking = progress.thinking_open
                progress.text += piece
                progress.note_close(forced or "natural", rank)
                if piece:
                    sink.text(piece, thinking)
                if progress.generated < progress.limit:
                    logits = self.timeline.step(t)
        else:
            progress.finish = "length"
        tail = decoder.decode(b"", final=True)
        if tail:
            progress.text += tail
            sink.text(tail, progress.thinking_open)


class OpenAIBackend:
    """Any OpenAI-compatible `/v1/chat/completions` server, streamed (`--base-url`)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 extra_body: dict | None = None, timeout: float = 600.0):
        import openai
        self.name = "openai"
        self.base_url = base_url.rstrip("/")
        self.client = openai.OpenAI(base_url=self.base_url,
                                    api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none",
                                    max_retries=0, timeout=timeout)
        self.extra_body = dict(extra_body or {})
        try:
            models = [m.id for m in self.client.models.list().data]
        except openai.APIConnectionError:
            raise BackendError(f"{self.base_url}: cannot connect to the server") from None
        except openai.APIError as exc:
            if model is None:
                raise BackendError(f"{self.base_url}: cannot list models ({exc})") from None
            models = []
        if model is None:
            if not models:
                raise BackendError(f"{self.base_url}: the server lists no model; pass --api-model")
            model = models[0]
        self.model_name = model

    def count_prompt_tokens(self, question, think: str):
        return None

    def prepare(self, ctx: int) -> None:
        pass

    def request_args(self, question, settings: GenSettings, limit: int) -> dict:
        thinking = settings.think != "none"
        body = {
            # ds4-server reads `thinking`; vLLM and SGLang pass chat_template_kwargs to the
            # DeepSeek chat template; `min_p` is a common extension.
            "thinking": {"type": "enabled" if thinking else "disabled"},
            "chat_template_kwargs": {"thinking": thinking},
            "min_p": settings.min_p,
        }
        body.update(self.extra_body)
        return dict(
            model=self.model_name,
            messages=[{"role": "system", "content": question.system_prompt},
                      {"role": "user", "content": question.user_prompt}],
            max_tokens=limit, temperature=settings.temperature, top_p=settings.top_p,
            seed=settings.case_seed(question.index) & 0x7FFFFFFFFFFFFFFF, stream=True,
            stream_options={"include_usage": True}, extra_body=body,
        )

    def generate(self, question, settings: GenSettings, pos: int, progress: CaseProgress,
                 control: RunControl, sink) -> None:
        control.checkpoint()
        stream = self.client.chat.completions.create(
            **self.request_args(question, settings, progress.limit))
        saw_reasoning = False
        try:
            for chunk in stream:
                control.checkpoint()
                if chunk.usage is not None:
                    progress.prompt_tokens = chunk.usage.prompt_tokens or progress.prompt_tokens
                    if chunk.usage.completion_tokens is not None:
                        progress.generated = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                delta = choice.delta
                extra = getattr(delta, "model_extra", None) or {}
                reasoning = extra.get("reasoning_content") or extra.get("reasoning") or ""
                content = delta.content or ""
                if reasoning:
                    saw_reasoning = True
                    sink.started()
                    progress.generated += 1
                    progress.text += reasoning
                    sink.text(reasoning, True)
                if content:
                    sink.started()
                    progress.generated += 1 if not reasoning else 0
                    if saw_reasoning and progress.thinking_open:
                        progress.text += THINK_CLOSE      # the server split reasoning off
                        sink.text(THINK_CLOSE, True)
                    thinking = progress.thinking_open and not saw_reasoning
                    progress.text += content
                    progress.note_close("natural")
                    sink.text(content, thinking)
                if choice.finish_reason:
                    progress.finish = choice.finish_reason
        finally:
            stream.close()


def parse_extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BackendError(f"--extra-body: malformed JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise BackendError("--extra-body must be a JSON object")
    return value


__all__ = ["BackendError", "LocalBackend", "OpenAIBackend", "CaseInterrupted", "close_rank",
           "think_close_decision", "parse_extra_body"]
