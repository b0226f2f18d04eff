"""Numeric primitives of the forward pass (model-spec §3.1), readable numpy.

RMSNorm, the official FP8 KV rounding simulation (e4m3, power-of-two scale per 64 values) and the
indexer's quantization-aware simulation (Walsh-Hadamard rotation, then e2m1 FP4 per 32 values).
Every function works on the last axis of an array of any leading shape and returns float32.
The rounding helpers are written with `frexp`/`rint` so the numba kernels can do exactly the same;
tests hold them to ml_dtypes' float8_e4m3fn / float4_e2m1fn casts.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 64  # KV rounding block (values per power-of-two scale)
FP4_BLOCK = 32  # indexer rounding block


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """y = x / sqrt(mean(x²) + eps) ⊙ weight over the last axis (weight None: UnitRMS)."""
    x = np.asarray(x, dtype=F32)
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=F32)
    y = x * (F32(1.0) / np.sqrt(ms + F32(eps)))
    if weight is not None:
        y = y * weight
    return y.astype(F32, copy=False)


def _pow2_ceil(v: np.ndarray) -> np.ndarray:
    """2^ceil(log2(v)) for positive float32 v, exactly (no log rounding)."""
    m, e = np.frexp(v)  # v = m·2^e, m in [0.5, 1)
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(np.ones_like(v), e).astype(F32)


def _round_minifloat(x: np.ndarray, mant_bits: int, min_exp: int) -> np.ndarray:
    """Round to the nearest value with `mant_bits` stored mantissa bits and exponents ≥ min_exp
    (subnormals below), ties to an even code. Inputs must already be clamped to the format's range."""
    ax = np.abs(x)
    _, e = np.frexp(np.where(ax > 0, ax, F32(1.0)))
    e = np.maximum(e - 1, min_exp)  # floor(log2|x|), floored at the smallest normal exponent
    step = np.ldexp(np.ones_like(ax), e - mant_bits)
    return (np.rint(x / step) * step).astype(F32)


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """float8_e4m3fn round-to-nearest-even of values already within ±448."""
    return _round_minifloat(np.asarray(x, F32), 3, -6)


def e2m1_round(x: np.ndarray) -> np.ndarray:
    """float4_e2m1 round-to-nearest-even of values already within ±6 (grid 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    return _round_minifloat(np.asarray(x, F32), 1, 0)


def fp8_kv_round(x: np.ndarray, n_nope: int) -> np.ndarray:
    """Official KV simulation: dims [0, n_nope) in blocks of 64 go through e4m3 with a power-of-two
    scale 2^ceil(log2(amax/448)), amax floored at 1e-4; the RoPE tail is left alone."""
    x = np.array(x, dtype=F32, copy=True)
    lead = x.shape[:-1]
    blocks = x[..., :n_nope].reshape(*lead, n_nope // FP8_BLOCK, FP8_BLOCK)
    amax = np.maximum(np.max(np.abs(blocks), axis=-1, keepdims=True), F32(1e-4))
    scale = _pow2_ceil((amax / F32(E4M3_MAX)).astype(F32))
    q = np.clip(blocks / scale, -E4M3_MAX, E4M3_MAX)
    x[..., :n_nope] = (e4m3_round(q) * scale).reshape(*lead, n_nope)
    return x


def hadamard(x: np.ndarray) -> np.ndarray:
    """Sylvester Walsh-Hadamard transform (natural order) of the last axis, scaled by 1/√n."""
    x = np.array(x, dtype=F32, copy=True)
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        x = y.reshape(*lead, n)
        h *= 2
    return (x * F32(1.0 / np.sqrt(n))).astype(F32)


def fp4_round(x: np.ndarray) -> np.ndarray:
    """FP4 e2m1 simulation in blocks of 32: scale 2^ceil(log2(amax/6)), amax floored at 6·2⁻¹²⁶."""
    x = np.asarray(x, dtype=F32)
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, n // FP4_BLOCK, FP4_BLOCK)
    amax = np.maximum(np.max(np.abs(blocks), axis=-1, keepdims=True), F32(6.0 * 2.0**-126))
    scale = _pow2_ceil((amax / F32(E2M1_MAX)).astype(F32))
    q = np.clip(blocks / scale, -E2M1_MAX, E2M1_MAX)
    return (e2m1_round(q) * scale).reshape(*lead, n).astype(F32)


def indexer_qat(x: np.ndarray) -> np.ndarray:
    """Official indexer simulation on 128-vectors: Hadamard rotation then FP4 rounding."""
    return fp4_round(hadamard(x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(F32(0.0), x).astype(F32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (F32(1.0) / (F32(1.0) + np.exp(-x))).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x * sigmoid(x)).astype(F32)
