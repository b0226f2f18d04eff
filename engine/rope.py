"""Partial interleaved RoPE on the tail of each head (model-spec §3.1).

Window-only layers rotate with base `rope_base` (10000) and no scaling; compressed layers and
everything inside them (q, kv, compressed rows, indexer q and keys) use `compress_rope_base`
(160000) with YaRN frequency blending and no magnitude correction. Angles are float32
(position · θ), as the official `precompute_freqs_cis` does.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ds4.engine.config import Config, yarn_low_high

F32 = np.float32


@lru_cache(maxsize=64)
def _inv_freq(rope_dim: int, base: float, yarn: tuple | None) -> np.ndarray:
    exponent = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    theta = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(F32)
    if yarn is None:
        return theta
    factor, low, high = yarn
    if high == low:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    return (theta / np.float32(factor) * ramp + theta * (np.float32(1.0) - ramp)).astype(F32)


@lru_cache(maxsize=64)
def inv_freq(cfg: Config, compressed: bool) -> np.ndarray:
    """θ_i for the pairs of the RoPE tail: plain for window-only layers, YaRN-blended for compressed ones."""
    if not compressed:
        return _inv_freq(cfg.rope_dim, float(cfg.rope_base), None)
    low, high = yarn_low_high(cfg)
    return _inv_freq(cfg.rope_dim, float(cfg.compress_rope_base), (float(cfg.rope_scaling_factor), low, high))


def cos_sin(freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [len(positions), rope_dim/2] at float32 angles pos·θ."""
    ang = np.asarray(positions, dtype=np.float32)[:, None] * freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def apply_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, inverse: bool = False) -> np.ndarray:
    """Rotate interleaved pairs (x[n_nope+2i], x[n_nope+2i+1]) of the last `rope_dim` dims.

    x is [T, ..., hd] and cos/sin are [T, rope_dim/2] (broadcast over the middle axes). `inverse`
    rotates by −φ (used to take RoPE back out of the attention output). Returns a new array.
    """
    out = np.array(x, dtype=F32, copy=True)
    extra = (1,) * (x.ndim - 2)
    c = cos.reshape(cos.shape[0], *extra, cos.shape[1])
    s = sin.reshape(sin.shape[0], *extra, sin.shape[1])
    if inverse:
        s = -s
    tail = x[..., x.shape[-1] - rope_dim:]
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    out[..., x.shape[-1] - rope_dim::2] = x0 * c - x1 * s
    out[..., x.shape[-1] - rope_dim + 1::2] = x0 * s + x1 * c
    return out
