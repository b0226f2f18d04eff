"""Building a steering direction from two prompt sets (tooling-spec §8.2).

Each prompt is rendered as a one-turn chat ending at the assistant's `</think>` (or `<think>` with
thinking), prefilled, and the chosen sublayer output (ffn_out or attn_out) of every layer is captured at
the last prompt row through the engine hooks. Per layer:

    direction = normalize(mean(good) − mean(bad))                       (double precision)
    --pair-normalize:   normalize(mean_i normalize(good_i − bad_i))
    unless --no-orthogonalize:  b = normalize(mean(bad)); direction = normalize(direction − (direction·b)·b)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ds4.gguf_tools.constants import ASSISTANT_TEXT, BOS_TEXT, THINK_CLOSE_TEXT, THINK_OPEN_TEXT, USER_TEXT

DEFAULT_SYSTEM = "You are a helpful assistant."
COMPONENT_KIND = {"ffn_out": "ffn", "attn_out": "attn"}


def read_prompt_file(path: str | os.PathLike) -> list[str]:
    """One prompt per non-empty line; lines starting with '#' are comments."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def render_prompt(prompt: str, system: str = DEFAULT_SYSTEM, thinking: bool = False) -> str:
    """BOS + system + <｜User｜> + prompt + <｜Assistant｜> + (<think> | </think>), as build_direction does."""
    return (BOS_TEXT + (system or "") + USER_TEXT + prompt + ASSISTANT_TEXT
            + (THINK_OPEN_TEXT if thinking else THINK_CLOSE_TEXT))


def normalize(v: np.ndarray) -> np.ndarray:
    """v/‖v‖₂ per last axis; rows of zero norm are returned unchanged."""
    v = np.asarray(v, dtype=np.float64)
    n = np.linalg.norm(v, axis=-1, keepdims=True)
    return np.where(n > 0, v / np.where(n > 0, n, 1.0), v)


def direction_from_activations(good: np.ndarray, bad: np.ndarray, *, pair_normalize: bool = False,
                               orthogonalize: bool = True) -> np.ndarray:
    """good, bad: [n_prompts, n_layer, n_embd] captured rows → unit directions [n_layer, n_embd] f32."""
    good = np.asarray(good, dtype=np.float64)
    bad = np.asarray(bad, dtype=np.float64)
    n = min(len(good), len(bad))
    if n == 0:
        raise ValueError("need at least one prompt in each set")
    good, bad = good[:n], bad[:n]
    if pair_normalize:
        direction = normalize(normalize(good - bad).mean(axis=0))
    else:
        direction = normalize(good.mean(axis=0) - bad.mean(axis=0))
    if orthogonalize:
        b = normalize(bad.mean(axis=0))
        direction = normalize(direction - np.sum(direction * b, axis=-1, keepdims=True) * b)
    return direction.astype(np.float32)


class LastRowCapture:
    """Hooks callbacks that keep the last row of one sublayer output per layer (the prompt's last token).

    Prefill may run in chunks; every chunk overwrites, so after the prompt the last chunk's last row stays.
    """

    def __init__(self, n_layer: int, n_embd: int, kind: str):
        self.kind = kind
        self.rows = np.zeros((n_layer, n_embd), np.float32)
        self.seen = np.zeros(n_layer, bool)

    def reset(self) -> None:
        self.rows[:] = 0.0
        self.seen[:] = False

    def observe(self, layer: int, kind: str, y: np.ndarray) -> None:
        if kind == self.kind:
            y = np.asarray(y)
            self.rows[layer] = y.reshape(-1, y.shape[-1])[-1]
            self.seen[layer] = True


def capture_prompts(run_prompt: Callable[[str], None], capture: LastRowCapture, prompts: Iterable[str],
                    progress=None) -> np.ndarray:
    """Run each rendered prompt through `run_prompt` (which prefills with `capture` attached) and stack
    the captured rows: [n_prompts, n_layer, n_embd]."""
    out = []
    for text in prompts:
        capture.reset()
        run_prompt(text)
        if not capture.seen.all():
            missing = np.flatnonzero(~capture.seen).tolist()
            raise RuntimeError(f"the engine reported no {capture.kind} output for layers {missing}")
        out.append(capture.rows.copy())
        if progress is not None:
            progress.update(1)
    return np.stack(out)
