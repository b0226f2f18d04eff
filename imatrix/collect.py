"""Collecting routed-expert importance through the engine hooks (tooling-spec §3.1).

Per layer L and expert e (float32 sums, token-major then slot order, as ds4 accumulates):

    gate_up_sum2[L][e] += x²     for every (token, slot) routed to e   x   = RMS-normalised FFN input
    down_sum2[L][e]    += mid²   for the same (token, slot)            mid = route-weighted SwiGLU
    count[L][e]        += 1

Slots with an id outside 0..n_expert-1 are ignored. Gate and up share one sum (the same input).
With `all_tensors`, the shared expert's gate/up (input x for every token) is collected too, and any
further per-tensor inputs the engine reports through `linear_input(layer, name, x)`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numba
import numpy as np

from ds4.engine.hooks import Hooks
from ds4.gguf_tools.constants import LayerTensor, blk
from ds4.imatrix.format import Imatrix, ImatrixEntry

PROMPT_MARKER = "===== DS4_IMATRIX_PROMPT"


# ---- accumulation kernels: numpy reference and numba --------------------------------------------

def accumulate_token_rows_ref(sum2: np.ndarray, counts: np.ndarray, x: np.ndarray, ids: np.ndarray) -> None:
    """sum2[e] += x[t]² and counts[e] += 1 for each (t, slot) with ids[t, slot] = e (reference)."""
    n_expert = sum2.shape[0]
    for t in range(ids.shape[0]):
        sq = x[t].astype(np.float32) ** 2
        for e in ids[t]:
            if 0 <= e < n_expert:
                sum2[e] += sq
                counts[e] += 1


def accumulate_slot_rows_ref(sum2: np.ndarray, rows: np.ndarray, ids: np.ndarray) -> None:
    """sum2[e] += rows[t, slot]² for each (t, slot) with ids[t, slot] = e (reference)."""
    n_expert = sum2.shape[0]
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            if 0 <= e < n_expert:
                sum2[e] += rows[t, s].astype(np.float32) ** 2


@numba.njit(cache=True, nogil=True)
def _accumulate_token_rows(sum2, counts, x, ids):
    n_expert, width = sum2.shape
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            if e < 0 or e >= n_expert:
                continue
            counts[e] += 1
            for i in range(width):
                v = np.float32(x[t, i])
                sum2[e, i] += v * v


@numba.njit(cache=True, nogil=True)
def _accumulate_slot_rows(sum2, rows, ids):
    n_expert, width = sum2.shape
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            if e < 0 or e >= n_expert:
                continue
            for i in range(width):
                v = np.float32(rows[t, s, i])
                sum2[e, i] += v * v


def accumulate_token_rows(sum2, counts, x, ids) -> None:
    _accumulate_token_rows(sum2, counts, np.ascontiguousarray(x, np.float32), np.ascontiguousarray(ids, np.int64))


def accumulate_slot_rows(sum2, rows, ids) -> None:
    _accumulate_slot_rows(sum2, np.ascontiguousarray(rows, np.float32), np.ascontiguousarray(ids, np.int64))


# ---- the accumulator -----------------------------------------------------------------------------

class RoutedAccumulator:
    """Per-layer, per-expert sums of squared inputs and routing counts for one model config."""

    def __init__(self, config, all_tensors: bool = False):
        L, E = config.n_layer, config.n_expert
        self.config = config
        self.gate_up_sum2 = np.zeros((L, E, config.n_embd), np.float32)
        self.down_sum2 = np.zeros((L, E, config.expert_ffn), np.float32)
        self.counts = np.zeros((L, E), np.int64)
        self.down_counts = np.zeros((L, E), np.int64)
        self.all_tensors = all_tensors
        # name → [sum2 (ncols), rows]; only with all_tensors
        self.dense: dict[str, list] = {}
        self.tokens = 0  # prompt tokens pushed through the model
        self.chunks = 0  # (batch, layer) calls, as ds4 counts them

    def add_routed(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, down_inputs: np.ndarray) -> None:
        """x [T, n_embd] (FFN norm output), expert_ids [T, k], down_inputs [T, k, expert_ffn]."""
        x = np.asarray(x).reshape(-1, self.config.n_embd)
        ids = np.asarray(expert_ids).reshape(x.shape[0], -1)
        accumulate_token_rows(self.gate_up_sum2[layer], self.counts[layer], x, ids)
        if down_inputs is not None:
            mid = np.asarray(down_inputs).reshape(ids.shape[0], ids.shape[1], -1)
            accumulate_slot_rows(self.down_sum2[layer], mid, ids)
            valid = (ids >= 0) & (ids < self.config.n_expert)
            np.add.at(self.down_counts[layer], ids[valid], 1)
        self.chunks += 1
        if self.all_tensors:
            sq = np.sum(np.square(x, dtype=np.float32), axis=0, dtype=np.float32)
            for suffix in (LayerTensor.FFN_GATE_SHEXP, LayerTensor.FFN_UP_SHEXP):
                self.add_dense(blk(layer, suffix), None, sq, x.shape[0])

    def add_dense(self, name: str, x: np.ndarray | None, sq: np.ndarray | None = None, rows: int = 0) -> None:
        """Accumulate one regular tensor's input rows x [T, ncols] (or a precomputed Σx² over `rows`)."""
        if sq is None:
            x = np.asarray(x, np.float32).reshape(-1, np.asarray(x).shape[-1])
            sq, rows = np.sum(np.square(x), axis=0, dtype=np.float32), x.shape[0]
        slot = self.dense.setdefault(name, [np.zeros(sq.shape[0], np.float32), 0])
        slot[0] += sq
        slot[1] += rows

    def to_imatrix(self, dataset: str = "", chunk_size: int = 0, partial: bool = False) -> Imatrix:
        """Entries in ds4's order: per layer gate, up, down (routed), then any regular tensors."""
        im = Imatrix(datasets=[dataset] if dataset else [], chunks=self.chunks, chunk_size=chunk_size,
                     tokens=self.tokens, partial=partial)
        for layer in range(self.config.n_layer):
            c = self.counts[layer].astype(np.float32)
            for suffix in (LayerTensor.FFN_GATE_EXPS, LayerTensor.FFN_UP_EXPS):
                im.entries[blk(layer, suffix)] = ImatrixEntry(self.gate_up_sum2[layer].copy(), c)
            im.entries[blk(layer, LayerTensor.FFN_DOWN_EXPS)] = ImatrixEntry(
                self.down_sum2[layer].copy(), self.down_counts[layer].astype(np.float32))
        for name, (sq, rows) in self.dense.items():
            im.entries[name] = ImatrixEntry(sq.reshape(1, -1).copy(), np.array([rows], np.float32))
        return im


_SHARED_GATE_UP = ("." + LayerTensor.FFN_GATE_SHEXP.value, "." + LayerTensor.FFN_UP_SHEXP.value)


class ImatrixHooks(Hooks):
    """Feeds a RoutedAccumulator (observation only: the forward pass is never changed)."""

    def __init__(self, acc: RoutedAccumulator, should_stop=None):
        self.acc = acc
        self.should_stop = should_stop

    def begin(self, pos0, tokens):
        # A pending Ctrl+C stops here, at a chunk boundary, so the sums, the counts and the token
        # total always describe the same tokens.
        if self.should_stop is not None and self.should_stop():
            raise KeyboardInterrupt
        self.acc.tokens += len(tokens)

    def routed_inputs(self, layer, x, expert_ids, weights, down_inputs):
        self.acc.add_routed(layer, x, expert_ids, down_inputs)

    def linear_input(self, layer, name, x):
        # The engine reports every 2-D layer projection (ds4.engine.hooks); the shared expert's
        # gate/up are already summed from the routed x in add_routed, so they are skipped here.
        if self.acc.all_tensors and not name.endswith(_SHARED_GATE_UP):
            self.acc.add_dense(name, x)

    def wants_linear_inputs(self) -> bool:
        return self.acc.all_tensors


# ---- calibration text ------------------------------------------------------------------------------

@dataclass
class Prompt:
    id: str
    text: str  # rendered chat text (special tokens as text)
    mode: str = ""
    category: str = ""
    source: str = ""


def split_rendered(text: str) -> list[Prompt]:
    """Prompts between `===== DS4_IMATRIX_PROMPT ...` marker lines, trimmed, empty ones skipped.
    A text without a marker is one prompt."""
    if PROMPT_MARKER not in text:
        t = text.strip()
        return [Prompt("prompt-0", t)] if t else []
    out = []
    pieces = re.split(rf"^{re.escape(PROMPT_MARKER)}([^\n]*)(?:\n|$)", text, flags=re.M)
    # pieces = [before, header1, body1, header2, body2, ...]
    for k in range(1, len(pieces), 2):
        header = pieces[k].replace("=====", "").split()
        body = pieces[k + 1].strip()
        if not body:
            continue
        pid = header[0] if header else f"prompt-{len(out)}"
        category = header[1] if len(header) > 1 else ""
        mode = header[2] if len(header) > 2 else ""
        source = " ".join(header[3:])
        out.append(Prompt(pid, body, mode, category, source))
    return out


def marker_line(p: Prompt) -> str:
    fields = " ".join(x for x in (p.id, p.category, p.mode, p.source) if x)
    return f"\n\n{PROMPT_MARKER} {fields} =====\n"


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    path = Path(path)
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: malformed JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: a record must be a JSON object")
            yield rec


def load_prompts(path: str | os.PathLike, modes: tuple[str, ...] = ("think", "nothink")) -> list[Prompt]:
    """Calibration prompts from a JSONL(.gz) of records (their `rendered` text, else rendered here) or
    from rendered marker text (.txt / .txt.gz)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl") or name.endswith(".json"):
        from ds4.imatrix.dataset import render_record

        out = []
        for i, rec in enumerate(iter_jsonl(path)):
            for p in render_record(rec, modes, index=i):
                out.append(p)
        return out
    with _open_text(path) as f:
        return split_rendered(f.read())


# ---- the collection loop -------------------------------------------------------------------------

@dataclass
class CollectResult:
    accumulator: RoutedAccumulator
    prompts: int
    tokens: int
    interrupted: bool


def prefill_fresh(model, ids: list[int], hooks: Hooks, chunk: int = 2048, session=None) -> None:
    """Prefill `ids` from an empty state with `hooks` attached (each prompt is independent).

    Pass a `Session` to reuse its buffers; it is reset first."""
    from ds4.engine.session import Session

    if session is None or session.ctx < len(ids):
        session = Session(model, ctx=max(len(ids), 2), prefill_chunk=chunk, hooks=hooks)
    else:
        session.invalidate()
        session.hooks = hooks
    session.prefill(ids)


def collect(model, prompts: list[Prompt], *, ctx: int = 32768, max_tokens: int = 0, chunk: int = 2048,
            all_tensors: bool = False, progress: bool = True) -> CollectResult:
    """Prefill each prompt (truncated to ctx and to the remaining token budget) and accumulate.

    The first Ctrl+C stops at the next prefill chunk boundary (a second one stops at once); what was
    accumulated so far is returned, marked interrupted.
    """
    import signal
    import threading

    from tqdm import tqdm

    from ds4.engine.session import Session

    stop = threading.Event()
    acc = RoutedAccumulator(model.config, all_tensors)
    hooks = ImatrixHooks(acc, stop.is_set)
    tokenizer = model.tokenizer
    bar = tqdm(total=max_tokens or None, unit="tok", unit_scale=True, disable=not progress,
               desc="imatrix", dynamic_ncols=True)
    shown = [0]

    def on_chunk(done_in_prompt: int, total_in_prompt: int) -> None:
        bar.update(acc.tokens - shown[0])
        shown[0] = acc.tokens

    session = Session(model, ctx=max(ctx, 2), prefill_chunk=min(chunk, max(ctx, 2)), hooks=hooks,
                      progress=on_chunk)
    from ds4.engine import power
    power.attach(session)  # --power: throttle between layers (a no-op unless one is installed)
    hooks = session.hooks  # prefill_fresh re-assigns these for every prompt

    def on_sigint(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGINT, on_sigint)
    done = 0
    interrupted = False
    try:
        for p in prompts:
            if stop.is_set():
                raise KeyboardInterrupt
            ids = tokenizer.encode_chat(p.text)[:ctx]
            if max_tokens:
                ids = ids[: max_tokens - acc.tokens]
            if not ids:
                break
            prefill_fresh(model, ids, hooks, chunk, session)
            done += 1
            bar.set_postfix(prompts=done, refresh=False)
            if max_tokens and acc.tokens >= max_tokens:
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        bar.close()
    return CollectResult(acc, done, acc.tokens, interrupted)
