"""A reduced DS4 config for quantized-model tests: `small` narrowed to hidden 256 and 4 layers
(window, window, ratio 4, ratio 128), so every matrix the q2/q4 mixes quantize has rows of a
multiple of 256 and Q4_K/Q2_K/IQ2_XXS all apply, while synth + convert stay a few seconds."""

from __future__ import annotations

import dataclasses

from ds4.engine.config import Config, preset


def reduced_config(n_expert: int = 32) -> Config:
    return dataclasses.replace(preset("small"), n_layer=4, n_embd=256, compress_ratios=(0, 0, 4, 128),
                               swiglu_clamp=(10.0,) * 4, n_expert=n_expert, name="ds4-reduced")
