"""The frontier sweep of tooling-spec §6.2, written against the Session API.

Frontiers: f_0 = ctx_start; f_{k+1} = f_k + step_incr (step_mul == 1) or max(ceil(f_k·step_mul), f_k+1)
(step_mul > 1), clamped to ctx_max; ctx_max is always the last row. For each frontier:
  1. time `session.sync(tokens[:f])` — the session already holds the previous prefix, so only the
     interval [prev, f) is prefilled;
  2. snapshot the session (untimed);
  3. time `gen_tokens` greedy decode steps, each the argmax excluding EOS (a session with `greedy_on_device`, the
     CUDA engine's, runs them as `greedy(gen_tokens, banned=EOS)`: the same tokens, no logits copied to the host);
  4. restore the snapshot (untimed) and go on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from .csvio import BenchRow


class BenchSession(Protocol):
    def sync(self, tokens) -> np.ndarray: ...
    def decode(self, token: int) -> np.ndarray: ...
    def snapshot(self): ...
    def restore(self, snap) -> None: ...


def frontiers(ctx_start: int, ctx_max: int, step_incr: int = 2048, step_mul: float = 1.0) -> Iterator[int]:
    if ctx_start <= 0 or ctx_max <= 0 or step_incr <= 0:
        raise ValueError("ctx_start, ctx_max and step_incr must be positive")
    if step_mul < 1:
        raise ValueError("step_mul must be >= 1")
    f = min(ctx_start, ctx_max)
    while True:
        yield f
        if f >= ctx_max:
            return
        nxt = f + step_incr if step_mul == 1 else max(math.ceil(f * step_mul), f + 1)
        f = min(nxt, ctx_max)


def argmax_excluding(logits: np.ndarray, banned: int | None) -> int:
    """Greedy token that is never `banned` (EOS): a speed probe must not stop early."""
    if banned is None or not (0 <= banned < logits.shape[-1]):
        return int(np.argmax(logits))
    x = np.asarray(logits)
    best = int(np.argmax(x))
    if best != banned:
        return best
    y = x.copy()
    y[banned] = -np.inf
    return int(np.argmax(y))


def snapshot_bytes(snap) -> int:
    """Byte size of a session snapshot (bytes-like, or an object exposing nbytes / __len__)."""
    if isinstance(snap, (bytes, bytearray, memoryview)):
        return len(snap)
    for attr in ("nbytes", "size_bytes"):
        v = getattr(snap, attr, None)
        if v is not None:
            return int(v() if callable(v) else v)
    try:
        return len(snap)
    except TypeError:
        return 0


def sweep(session: BenchSession, tokens, fronts, gen_tokens: int, eos_id: int | None,
          on_row: Callable[[BenchRow], None] | None = None, throttle_step: Callable[[], None] | None = None,
          kv_bytes: Callable[[object], int] | None = None) -> list[BenchRow]:
    """Run the sweep; `throttle_step` (the --power throttle) is called between decode steps and
    excluded from nothing: the timings include throttle sleeps only when one is installed."""
    rows: list[BenchRow] = []
    prev = 0
    on_device = getattr(session, "greedy_on_device", False) and throttle_step is None  # the throttle runs per step
    tokens = list(tokens)
    for f in fronts:
        if f > len(tokens):
            raise ValueError(f"frontier {f} is past the {len(tokens)} prompt tokens")
        t0 = time.perf_counter()
        logits = session.sync(tokens[:f])
        t_prefill = time.perf_counter() - t0
        snap = session.snapshot()
        size = kv_bytes(snap) if kv_bytes else snapshot_bytes(snap)
        t0 = time.perf_counter()
        if on_device:
            session.greedy(gen_tokens, banned=eos_id)
        else:
            for _ in range(gen_tokens):
                tok = argmax_excluding(np.asarray(logits), eos_id)
                logits = session.decode(tok)
                if throttle_step is not None:
                    throttle_step()
        t_gen = time.perf_counter() - t0
        session.restore(snap)
        row = BenchRow(ctx_tokens=f, prefill_tokens=f - prev,
                       prefill_tps=(f - prev) / t_prefill if t_prefill > 0 else 0.0,
                       gen_tokens=gen_tokens, gen_tps=gen_tokens / t_gen if t_gen > 0 else 0.0,
                       kvcache_bytes=size)
        rows.append(row)
        if on_row is not None:
            on_row(row)
        prev = f
    return rows
