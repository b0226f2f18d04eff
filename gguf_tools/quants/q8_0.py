"""Q8_0: 32 weights per 34-byte block, f16 scale d and int8 codes; w = d * q (tooling-spec §2.4).

Importance weights are accepted and ignored (ggml quantizes Q8_0 the same way with or without them).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._numeric import F32, fp16_bits_to_fp32, fp32_to_fp16_bits, roundf
from ._rows import dequantize_blocks, empty_blocks, float_rows

QK = 32
BLOCK_BYTES = 34
BLOCK_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])
assert BLOCK_DTYPE.itemsize == BLOCK_BYTES


# ---------------------------------------------------------------- numpy reference


def _roundf_np(v: np.ndarray) -> np.ndarray:
    """C roundf (half away from zero) in float32."""
    r = np.trunc(v)
    away = np.abs(v - r) >= np.float32(0.5)
    return (r + np.where(away, np.sign(v), np.float32(0))).astype(np.float32)


def quantize_reference(x: np.ndarray) -> np.ndarray:
    """Readable numpy version of `quantize`; same bytes."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    xb = x.reshape(rows, cols // QK, QK)
    amax = np.max(np.abs(xb), axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    blocks = np.empty((rows, cols // QK), dtype=BLOCK_DTYPE)
    blocks["d"] = d.astype(np.float16)
    blocks["qs"] = _roundf_np(xb * inv[..., None]).astype(np.int8)
    return blocks.view(np.uint8).reshape(rows, -1)


def dequantize_reference(raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    blocks = raw.reshape(-1, BLOCK_BYTES).view(BLOCK_DTYPE).reshape(-1)
    y = blocks["d"].astype(np.float32)[:, None] * blocks["qs"].astype(np.float32)
    return y.reshape(*raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES * QK)


# ---------------------------------------------------------------- numba kernels


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_rows(x, out):
    rows, cols = x.shape
    nb = cols // QK
    for r in prange(rows):
        for b in range(nb):
            amax = F32(0.0)
            for j in range(QK):
                a = abs(x[r, b * QK + j])
                amax = amax if amax > a else a
            d = amax / F32(127.0)
            inv = F32(1.0) / d if d != 0 else F32(0.0)
            h = fp32_to_fp16_bits(d)
            o = b * BLOCK_BYTES
            out[r, o] = h & 0xFF
            out[r, o + 1] = h >> 8
            for j in range(QK):
                q = np.int32(roundf(x[r, b * QK + j] * inv))
                out[r, o + 2 + j] = np.uint8(q & 0xFF)


@njit(inline="always")
def _block_scale(raw, r, o):
    return fp16_bits_to_fp32(np.int32(raw[r, o]) | (np.int32(raw[r, o + 1]) << 8))


@njit(inline="always")
def _code(raw, r, o, j):
    q = np.int32(raw[r, o + 2 + j])
    return F32(q - 256 if q > 127 else q)


@njit(parallel=True, cache=True, error_model="numpy")
def _dequantize_rows(raw, out):
    rows = raw.shape[0]
    nb = raw.shape[1] // BLOCK_BYTES
    for r in prange(rows):
        for b in range(nb):
            o = b * BLOCK_BYTES
            d = _block_scale(raw, r, o)
            for j in range(QK):
                out[r, b * QK + j] = d * _code(raw, r, o, j)


# ---------------------------------------------------------------- public


def quantize(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    x = float_rows(x, QK, "Q8_0")
    out = empty_blocks(x, QK, BLOCK_BYTES)
    _quantize_rows(x, out)
    return out


def dequantize(raw: np.ndarray) -> np.ndarray:
    return dequantize_blocks(_dequantize_rows, raw, QK, BLOCK_BYTES)
