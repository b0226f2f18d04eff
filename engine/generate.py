"""The decode loop: prefill a prompt into a session, then sample token by token (runtime-spec §3).

`generate` works with any object that has the Session interface (`sync(tokens) -> logits`,
`decode(token) -> logits`). EOS stops generation and is not evaluated into the KV; the token
budget is the caller's (the CLI clamps it to ctx - pos - 1). `Utf8Stream` turns token bytes into
text for streaming, holding back an incomplete trailing UTF-8 sequence until it completes.

`logprob_steps` is the greedy continuation with top-k log-probabilities that `ds4 --dump-logprobs`
writes (runtime-spec §4.5).
"""

from __future__ import annotations

import codecs
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import interrupt


class Utf8Stream:
    """Bytes in, complete UTF-8 text out; invalid bytes become U+FFFD, incomplete tails wait."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (EOS), "length" (budget), "interrupted"
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


def generate(
    session,
    prompt_tokens: list[int],
    max_tokens: int,
    sampler,
    on_token: Callable[[int], None] | None = None,
    eos_id: int | None = None,
    logits=None,
) -> Generation:
    """Prefill `prompt_tokens` (reusing the session's common prefix) and sample up to `max_tokens`.

    `sampler.sample(logits) -> id`; `on_token(id)` is called for every kept token (not for EOS).
    A KeyboardInterrupt during prefill or decoding ends the generation with finish_reason "interrupted" and
    the tokens produced so far. `logits`, if given, are the session's current logits for exactly
    `prompt_tokens` (skips the sync)."""
    result = Generation(prompt_tokens=len(prompt_tokens))
    interrupt.forget()  # a Ctrl+C left pending by the previous generation's last step was meant for that one
    t0 = t1 = time.perf_counter()
    try:
        if logits is None:
            logits = session.sync(list(prompt_tokens))
        t1 = time.perf_counter()
        result.prefill_seconds = t1 - t0
        for step in range(max(0, max_tokens)):
            interrupt.check()  # a Ctrl+C that landed in a finalizer (ds4.engine.interrupt)
            token = int(sampler.sample(np.asarray(logits)))
            if eos_id is not None and token == eos_id:
                result.finish_reason = "stop"
                break
            result.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if step + 1 < max_tokens:
                logits = session.decode(token)
    except KeyboardInterrupt:
        result.finish_reason = "interrupted"
        if not result.prefill_seconds:
            result.prefill_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
    result.decode_seconds = time.perf_counter() - t1
    return result


# ---------------------------------------------------------------------------------------------
# --dump-logprobs


def log_softmax_at(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """logit - logsumexp(all finite logits), in double precision."""
    x = np.asarray(logits, dtype=np.float64)
    finite = x[np.isfinite(x)]
    m = finite.max()
    lse = m + math.log(np.exp(finite - m).sum())
    return x[ids] - lse


def top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """The k largest logits, descending, equal logits with the lower id first; non-finite last."""
    x = np.asarray(logits, dtype=np.float32)
    key = np.where(np.isfinite(x), x, -np.inf)
    return np.argsort(-key, kind="stable")[:k]


def logprob_steps(session, prompt_tokens: list[int], steps: int, top_k: int, eos_id: int) -> list[dict]:
    """Greedy continuation; per step the selected id and the top-k (id, logit, logprob). The EOS
    step is recorded, then the loop stops."""
    out = []
    logits = session.sync(list(prompt_tokens))
    for step in range(max(0, steps)):
        logits = np.asarray(logits, dtype=np.float32)
        ids = top_ids(logits, top_k)
        lps = log_softmax_at(logits, ids)
        selected = int(ids[0]) if len(ids) else 0
        out.append({"step": step, "selected": selected,
                    "top": [(int(i), float(logits[i]), float(lp)) for i, lp in zip(ids, lps)]})
        if selected == eos_id or step + 1 >= steps:
            break
        logits = session.decode(selected)
    return out
