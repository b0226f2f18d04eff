"""Driving the engine for the steering tools: prefill a prompt, decode greedily, capture activations.

Everything goes through `ds4.engine.session.Session` and `ds4.engine.hooks`; nothing here knows the
model math.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4.engine.hooks import HookList, Hooks
from ds4.steering.build import COMPONENT_KIND, LastRowCapture, capture_prompts, render_prompt


class Runner:
    """One timeline with hooks: `prefill(ids)` from an empty state, then `decode(token)`; both return
    the logits of the last position."""

    def __init__(self, model, hooks: Hooks | None, ctx: int):
        from ds4.engine.session import Session

        self.session = Session(model, ctx=max(ctx, 2), hooks=hooks)

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.session.invalidate()
        return self.session.prefill(ids)

    def decode(self, token: int) -> np.ndarray:
        return self.session.decode(token)


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stopped: bool  # ended with EOS (else hit the token limit or the context)


def generate_greedy(model, prompt_ids: list[int], n_tokens: int, hooks: Hooks | None = None,
                    ctx: int = 4096) -> Generation:
    from ds4.engine.sampling import argmax

    tok = model.tokenizer
    ctx = max(ctx, len(prompt_ids) + 1)
    runner = Runner(model, hooks, ctx)
    logits = runner.prefill(list(prompt_ids))
    out: list[int] = []
    stopped = False
    for _ in range(n_tokens):
        t = argmax(logits)
        if t == tok.eos_id:
            stopped = True
            break
        out.append(t)
        if len(prompt_ids) + len(out) >= ctx:
            break
        logits = runner.decode(t)
    return Generation(out, tok.decode(out).decode("utf-8", errors="replace"), stopped)


class _CaptureHooks(Hooks):
    def __init__(self, capture: LastRowCapture):
        self.capture = capture

    def sublayer_output(self, layer, kind, y):
        self.capture.observe(layer, kind, y)
        return None


def capture_last_rows(model, prompts: list[str], component: str = "ffn_out", *, system: str = "",
                      thinking: bool = False, ctx: int = 512, extra_hooks: Hooks | None = None,
                      progress=None) -> np.ndarray:
    """[n_prompts, n_layer, n_embd]: the component of every layer at each rendered prompt's last token.

    `extra_hooks` run before the capture (their edits are what is captured)."""
    cfg = model.config
    cap = LastRowCapture(cfg.n_layer, cfg.n_embd, COMPONENT_KIND[component])
    hooks = _CaptureHooks(cap) if extra_hooks is None else HookList(extra_hooks, _CaptureHooks(cap))
    tok = model.tokenizer

    def run(prompt: str) -> None:
        ids = tok.encode_chat(render_prompt(prompt, system, thinking))  # never cut: the last token is captured
        Runner(model, hooks, max(ctx, len(ids))).prefill(ids)

    return capture_prompts(run, cap, prompts, progress)
